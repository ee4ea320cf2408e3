"""Durable saves: workers write their files into tmp_step_N/, the controller commits.

This version saves synchronously; its interface (save / wait / latest / load / close) is the
seam where the asynchronous engine plugs in.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rlscale.ckpt import layout
from rlscale.ckpt.retention import steps_to_delete
from rlscale.config import CheckpointingConfig
from rlscale.errors import UserError


@dataclass
class SaveReport:
    step: int
    path: str
    bytes: int
    stall_s: float  # time the training loop was held
    persist_s: float  # time until the step was durable and committed
    gbps: float
    free_bytes: int

    def metrics(self) -> dict[str, float]:
        return {"ckpt/bytes": self.bytes, "ckpt/stall_s": self.stall_s, "ckpt/persist_s": self.persist_s,
                "ckpt/GBps": self.gbps, "ckpt/free_GB": self.free_bytes / 1e9}


class Checkpointer:
    def __init__(self, root: Path, settings: CheckpointingConfig, config_yaml: str, config_digest: str):
        self.root = Path(root)
        self.settings = settings
        self.config_yaml = config_yaml
        self.config_digest = config_digest

    def prepare(self) -> None:
        """Check the directory is writable and remove saves a crash left half-written."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".rlscale_write_probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise UserError(f"checkpointing.checkpoint_dir {str(self.root)!r} is not writable: {exc.strerror}") from None
        for stale in layout.stale_tmp_dirs(self.root):
            shutil.rmtree(stale, ignore_errors=True)

    def latest(self) -> Path | None:
        return layout.latest_intact(self.root)

    def save(self, step: int, group, trainer_state: dict, metrics: dict[str, float]) -> SaveReport:
        started = time.perf_counter()
        tmp = self.root / layout.tmp_dir_name(step)
        final = self.root / layout.step_dir_name(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            files: list[str] = []
            for written in group.run_all("save_checkpoint_shard", [(str(tmp),)] * group.world_size):
                files += written
            (tmp / layout.TRAINER_STATE).write_text(json.dumps(trainer_state))
            (tmp / "config.yaml").write_text(self.config_yaml)
            files += [layout.TRAINER_STATE, "config.yaml"]
            sizes = {rel: (tmp / rel).stat().st_size for rel in files}
            for rel in files:
                layout.fsync_path(tmp / rel)
            manifest = {"step": step, "files": sizes, "metrics": metrics, "config_digest": self.config_digest,
                        "created_unix": time.time()}
            (tmp / layout.MANIFEST).write_text(json.dumps(manifest, indent=1))
            layout.fsync_path(tmp / layout.MANIFEST)
            for sub in {tmp / Path(rel).parent for rel in files}:
                layout.fsync_path(sub)
            if final.exists():  # a step re-saved after a resume: replace the older copy
                shutil.rmtree(final)
            tmp.rename(final)
            layout.fsync_path(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        elapsed = time.perf_counter() - started
        total = sum(sizes.values())
        self._apply_retention()
        return SaveReport(step=step, path=str(final), bytes=total, stall_s=elapsed, persist_s=elapsed,
                          gbps=total / elapsed / 1e9 if elapsed > 0 else 0.0,
                          free_bytes=shutil.disk_usage(self.root).free)

    def _apply_retention(self) -> None:
        committed = []
        for step, path in layout.committed_steps(self.root):
            manifest = layout.read_manifest(path)
            if manifest is not None:
                committed.append((step, manifest.get("metrics", {})))
        s = self.settings
        for step in steps_to_delete(committed, s.keep_top_k, s.metric_name, s.higher_is_better):
            shutil.rmtree(self.root / layout.step_dir_name(step), ignore_errors=True)

    def load(self, step_dir: Path, group) -> dict:
        """Restore every worker from step_dir and return the controller's trainer state."""
        verdict = layout.verify_step_dir(step_dir)
        if not verdict.ok:
            raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {verdict.reason}")
        group.run_all("load_checkpoint_shard", [(str(step_dir),)] * group.world_size)
        return json.loads((Path(step_dir) / layout.TRAINER_STATE).read_text())

    def wait(self) -> None:
        """Block until no save is in flight (saves are synchronous in this version)."""

    def close(self) -> None:
        self.wait()


