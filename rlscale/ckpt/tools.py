"""What `rlscale ckpt list / verify / export` do, as plain functions."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlscale.ckpt import layout
from rlscale.errors import UserError


def list_steps(root: Path) -> list[dict]:
    """Every step directory under `root`, oldest first: committed ones with their size check,
    tmp ones (a save in progress, or one a crash left behind) marked as not trusted."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"checkpoint directory {str(root)!r} does not exist")
    rows = []
    for step, path in layout.committed_steps(root):
        verdict = layout.verify_step_dir(path)
        manifest = layout.read_manifest(path) or {}
        rows.append({"step": step, "path": str(path), "state": "intact" if verdict.ok else "damaged",
                     "reason": verdict.reason, "bytes": manifest.get("bytes"),
                     "world_size": manifest.get("world_size"), "created_unix": manifest.get("created_unix"),
                     "metrics": manifest.get("metrics", {})})
    for path in layout.stale_tmp_dirs(root):
        rows.append({"step": int(path.name.rsplit("_", 1)[1]), "path": str(path), "state": "uncommitted",
                     "reason": ("being deleted by retention" if path.name.startswith("dropped_") else "being written")
                               + ", or left by a crash (removed at the next start)", "bytes": None,
                     "world_size": None, "created_unix": None, "metrics": {}})
    return sorted(rows, key=lambda row: (row["step"], row["state"] == "uncommitted"))


def export_policy(step_dir: Path, out: Path) -> Path:
    """Copy a verified step's policy/ (a Hugging Face model dir) to `out`, which must be new or empty."""
    step_dir, out = Path(step_dir), Path(out)
    if not step_dir.is_dir():
        raise UserError(f"checkpoint {str(step_dir)!r} is not a directory")
    verdict = layout.verify_step_dir(step_dir, checksums=True)
    if not verdict.ok:
        raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {verdict.reason}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export target {str(out)!r} exists and is not an empty directory")
    manifest = layout.read_manifest(step_dir)
    prefix = "policy/"
    policy_files = [rel for rel in manifest["files"] if rel.startswith(prefix)]
    if not any(rel.endswith(".safetensors") for rel in policy_files):
        raise UserError(f"checkpoint {str(step_dir)!r} holds no policy weights")
    # Copied under a temporary name and fsync'd, then moved into place, so a failed export (a full
    # disk) never leaves a model directory that looks whole. A new `out` is staged beside it and
    # renamed; an existing empty one (the current directory, a mount point, a symlink to a
    # directory) is staged inside it, and its files are moved up with config.json last: without
    # config.json nothing loads it as a model.
    existing = out.is_dir()
    out = out.resolve() if existing else out
    staging = (out / ".rlscale-export-tmp") if existing else out.parent / f".{out.name}.export-tmp-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
        dtype = _model_dtype(step_dir / prefix / "config.json")
        for rel in policy_files:
            target = staging / rel[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (rel.endswith(".safetensors") and _write_in_dtype(step_dir / rel, target, dtype)):
                shutil.copyfile(step_dir / rel, target)
            with open(target, "rb+") as handle:
                os.fsync(handle.fileno())
        if not existing:
            os.replace(staging, out)
        else:
            for entry in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):
                os.replace(entry, out / entry.name)
            staging.rmdir()
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"export to {str(out)!r} failed: {exc.strerror or exc}") from None
    return out



def _model_dtype(config_json: Path):
    """The dtype the model computes in, as its config.json says (None when it says nothing)."""
    import torch

    try:
        config = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def _write_in_dtype(source: Path, target: Path, dtype) -> bool:
    """Write a weight file with its floating tensors in `dtype` (fp32 master weights are exported
    in the model's bf16), one file at a time; False when nothing needs a cast (copy it as is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dtype is None:
        return False
    with safe_open(str(source), "pt") as handle:
        names, metadata = list(handle.keys()), handle.metadata()
        tensors = {n: handle.get_tensor(n) for n in names}
    recast = {n: t.to(dtype) for n, t in tensors.items() if t.is_floating_point() and t.dtype != dtype}
    if not recast:
        return False
    save_file({**tensors, **recast}, str(target), metadata=metadata)
    return True
