"""Small file-system helpers shared by the run directory, the checkpointer and the sinks."""

from __future__ import annotations

import os
from pathlib import Path

from rlscale.errors import UserError


def ensure_writable_dir(path: Path, key: str) -> Path:
    """Create `path` and prove a file can be written there; UserError naming the config key if not."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".rlscale_write_probe"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{key} {str(path)!r} is not writable: {exc.strerror}") from None
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name, then rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
