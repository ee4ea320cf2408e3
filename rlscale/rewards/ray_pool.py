"""Scoring spread over a Ray cluster: N actors, each running a RewardScorer process pool.

Each actor keeps the per-sample time limit of its own pool (a stuck sample is killed there);
the controller only splits the batch and merges the results. Used when `rewards.ray_actors > 0`,
so that scoring of long math answers scales with the cluster instead of the head node's cores.
It imports Ray to run those actors; Ray is started (and sized for them) by rlscale/ray_runtime.py.
"""

from __future__ import annotations

import time

from rlscale.ray_runtime import ray_module
from rlscale.rewards.loader import load_reward_function
from rlscale.rewards.scorer import RewardScorer, ScoreResult


class _RewardActor:
    def __init__(self, function: str, timeout_s: float, num_workers: int):
        self.scorer = RewardScorer(function, timeout_s, num_workers)

    def score(self, responses: list[str], answers: list[str]) -> ScoreResult:
        return self.scorer.score(responses, answers)


def merge_results(parts: list[ScoreResult], offsets: list[int], seconds: float) -> ScoreResult:
    """Concatenate the actors' results, in order; errors are renumbered to the whole batch."""
    first_error = None
    for part, offset in zip(parts, offsets):
        if part.first_error and first_error is None:
            index, _, rest = part.first_error.partition(":")
            number = index.removeprefix("sample ").strip()
            first_error = f"sample {int(number) + offset}:{rest}" if number.isdigit() else part.first_error
    return ScoreResult(
        rewards=[r for part in parts for r in part.rewards],
        num_timeouts=sum(p.num_timeouts for p in parts),
        num_errors=sum(p.num_errors for p in parts),
        seconds=seconds,
        first_error=first_error,
    )


class RayRewardPool:
    """The RewardScorer interface (score, close, context manager) over `num_actors` Ray actors."""

    def __init__(self, function: str, timeout_s: float, num_workers: int, num_actors: int):
        ray = ray_module()
        load_reward_function(function)  # a bad spec fails here, in one line, before any actor starts
        self.function = function
        actor_cls = ray.remote(_RewardActor)
        self._ray = ray
        self.actors = [actor_cls.options(num_cpus=num_workers).remote(function, timeout_s, num_workers)
                       for _ in range(num_actors)]

    def __enter__(self) -> RayRewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, responses: list[str], answers: list[str]) -> ScoreResult:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses for {len(answers)} answers")
        started = time.perf_counter()
        size, extra = divmod(len(responses), len(self.actors))
        refs, offsets, start = [], [], 0
        for i, actor in enumerate(self.actors):
            stop = start + size + (1 if i < extra else 0)
            refs.append(actor.score.remote(responses[start:stop], answers[start:stop]))
            offsets.append(start)
            start = stop
        parts = self._ray.get(refs)
        return merge_results(parts, offsets, time.perf_counter() - started)

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []
