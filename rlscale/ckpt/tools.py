"""What `rlscale ckpt list / verify / export` do, as plain functions.

Export of a step whose policy/ is a Hugging Face model dir (an unsharded save) copies it, casting
the weights to the model's dtype one file at a time. A sharded save's policy/ holds each rank's
rows (rlscale/ckpt/ranges.py): its export assembles one whole tensor at a time from its byte
ranges (checksums checked), casts it, and streams it into Hugging Face safetensors shards of at
most EXPORT_SHARD_BYTES, so no more than one tensor of the model is ever in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlscale.ckpt import layout
from rlscale.ckpt.lora_export import trains_lora, write_lora_export
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
                     # sharded: each rank's rows (policy/ is no HF dir: export it); whole: tensors by name
                     "layout": "sharded" if "tensors" in manifest else "whole",
                     "metrics": manifest.get("metrics", {})})
    for path in layout.stale_tmp_dirs(root):
        rows.append({"step": int(path.name.rsplit("_", 1)[1]), "path": str(path), "state": "uncommitted",
                     "reason": ("being deleted by retention" if path.name.startswith("dropped_") else "being written")
                               + ", or left by a crash (removed at the next start)", "bytes": None,
                     "world_size": None, "created_unix": None, "layout": None, "metrics": {}})
    return sorted(rows, key=lambda row: (row["step"], row["state"] == "uncommitted"))


def export_policy(step_dir: Path, out: Path, adapter: bool = False) -> Path:
    """A verified step's policy as a Hugging Face model dir in `out`, which must be new or empty:
    policy/ copied (an unsharded save), or its weights assembled from the ranks' rows (sharded).
    A LoRA step: the merged model, or with `adapter` PEFT's adapter directory (ckpt/lora_export.py)."""
    step_dir, out = Path(step_dir), Path(out)
    if not step_dir.is_dir():
        raise UserError(f"checkpoint {str(step_dir)!r} is not a directory")
    verdict = layout.verify_step_dir(step_dir, checksums=True)
    if not verdict.ok:
        raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {verdict.reason}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"export target {str(out)!r} exists and is not an empty directory")
    lora = trains_lora(step_dir)
    if adapter and not lora:
        raise UserError(f"checkpoint {str(step_dir)!r} holds no LoRA adapters (its run trained the whole "
                        "model): leave out --adapter")
    manifest = layout.read_manifest(step_dir)
    prefix = "policy/"
    policy_files = [rel for rel in manifest["files"] if rel.startswith(prefix)]
    if not any(rel.endswith(".safetensors") for rel in policy_files):
        raise UserError(f"checkpoint {str(step_dir)!r} holds no policy weights")
    weights = None
    if "tensors" in manifest:  # the sharded layout: weights are assembled, the rest copied
        weights = {name: entry for name, entry in manifest["tensors"].items()
                   if entry["ranges"] and entry["ranges"][0]["file"].startswith(prefix)}
        policy_files = [rel for rel in policy_files if not rel.endswith(".safetensors")]
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
        if lora:  # the adapters, in either layout, merged into the base (or PEFT's directory)
            write_lora_export(step_dir, staging, adapter)
            policy_files = []
        else:
            dtype = _model_dtype(step_dir / prefix / "config.json")
            if weights is not None:
                _write_hf_shards(step_dir, weights, staging, dtype)
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
    except UserError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except ValueError as exc:  # a range whose checksum does not match
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"checkpoint {str(step_dir)!r} is damaged: {exc}") from None
    return out



EXPORT_SHARD_BYTES = 5 << 30  # as transformers' save_pretrained (max_shard_size="5GB")


def loadable_policy_dir(step_dir: Path, scratch: Path) -> Path:
    """A directory `from_pretrained` loads the step's policy from: its policy/ (today's layout, a
    one-worker save), or, for a sharded step (policy/ holds the ranks' rows) or a LoRA step (the
    adapters alone), an export into `scratch` (a new or empty directory the caller removes)."""
    step_dir = Path(step_dir)
    if "tensors" not in layout.read_manifest(step_dir) and not trains_lora(step_dir):
        return step_dir / "policy"
    return export_policy(step_dir, scratch)


def _write_hf_shards(step_dir: Path, weights: dict[str, dict], out: Path, dtype) -> None:
    """Hugging Face safetensors shards (+ the index when there are several) of a sharded save's
    weights, each floating tensor in `dtype`, written one tensor at a time and fsynced."""
    import torch

    from rlscale.ckpt import ranges, tensorfile
    from rlscale.ckpt.reader import read_whole

    def exported(entry):
        saved = tensorfile.CODE_DTYPES[entry["dtype"]]
        return dtype if dtype is not None and saved.is_floating_point and saved != dtype else saved

    specs = [(name, exported(entry), tuple(entry["shape"])) for name, entry in weights.items()]
    groups, size = [[]], 0
    for spec in specs:
        nbytes = spec[1].itemsize * ranges.rows_of(spec[2]) * _row_numel(spec[2])
        if groups[-1] and size + nbytes > EXPORT_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for file_name, group in zip(names, groups):
        plan = tensorfile.plan_file(group, {"format": "pt"})
        with open(out / file_name, "wb") as handle:
            handle.write(plan.header)
            for slot in plan.slots:  # one whole tensor in memory at a time
                saved = read_whole(weights[slot.name], step_dir)
                handle.write(memoryview(tensorfile.as_bytes(saved.to(slot.dtype)).numpy()))
                weight_map[slot.name] = file_name
                del saved
            handle.flush()
            os.fsync(handle.fileno())
        total += plan.size - len(plan.header)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _row_numel(shape) -> int:
    count = 1
    for dim in shape[1:]:
        count *= dim
    return count


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
