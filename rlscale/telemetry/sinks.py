"""Where per-step metrics go: JSONL always, TensorBoard when enabled."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlscale.errors import UserError


class JsonlSink:
    """Appends one JSON object per step to <log_dir>/metrics.jsonl (flushed every line)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("logger.tensorboard_enabled needs the 'tensorboard' package installed") from None
        self._writer = SummaryWriter(log_dir=str(directory))

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


def build_sinks(log_dir: Path, tensorboard: bool, wandb: bool) -> Sinks:
    if wandb:
        raise UserError("logger.wandb_enabled: Weights & Biases logging is not available yet; "
                        "use logger.tensorboard_enabled=true")
    sinks: list = [JsonlSink(Path(log_dir) / "metrics.jsonl")]
    if tensorboard:
        sinks.append(TensorBoardSink(Path(log_dir) / "tensorboard"))
    return Sinks(sinks)
