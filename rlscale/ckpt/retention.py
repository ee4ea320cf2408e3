"""Which committed checkpoints to keep."""

from __future__ import annotations

import math


def steps_to_delete(
    steps: list[tuple[int, dict]], keep_top_k: int | None, metric_name: str | None, higher_is_better: bool = True
) -> list[int]:
    """steps: (step, metrics) of committed checkpoints. Returns the steps to remove.

    The newest step is always kept. With a metric, the best `keep_top_k` by it are kept too
    (steps lacking the metric rank last); without one, the newest `keep_top_k`.
    keep_top_k=None keeps everything.
    """
    if keep_top_k is None or not steps:
        return []
    newest = max(step for step, _ in steps)

    def score(item: tuple[int, dict]) -> tuple[float, int]:
        step, metrics = item
        if metric_name is None:
            return (0.0, step)
        value = metrics.get(metric_name)
        if value is None or not math.isfinite(float(value)):
            return (-math.inf, step)
        return (float(value) if higher_is_better else -float(value), step)

    ranked = sorted(steps, key=score, reverse=True)
    keep = {step for step, _ in ranked[:keep_top_k]} | {newest}
    return sorted(step for step, _ in steps if step not in keep)
