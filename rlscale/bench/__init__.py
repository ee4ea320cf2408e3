"""Benchmarks: measurements run by hand (`rlscale bench ...`), never timed tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(out: dict, json_file: str | Path | None) -> None:
    """Write a benchmark's JSON (benchmarks rewrite it after each part): atomically, so a run cut
    short leaves the last complete version, never half a file."""
    if json_file is None:
        return
    from rlscale.fsutil import write_atomic

    path = Path(json_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=2) + "\n")


def sync(device) -> None:
    """Wait for the device's queued work (timings must not end while kernels still run)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
