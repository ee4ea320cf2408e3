"""MLflow sink (optional: pip install 'rlscale[mlflow]').

mlflow is imported only when logger.mlflow_enabled is set. The sink talks to its tracking server
through an MlflowClient (no global active run), logs the flattened resolved config as params and
per-step metrics, and keeps the run id in <log_dir>/mlflow_run_id so that a resumed rlscale run
continues the same MLflow run.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from rlscale.errors import UserError
from rlscale.fsutil import write_atomic
from rlscale.telemetry.wandb_sink import stable_run_id

RUN_ID_FILE = "mlflow_run_id"
MAX_PARAM_VALUE = 500  # the limit of older tracking servers (newer ones allow 6000)
_BATCH = 100  # params per log_batch call (MLflow's limit)
_BAD_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow accepts in metric and param keys


def sanitize_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; values longer than MLflow allows are truncated."""
    from rlscale.config import flat_dict

    return {sanitize_key(name): (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_VALUE]
            for name, value in flat_dict(config, prefix).items()}


def default_tracking_uri(log_dir: Path) -> str:
    return (Path(log_dir).resolve() / "mlruns").as_uri()


class MlflowSink:
    def __init__(self, log_dir: Path, settings, config: dict[str, Any] | None = None):
        try:
            import mlflow  # noqa: F401 - first, so that a missing package is reported as such
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserError("logger.mlflow_enabled needs the 'mlflow' package: pip install 'rlscale[mlflow]'") from None
        self._Metric = Metric
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = settings.tracking_uri or default_tracking_uri(log_dir)
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            # MLflow >= 3.7 refuses its file store unless asked (mlflow-skinny has no SQL store);
            # the store is re-opened on every call, so the opt-in stays set for the process.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        run = None
        run_id = stable_run_id(log_dir, RUN_ID_FILE)
        if run_id is not None:
            try:
                run = client.get_run(run_id)
            except Exception:  # noqa: BLE001 - e.g. the id belongs to another tracking server
                run = None
        if run is None:
            experiment = client.get_experiment_by_name(settings.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(settings.experiment))
            run = client.create_run(experiment_id, run_name=log_dir.resolve().name)
            write_atomic(log_dir / RUN_ID_FILE, run.info.run_id + "\n")
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        # A param cannot change once logged: a resumed run adds only keys the run lacks.
        known = set(run.data.params)
        params = [Param(k, v) for k, v in flatten(config or {}).items() if k not in known]
        for start in range(0, len(params), _BATCH):
            client.log_batch(self.run_id, params=params[start:start + _BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._Metric(sanitize_key(k), float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id, "FINISHED")
            self._client = None
