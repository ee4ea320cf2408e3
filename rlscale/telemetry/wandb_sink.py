"""Weights & Biases sink (optional: pip install 'rlscale[wandb]').

wandb is imported only when logger.wandb_enabled is set. rlscale never reads, stores or passes
the API key: W&B reads WANDB_API_KEY (or its own login) itself. The run id is kept in
<log_dir>/wandb_run_id so that a resumed rlscale run continues the same W&B run.
"""

from __future__ import annotations

import math
import os
import secrets
import string
from pathlib import Path
from typing import Any

from rlscale.errors import UserError
from rlscale.fsutil import write_atomic

RUN_ID_FILE = "wandb_run_id"
_ID_CHARS = string.ascii_lowercase + string.digits


def resolve_mode(mode: str | None) -> str:
    """null = WANDB_MODE when set, else online with WANDB_API_KEY and offline without it."""
    if mode is not None:
        return mode
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def stable_run_id(log_dir: Path, file_name: str) -> str | None:
    path = Path(log_dir) / file_name
    if path.exists():
        run_id = path.read_text(encoding="utf-8").strip()
        return run_id or None
    return None


class WandbSink:
    def __init__(self, log_dir: Path, settings, config: dict[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise UserError("logger.wandb_enabled needs the 'wandb' package: pip install 'rlscale[wandb]'") from None
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        run_id = stable_run_id(log_dir, RUN_ID_FILE)
        if run_id is None:
            run_id = "".join(secrets.choice(_ID_CHARS) for _ in range(12))
            write_atomic(log_dir / RUN_ID_FILE, run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(
            project=settings.project,
            name=settings.name or log_dir.resolve().name,
            dir=str(log_dir),
            config=config or {},
            resume="allow",
            id=run_id,
            mode=resolve_mode(settings.mode),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: v for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        self._run.log(clean, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
