"""Where per-step metrics go: JSONL always, TensorBoard when enabled."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlscale.errors import UserError
from rlscale.fsutil import write_atomic


class JsonlSink:
    """Appends one JSON object per step to <log_dir>/metrics.jsonl (flushed every line).

    A run that resumes from step N first drops the rows after N (steps it will run again), so
    every step appears once; a fresh run (start_step 0, not resumed) starts an empty file.
    """

    def __init__(self, path: Path, resumed_step: int | None = None):
        self.path = Path(path)
        if self.path.exists():
            kept = []
            if resumed_step is not None:
                for line in self.path.read_text(encoding="utf-8").splitlines():
                    try:
                        if json.loads(line).get("step", 0) <= resumed_step:
                            kept.append(line + "\n")
                    except ValueError:
                        continue  # a line cut short by a crash
            write_atomic(self.path, "".join(kept))
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: Path, resumed_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("logger.tensorboard_enabled needs the 'tensorboard' package installed") from None
        # purge_step hides events a crashed run wrote after the step it resumes from
        self._writer = SummaryWriter(log_dir=str(directory),
                                     purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Sinks:
    """Fan-out to every enabled sink."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(log_dir: Path, tensorboard: bool, wandb: bool, resumed_step: int | None = None,
                prometheus_port: int | None = None) -> Sinks:
    """resumed_step: the step a resumed run continues after (None for a fresh run)."""
    if wandb:
        raise UserError("logger.wandb_enabled: Weights & Biases logging is not available yet; "
                        "use logger.tensorboard_enabled=true")
    sinks: list = [JsonlSink(Path(log_dir) / "metrics.jsonl", resumed_step)]
    if tensorboard:
        sinks.append(TensorBoardSink(Path(log_dir) / "tensorboard", resumed_step))
    if prometheus_port is not None:
        from rlscale.telemetry.prometheus import PrometheusSink

        sinks.append(PrometheusSink(prometheus_port))
    return Sinks(sinks)
