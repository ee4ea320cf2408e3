"""A policy worker's training state on disk, without pickle.

Weights go to `policy/` in the Hugging Face layout (safetensors + config + tokenizer), so a
checkpoint's policy loads with `AutoModelForCausalLM.from_pretrained`. Optimizer moments and RNG
states are tensors in safetensors files keyed by parameter name; the rest is JSON.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlscale.errors import UserError

POLICY_DIR = "policy"


def _param_names(worker) -> list[str]:
    return [name for name, _ in worker.model.named_parameters()]


def optimizer_to_flat(worker) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state keyed by parameter name (not position), so it survives re-sharding."""
    names = _param_names(worker)
    state = worker.optimizer.state_dict()
    tensors = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            tensors[f"{names[index]}::{key}"] = value.detach().to("cpu").contiguous()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
              for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scheduler": worker.scheduler.state_dict()}


def optimizer_from_flat(worker, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    names = _param_names(worker)
    index_of = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for flat_key, value in tensors.items():
        name, key = flat_key.split("::")
        state.setdefault(index_of[name], {})[key] = value
    groups = [{**g, "params": [index_of[n] for n in g["params"]]} for g in meta["param_groups"]]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    worker.optimizer.load_state_dict({"state": state, "param_groups": groups})
    worker.scheduler.load_state_dict(meta["scheduler"])


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def save_worker_state(worker, directory: str | Path) -> list[str]:
    """Write this rank's files into `directory`; returns the relative paths written."""
    directory = Path(directory)
    written = []
    if worker.rank == 0:
        policy_dir = directory / POLICY_DIR
        worker.model.save_pretrained(policy_dir, safe_serialization=True)
        worker.tokenizer.save_pretrained(policy_dir)
        written += [str(p.relative_to(directory)) for p in sorted(policy_dir.rglob("*")) if p.is_file()]
    tensors, meta = optimizer_to_flat(worker)
    save_file(tensors, directory / f"optimizer_rank{worker.rank}.safetensors")
    (directory / f"optimizer_rank{worker.rank}.json").write_text(json.dumps(meta))
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, directory / f"rng_rank{worker.rank}.safetensors")
    (directory / f"rng_rank{worker.rank}.json").write_text(json.dumps(rng_meta))
    written += [f"optimizer_rank{worker.rank}.safetensors", f"optimizer_rank{worker.rank}.json",
                f"rng_rank{worker.rank}.safetensors", f"rng_rank{worker.rank}.json"]
    return written


def load_policy_weights(model, policy_dir: Path) -> None:
    files = sorted(policy_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"checkpoint {str(policy_dir)!r} holds no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # strict=False still raises on shape mismatches: another model's checkpoint
        lines = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line] or [str(exc)]
        raise UserError(f"checkpoint {str(policy_dir)!r} does not match the model ({lines[0][:300]}); "
                        "resume it with its own policy.model_name, or use a new logger.log_dir") from None
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"checkpoint {str(policy_dir)!r} does not match the model "
                        f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")


def load_worker_state(worker, directory: str | Path) -> None:
    directory = Path(directory)
    load_policy_weights(worker.model, directory / POLICY_DIR)
    rank_file = directory / f"optimizer_rank{worker.rank}.safetensors"
    meta = json.loads((directory / f"optimizer_rank{worker.rank}.json").read_text())
    optimizer_from_flat(worker, load_file(rank_file, device=str(worker.device)), meta)
    rng_tensors = load_file(directory / f"rng_rank{worker.rank}.safetensors")
    set_rng_state(rng_tensors, json.loads((directory / f"rng_rank{worker.rank}.json").read_text()))
