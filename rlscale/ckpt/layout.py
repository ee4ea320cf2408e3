"""On-disk layout of checkpoints, and the rules for trusting one.

<checkpoint_dir>/
  tmp_step_N/          being written; never trusted, removed at start
  dropped_step_N/      a step retention is deleting (renamed aside first); removed at start
  step_N/              committed: renamed from tmp_step_N/ after its manifest was fsynced
    manifest.json      written last: step, file sizes and checksums, metrics, config digest
                       (format 3, a sharded save: every tensor's byte ranges, rlscale/ckpt/ranges.py)
    trainer_state.json controller state: step, loader position, eval history
    config.yaml        the run's resolved config
    policy/            weights: a Hugging Face model directory (safetensors shards + index, config,
                       tokenizer) when not sharded; each rank's rows of them when sharded
                       (`rlscale ckpt export` makes a Hugging Face directory of those)
    optim/             AdamW moments by parameter name (whole, or each rank's rows), param groups
                       and LR scheduler
    rng/               each rank's RNG states
(see rlscale/workers/state_io.py for the files inside policy/, optim/ and rng/)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^tmp_step_(\d+)$")
_DROPPED_RE = re.compile(r"^dropped_step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def tmp_dir_name(step: int) -> str:
    return f"tmp_step_{step}"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def read_manifest(step_dir: Path) -> dict | None:
    """The step's manifest, or None when it is missing, unreadable or not shaped like one (a
    damaged step is skipped like a missing one, never a crash in whoever reads it)."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if _manifest_shaped(manifest) else None


def _manifest_shaped(manifest) -> bool:
    def sizes(value) -> bool:
        return isinstance(value, dict) and all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items())

    def strings(value) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())

    return (isinstance(manifest, dict) and sizes(manifest.get("files", {}))
            and strings(manifest.get("checksums", {})) and isinstance(manifest.get("metrics", {}), dict)
            and isinstance(manifest.get("tensors", {}), dict)
            and type(manifest.get("step", 0)) is int)


def verify_step_dir(step_dir: Path, checksums: bool = False, readers: int = 4) -> Verdict:
    """A step is intact when its manifest parses and every listed file has its recorded size
    (and, with `checksums`, its recorded checksum: that reads every byte, in parallel)."""
    from rlscale.ckpt.tensorfile import file_checksum

    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return Verdict(False, f"{step_dir} is not a directory")
    manifest = read_manifest(step_dir)
    if manifest is None:
        return Verdict(False, f"{MANIFEST} is missing, unreadable or not a manifest")
    files = manifest.get("files", {})
    for rel, size in files.items():
        path = step_dir / rel
        if not path.is_file():
            return Verdict(False, f"{rel} is missing")
        actual = path.stat().st_size
        if actual != size:
            return Verdict(False, f"{rel} has {actual} bytes, manifest says {size}")
    total = sum(files.values())
    if not checksums:
        return Verdict(True, f"intact: {len(files)} files, {total / 1e9:.3f} GB (sizes checked)")
    recorded = manifest.get("checksums", {})
    unrecorded = sorted(set(files) - set(recorded))
    if unrecorded:
        return Verdict(False, f"{unrecorded[0]} has no checksum in the manifest")
    ordered = sorted(files, key=lambda rel: -files[rel])
    with ThreadPoolExecutor(max(1, readers)) as pool:
        actual = dict(zip(ordered, pool.map(lambda rel: file_checksum(str(step_dir / rel)), ordered)))
    for rel in ordered:
        if actual[rel] != recorded[rel]:
            return Verdict(False, f"{rel}: checksum {actual[rel]} does not match the manifest's {recorded[rel]}")
    return Verdict(True, f"intact: {len(files)} files, {total / 1e9:.3f} GB, checksums match")


def set_stripe(directory: Path, count: int | None, size: str | None) -> bool:
    """Give `directory` a Lustre stripe layout, inherited by the files created in it.

    With `checkpointing.lustre_stripe_count` (and optionally `lustre_stripe_size`, e.g. "4M") set
    and the `lfs` tool on PATH, runs `lfs setstripe -c COUNT [-S SIZE] DIR` on each tmp step dir
    before any file is written: ranks and writers then spread their files over COUNT storage
    targets (-1 = all). Without `lfs`, or when the directory is not on Lustre, it warns and saves
    with the default layout. Returns whether the layout was set.
    """
    if count is None and size is None:
        return False
    lfs = shutil.which("lfs")
    if lfs is None:
        warnings.warn("checkpointing.lustre_stripe_*: no `lfs` tool on PATH; default layout used", stacklevel=2)
        return False
    cmd = [lfs, "setstripe"] + (["-c", str(count)] if count is not None else []) + (["-S", size] if size else [])
    done = subprocess.run(cmd + [str(directory)], capture_output=True, text=True)
    if done.returncode != 0:
        warnings.warn(f"lfs setstripe on {directory} failed: {done.stderr.strip()[:200]}", stacklevel=2)
        return False
    return True


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every committed step dir, oldest first (not yet verified)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def stale_tmp_dirs(root: Path) -> list[Path]:
    """Uncommitted saves (tmp_step_N) and steps whose deletion a crash interrupted (dropped_step_N)."""
    if not root.is_dir():
        return []
    return [child for child in root.iterdir()
            if (_TMP_RE.match(child.name) or _DROPPED_RE.match(child.name)) and child.is_dir()]


def remove_step_dir(step_dir: Path) -> None:
    """Delete a committed step so that a crash midway never leaves a half-deleted step_N/: rename
    it aside to dropped_step_N/ (atomic, made durable by the parent's fsync), then delete that."""
    from rlscale.ckpt.faults import maybe_fault

    step_dir = Path(step_dir)
    aside = step_dir.with_name("dropped_" + step_dir.name)
    shutil.rmtree(aside, ignore_errors=True)  # an earlier deletion of the same step a crash cut short
    try:
        step_dir.rename(aside)
    except FileNotFoundError:  # already gone (removed by hand meanwhile): nothing to do
        return
    fsync_path(step_dir.parent)
    maybe_fault("retention.renamed_aside")
    shutil.rmtree(aside, ignore_errors=True)


def latest_intact(root: Path) -> Path | None:
    """The newest committed step that verifies; a damaged newer one is skipped, not trusted."""
    return newest_intact(root)[0]


def newest_intact(root: Path, checksums: bool = False) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest committed step that verifies (None if none does), and the (name, why) of each
    damaged newer step skipped on the way."""
    skipped = []
    for _step, path in reversed(committed_steps(root)):
        verdict = verify_step_dir(path, checksums=checksums)
        if verdict.ok:
            return path, skipped
        skipped.append((path.name, verdict.reason))
    return None, skipped
