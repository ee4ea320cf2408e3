"""The controller's side of checkpointing: snapshot, then persist and commit in the background.

    report = checkpointer.save(step, group, trainer_state, metrics)  # returns after the snapshot
    ... next rollout runs while the workers' writer threads persist ...
    for done in checkpointer.poll(): log(done.commit_metrics())      # committed saves
    checkpointer.close()                                             # waits for the last commit

A save is snapshot (every worker copies its state into host staging buffers) -> persist (the
workers' writer threads write and fsync their files into tmp_step_N/) -> commit (here, in a
background thread that polls the workers until their writers are done: small controller files,
the policy's weight index, then manifest.json with sizes and checksums (and, for a sharded save,
every tensor's byte ranges: rlscale/ckpt/ranges.py), fsync, rename to step_N/, fsync of the
checkpoint dir, retention). The workers' methods it calls:
checkpoint_snapshot, checkpoint_poll, checkpoint_abort, load_checkpoint_shard.
At most one save is in flight: a save waits for the previous commit and reports how long.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlscale.ckpt import claim, layout, ranges
from rlscale.ckpt.faults import maybe_fault
from rlscale.ckpt.retention import steps_to_delete
from rlscale.ckpt.tensorfile import file_checksum, write_file
from rlscale.config import CheckpointingConfig
from rlscale.errors import UserError
from rlscale.fsutil import ensure_writable_dir

WEIGHT_INDEX = "policy/model.safetensors.index.json"


@dataclass
class SaveReport:
    step: int
    path: str
    bytes: int
    wait_s: float  # waited for the previous save to commit
    stall_s: float  # the training loop was held this long in all (wait + snapshot)
    direct_bytes: int = 0  # bytes over the staging budget, written during the snapshot
    persist_s: float | None = None  # snapshot start -> durable and committed; None while in flight
    gbps: float | None = None  # bytes / persist_s
    free_bytes: int | None = None  # left on the checkpoint file system after the commit
    retained_bytes: int | None = None  # all committed steps kept after retention

    @property
    def committed(self) -> bool:
        return self.persist_s is not None

    def metrics(self) -> dict[str, float]:
        """The snapshot's numbers; once committed, the persist numbers as well."""
        out = {"ckpt/bytes": float(self.bytes), "ckpt/wait_s": self.wait_s, "ckpt/stall_s": self.stall_s}
        return {**out, **self.commit_metrics()}

    def commit_metrics(self) -> dict[str, float]:
        """The persist numbers alone: what a later step logs when a background save commits."""
        if not self.committed:
            return {}
        out = {"ckpt/committed_step": float(self.step), "ckpt/persist_s": self.persist_s,
               "ckpt/GBps": self.gbps, "ckpt/free_GB": self.free_bytes / 1e9}
        if self.retained_bytes is not None:
            out["ckpt/retained_GB"] = self.retained_bytes / 1e9
        return out


