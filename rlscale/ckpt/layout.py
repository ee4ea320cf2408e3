"""On-disk layout of checkpoints, and the rules for trusting one.

<checkpoint_dir>/
  tmp_step_N/          being written; never trusted, removed at start
  step_N/              committed: renamed from tmp_step_N/ after its manifest was fsynced
    manifest.json      written last: step, file sizes, metrics, config digest
    trainer_state.json controller state: step, loader position, RNG, eval history
    config.yaml        the run's resolved config
    policy/            Hugging Face model directory (safetensors, config, tokenizer)
    optimizer_rank{r}.safetensors / .json, rng_rank{r}.safetensors / .json
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^tmp_step_(\d+)$")


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
    try:
        return json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify_step_dir(step_dir: Path) -> Verdict:
    """A step is intact when its manifest parses and every listed file has its recorded size."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return Verdict(False, f"{step_dir} is not a directory")
    manifest = read_manifest(step_dir)
    if manifest is None:
        return Verdict(False, f"{MANIFEST} is missing or unreadable")
    for rel, size in manifest.get("files", {}).items():
        path = step_dir / rel
        if not path.is_file():
            return Verdict(False, f"{rel} is missing")
        actual = path.stat().st_size
        if actual != size:
            return Verdict(False, f"{rel} has {actual} bytes, manifest says {size}")
    return Verdict(True, f"intact: {len(manifest.get('files', {}))} files")


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
    if not root.is_dir():
        return []
    return [child for child in root.iterdir() if _TMP_RE.match(child.name) and child.is_dir()]


def latest_intact(root: Path) -> Path | None:
    """The newest committed step that verifies; a damaged newer one is skipped, not trusted."""
    for _step, path in reversed(committed_steps(root)):
        if verify_step_dir(path).ok:
            return path
    return None
