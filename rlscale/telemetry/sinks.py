"""Where per-step metrics go: JSONL always; TensorBoard, Weights & Biases and MLflow when enabled."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from rlscale.errors import UserError
from rlscale.fsutil import write_atomic


class JsonlSink:
    """Appends one JSON object per step to <log_dir>/metrics.jsonl (flushed every line).

    A run that resumes from step N first drops the rows after N (steps it will run again), so
    every step appears once; a fresh run (start_step 0, not resumed) starts an empty file. When
    step N's own row is missing (a crash between a synchronous save's commit and the row's
    write), `resumed_row` (the metrics its checkpoint recorded) stands in for it.
    """

    def __init__(self, path: Path, resumed_step: int | None = None, resumed_row: dict | None = None):
        self.path = Path(path)
        kept, steps = [], set()
        if self.path.exists() and resumed_step is not None:
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    step = json.loads(line).get("step", 0)
                except (ValueError, AttributeError):
                    continue  # a line cut short by a crash
                if step <= resumed_step:
                    kept.append(line + "\n")
                    steps.add(step)
        if resumed_step is not None and resumed_row and resumed_step not in steps:
            kept.append(json.dumps({"step": resumed_step, **self._clean(resumed_row)}) + "\n")
        if self.path.exists() or kept:
            write_atomic(self.path, "".join(kept))
        self._file = self.path.open("a", encoding="utf-8")

    @staticmethod
    def _clean(metrics: dict) -> dict:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **self._clean(metrics)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, directory: Path, resumed_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("logger.tensorboard_enabled needs the 'tensorboard' package installed") from None
        # purge_step hides events a crashed run wrote after the step it resumes from; a fresh start
        # hides all of them (a run that crashed before its first save, started over)
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=0 if resumed_step is None else resumed_step + 1)

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

    def notes(self) -> list[str]:
        """Lines for the run's start: where an endpoint serves (a port 0 is the one the OS chose)."""
        return [f"Prometheus metrics on port {sink.port} (/metrics)" for sink in self.sinks
                if hasattr(sink, "port")]


def _resolved_config(log_dir: Path, config) -> dict[str, Any]:
    """The run's resolved config as a dict: the one given, else <log_dir>/config.yaml, else {}."""
    if config is None:
        path = Path(log_dir) / "config.yaml"
        return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.exists() else {}
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config)


def build_sinks(log_dir: Path, tensorboard: bool, wandb: bool, resumed_step: int | None = None,
                prometheus_port: int | None = None, *, mlflow: bool | None = None, config=None,
                resumed_row: dict | None = None) -> Sinks:
    """resumed_step: the step a resumed run continues after (None for a fresh run); resumed_row:
    that step's metrics as its checkpoint recorded them (for metrics.jsonl, if its row is missing).

    config: the resolved Config (or its dict); None reads <log_dir>/config.yaml. It supplies the
    logger.wandb / logger.mlflow settings, the params recorded with the run, and, when mlflow is
    None, logger.mlflow_enabled.
    """
    from rlscale.config import LoggerConfig

    log_dir = Path(log_dir)
    resolved = _resolved_config(log_dir, config) if (wandb or mlflow is not False) else {}
    logger = LoggerConfig.model_validate(resolved.get("logger") or {})
    if mlflow is None:
        mlflow = logger.mlflow_enabled
    # The optional sinks open first: a missing package fails before metrics.jsonl is touched.
    sinks: list = []
    try:
        if wandb:
            from rlscale.telemetry.wandb_sink import WandbSink

            sinks.append(WandbSink(log_dir, logger.wandb, resolved))
        if mlflow:
            from rlscale.telemetry.mlflow_sink import MlflowSink

            sinks.append(MlflowSink(log_dir, logger.mlflow, resolved))
        if prometheus_port is not None:
            from rlscale.telemetry.prometheus import PrometheusSink

            sinks.append(PrometheusSink(prometheus_port))
        if tensorboard:  # after the others: opening it writes an event file that purges older points
            sinks.append(TensorBoardSink(log_dir / "tensorboard", resumed_step))
        sinks.insert(0, JsonlSink(log_dir / "metrics.jsonl", resumed_step, resumed_row))
    except BaseException:
        Sinks(sinks).close()  # a sink that fails to open leaves none of the others open
        raise
    return Sinks(sinks)