class Checkpointer:
    def __init__(self, root: Path, settings: CheckpointingConfig, config_yaml: str, config_digest: str):
        self.root = Path(root)
        self.settings = settings
        self.config_yaml = config_yaml
        self.config_digest = config_digest
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._claim: str | None = None  # this run's claim on the directory (prepare)
        self._done: list[SaveReport] = []
        self._error: tuple[int, BaseException] | None = None

    def prepare(self, notify=None) -> bool:
        """Check the directory is writable, claim it for this run (rlscale/ckpt/claim.py: a second
        run would delete this one's saves in flight as a crash's leftovers) and remove saves a
        crash left half-written. `release` (or `close`) ends the claim. notify(line): told when the
        claim waits for a holder on another node. Returns whether it waited (the holder may have
        saved meanwhile: what the directory held before is out of date)."""
        ensure_writable_dir(self.root, "checkpointing.checkpoint_dir")
        waits: list[str] = []
        if self._claim is None:
            def on_wait(line: str) -> None:
                waits.append(line)
                if notify is not None:
                    notify(line)

            self._claim = claim.claim(self.root, self.settings.claim_wait_s, notify=on_wait)
        for stale in layout.stale_tmp_dirs(self.root):  # also steps retention had begun to delete
            shutil.rmtree(stale, ignore_errors=True)
        return bool(waits)

    def release(self) -> None:
        token, self._claim = self._claim, None
        claim.release(token)

    def latest(self) -> Path | None:
        return layout.latest_intact(self.root)

    # ------------------------------------------------------------------ saving

    def saves_at(self, step: int, last_step: int) -> bool:
        """Whether the loop saves once `step` is done: every checkpointing.save_period steps and
        at the run's last step (`last_step`, grpo.max_num_steps); never with checkpointing off."""
        return self.settings.enabled and (step % self.settings.save_period == 0 or step == last_step)

    def save(self, step: int, group, trainer_state: dict, metrics: dict[str, float]) -> SaveReport:
        """Snapshot every worker and start the persist; returns once the loop may go on (with
        async_save off, once committed). Raises the error of an earlier save that failed."""
        held = time.perf_counter()
        self._join()
        self._raise_error()
        wait_s = time.perf_counter() - held
        tmp = self.root / layout.tmp_dir_name(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        layout.set_stripe(tmp, self.settings.lustre_stripe_count, self.settings.lustre_stripe_size)
        # captured now: the loop mutates these while the commit runs
        small = {layout.TRAINER_STATE: json.dumps(trainer_state).encode(), "config.yaml": self.config_yaml.encode()}
        started = time.perf_counter()
        maybe_fault("snapshot.before")
        try:
            snaps = group.run_all("checkpoint_snapshot", [(str(tmp),)] * group.world_size)
        except BaseException as exc:
            group.run_all("checkpoint_abort")
            shutil.rmtree(tmp, ignore_errors=True)
            _reraise(step, exc)
        maybe_fault("snapshot.after")
        weight_map = dict(sorted(kv for s in snaps for kv in s["weight_map"].items()))
        if weight_map:  # a sharded save's policy/ is not a Hugging Face model dir: no index
            index = {"metadata": {"total_size": sum(s["weight_bytes"] for s in snaps)}, "weight_map": weight_map}
            small[WEIGHT_INDEX] = json.dumps(index, indent=1).encode()
        report = SaveReport(step=step, path=str(self.root / layout.step_dir_name(step)),
                            bytes=sum(s["bytes"] for s in snaps) + sum(map(len, small.values())),
                            wait_s=wait_s, stall_s=time.perf_counter() - held,
                            direct_bytes=sum(s["direct_bytes"] for s in snaps))
        self._thread = threading.Thread(  # not a daemon: an exiting process still commits
            target=self._commit, args=(dataclasses.replace(report), group, tmp, small, dict(metrics), started),
            name=f"ckpt-commit-{step}")
        self._thread.start()
        if not self.settings.async_save:
            self._join()
            self._raise_error()
            with self._lock:
                return self._done.pop()
        return report

    def _commit(self, report: SaveReport, group, tmp: Path, small: dict[str, bytes], metrics: dict,
                started: float) -> None:
        try:
            try:
                results = wait_for_writers(group)
            except BaseException:
                group.run_all("checkpoint_abort")
                raise
            files = {rel: entry for result in results for rel, entry in result["files"].items()}
            # the sharded layout's table of byte ranges (rlscale/ckpt/ranges.py); none in format 2
            tensors = ranges.table([r for result in results for r in result.get("ranges", [])])
            for rel, data in small.items():
                files[rel] = list(write_file(str(tmp / rel), data))
            maybe_fault("commit.before_manifest")
            manifest = {"format": 3 if tensors else 2, "step": report.step, "world_size": group.world_size,
                        "bytes": sum(size for size, _ in files.values()),
                        "files": {rel: files[rel][0] for rel in sorted(files)},
                        "checksums": {rel: files[rel][1] for rel in sorted(files)},
                        # a non-finite metric (a mean over no token) as null: the manifest stays strict JSON
                        "metrics": {k: v if not isinstance(v, float) or math.isfinite(v) else None
                                    for k, v in metrics.items()},
                        "config_digest": self.config_digest, "created_unix": time.time()}
            if tensors:
                manifest["tensors"] = tensors
            write_file(str(tmp / layout.MANIFEST), json.dumps(manifest, indent=1).encode())
            for sub in sorted({(tmp / rel).parent for rel in files}, reverse=True):
                layout.fsync_path(sub)  # the new names inside tmp/ are durable before the rename
            maybe_fault("commit.after_manifest")
            final = Path(report.path)
            if final.exists():  # a step re-saved after resuming from an older one: replace it
                layout.remove_step_dir(final)
            tmp.rename(final)
            maybe_fault("commit.after_rename")
            layout.fsync_path(self.root)
            maybe_fault("commit.after_fsync")
            report.persist_s = time.perf_counter() - started
            report.gbps = report.bytes / report.persist_s / 1e9
            report.retained_bytes = self._apply_retention()
            report.free_bytes = shutil.disk_usage(self.root).free
            with self._lock:
                self._done.append(report)
        except BaseException as exc:  # surfaced by the next poll / save / wait
            shutil.rmtree(tmp, ignore_errors=True)
            with self._lock:
                self._error = (report.step, exc)

    def _apply_retention(self) -> int:
        """Delete what retention drops; returns the bytes of the committed steps that remain."""
        committed, sizes = [], {}
        for step, path in layout.committed_steps(self.root):
            manifest = layout.read_manifest(path)
            if manifest is not None:
                committed.append((step, manifest.get("metrics", {})))
                sizes[step] = sum(manifest.get("files", {}).values()) + len(json.dumps(manifest))
        s = self.settings
        dropped = steps_to_delete(committed, s.keep_top_k, s.metric_name, s.higher_is_better)
        for step in dropped:
            layout.remove_step_dir(self.root / layout.step_dir_name(step))
        return sum(size for step, size in sizes.items() if step not in dropped)

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            _reraise(*error)

    def poll(self) -> list[SaveReport]:
        """Saves committed since the last call (without waiting); raises a failed save's error."""
        self._raise_error()
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self) -> list[SaveReport]:
        """Block until no save is in flight; returns the saves committed since the last poll."""
        self._join()
        return self.poll()

    def close(self) -> list[SaveReport]:
        try:
            return self.wait()
        finally:
            self.release()

    # ------------------------------------------------------------------ loading

    def load(self, step_dir: Path, group) -> dict:
        """Restore every worker from step_dir and return the controller's trainer state.
        Sizes are always checked, and the small files' checksums (the trainer state, configs:
        a few KB); the tensor files' checksums with checkpointing.verify_checksums (each worker
        checks the ones it reads)."""
        step_dir = Path(step_dir)
        verdict = layout.verify_step_dir(step_dir)
        if not verdict.ok:
            raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {verdict.reason}")
        manifest = layout.read_manifest(step_dir)
        verify = self.settings.verify_checksums
        for rel, recorded in manifest.get("checksums", {}).items():
            if not rel.endswith(".safetensors") and file_checksum(str(step_dir / rel)) != recorded:
                raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {rel} does not match its checksum")
        group.run_all("load_checkpoint_shard", [(str(step_dir), manifest, verify)] * group.world_size)
        return json.loads((step_dir / layout.TRAINER_STATE).read_text())


def wait_for_writers(group, interval_s: float = 0.05) -> list[dict]:
    """Every worker's finished persist (files, checksums). Workers are polled rather than asked to
    block: a worker that serves one call at a time stays free for the rollout meanwhile."""
    while True:
        results = group.run_all("checkpoint_poll")
        if all(result is not None for result in results):
            return results
        time.sleep(interval_s)


def _reraise(step: int, exc: BaseException) -> None:
    """A file-system error (disk full, quota, permissions) is the user's to fix: one line."""
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        raise UserError(f"checkpoint save of step {step} failed: {exc.strerror or exc}{where}") from exc
    raise exc
