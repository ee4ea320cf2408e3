"""`rlscale ckpt export` of a LoRA step (policy.lora.enabled): the step holds the adapters alone
(policy/*.safetensors by the trained model's parameter names) and names its base in config.yaml.

- merged (the default): base + (alpha / rank) B A, written as a plain Hugging Face model
  directory in the base's dtype; `from_pretrained` loads it, no PEFT needed;
- adapter: PEFT's adapter directory (adapter_config.json, adapter_model.safetensors), which
  `PeftModel.from_pretrained(base, dir)` loads.
The base is loaded from its own files (policy.model_name), once: the merge folds each adapter
into its base layer in place (one merged weight in fp32 beside it at a time).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlscale.errors import UserError


def saved_config(step_dir: Path):
    """The Config the step's run trained with (its config.yaml)."""
    from rlscale.config_loading import load_config

    return load_config(step_dir / "config.yaml", [])


def trains_lora(step_dir: Path) -> bool:
    """Whether the run that saved this step trained LoRA adapters (its config.yaml says)."""
    import yaml

    config = step_dir / "config.yaml"
    saved = yaml.safe_load(config.read_text()) if config.is_file() else None
    return bool((((saved or {}).get("policy") or {}).get("lora") or {}).get("enabled"))


def saved_adapters(step_dir: Path) -> dict[str, torch.Tensor]:
    """The step's adapters by name, whole: from policy/'s files (one worker's save), or assembled
    from every rank's rows (the sharded layout, rlscale/ckpt/ranges.py; checksums checked)."""
    from rlscale.ckpt import layout
    from rlscale.ckpt.reader import read_whole

    manifest = layout.read_manifest(step_dir)
    if "tensors" in manifest:
        return {name: read_whole(entry, step_dir) for name, entry in manifest["tensors"].items()
                if entry["ranges"] and entry["ranges"][0]["file"].startswith("policy/")}
    saved: dict[str, torch.Tensor] = {}
    for path in sorted((step_dir / "policy").glob("*.safetensors")):
        saved.update(load_file(path))
    return saved


def adapted_model(step_dir: Path, cfg):
    """The base with the step's adapters loaded into it (CPU, the base's own dtype)."""
    from rlscale.models import load_model
    from rlscale.models.lora import add_adapters, is_adapter

    policy = cfg.policy
    model = load_model(policy.model_name, "auto", torch.device("cpu"), policy.trust_remote_code)
    add_adapters(model, policy.lora)
    saved = saved_adapters(step_dir)
    params = {name: p for name, p in model.named_parameters() if is_adapter(name)}
    missing, unknown = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unknown:
        raise UserError(f"checkpoint {str(step_dir)!r} does not match its base {policy.model_name!r} with "
                        f"policy.lora's settings (missing {missing[:2]}, unknown {unknown[:2]})")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name])
    return model


def write_lora_export(step_dir: Path, staging: Path, adapter: bool) -> None:
    """The step's export into `staging` (an empty directory the caller moves into place)."""
    from rlscale.models import load_tokenizer

    cfg = saved_config(step_dir)
    policy = cfg.policy
    model = adapted_model(step_dir, cfg)
    if adapter:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model_state_dict

        from rlscale.config import LORA_LINEAR_MODULES

        lora = policy.lora
        PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                       target_modules=list(lora.target_modules or LORA_LINEAR_MODULES), task_type="CAUSAL_LM",
                       base_model_name_or_path=policy.model_name).save_pretrained(staging)
        state = get_peft_model_state_dict(model, adapter_name="default")
        save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
                  staging / "adapter_model.safetensors", metadata={"format": "pt"})
        return
    merge_in_place(model)
    model.save_pretrained(staging)
    load_tokenizer(policy.tokenizer_name or policy.model_name, policy.trust_remote_code).save_pretrained(staging)


@torch.no_grad()
def merge_in_place(model) -> None:
    """Fold each LoRA layer into its base layer (base + delta, computed in fp32, stored in the
    base's dtype) and put the base layer back in its place: the plain Hugging Face model, with
    no second copy of the base (one merged weight in fp32 at a time)."""
    from rlscale.models.lora import adapter_layers, merged_weight

    layers = adapter_layers(model)
    for layer in layers:
        weight = layer.get_base_layer().weight
        weight.copy_(merged_weight(layer).full().to(weight.dtype))
    adapted = {id(layer) for layer in layers}
    for name, module in list(model.named_modules()):
        if id(module) in adapted:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
