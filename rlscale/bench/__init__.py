"""Benchmarks: measurements run by hand (`rlscale bench ...`), never timed tests."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

CODE_ENV = "RLSCALE_CODE"  # the commit a copied work tree (no .git, as on a lent GPU machine) was made from


def code_revision() -> str | None:
    """The code a benchmark measured: $RLSCALE_CODE if set, else the checkout's short commit, with
    "-dirty" when tracked files differ from it; None when neither is known."""
    if os.environ.get(CODE_ENV):
        return os.environ[CODE_ENV]
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def write_result(out: dict, json_file: str | Path | None) -> None:
    """Write a benchmark's JSON (benchmarks rewrite it after each part): atomically, so a run cut
    short leaves the last complete version, never half a file. A result without its code gets it
    (`code_revision`), so every JSON in bench/results says what it measured."""
    if json_file is None:
        return
    from rlscale.fsutil import write_atomic

    if out.get("code") is None:
        out["code"] = code_revision()
    path = Path(json_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=2) + "\n")


def sync(device) -> None:
    """Wait for the device's queued work (timings must not end while kernels still run)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
