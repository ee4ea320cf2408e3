"""LoRA adapters on a frozen Hugging Face model: PEFT's LoRA layers injected in place
(`peft.inject_adapter_in_model`; the model stays the transformers model it was), so the base
weights keep their names under `.base_layer.` and their dtype, and the adapters train in fp32.

Three views of one model:
- the trained model: base + adapters (what the update's forward runs);
- the reference: the same model with the adapters switched off (`adapters_disabled`), which is
  exactly the base, so the KL penalty needs no second copy;
- the merged model, by the base's own Hugging Face names (`merged_parameters`): each adapted
  weight is base + (alpha / r) B A, computed anew from the untouched base at every call (never
  merged into the base in place, which would drift in bf16). The rollout engine copies these,
  each rank merging only its tensor-parallel slice (`MergedWeight`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlscale.config import LORA_LINEAR_MODULES, LoraConfig
from rlscale.errors import UserError

ADAPTER = "default"
BASE = ".base_layer."


def add_adapters(model, lora: LoraConfig) -> None:
    """Inject LoRA adapters into `model` in place; only they require gradients, in fp32."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    targets = list(lora.target_modules or LORA_LINEAR_MODULES)
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [t for t in targets if t not in present]
    if missing:
        raise UserError(f"policy.lora.target_modules: {', '.join(map(repr, missing))} match no linear layer of "
                        f"{type(model).__name__} (it has {', '.join(sorted(present))})")
    model.requires_grad_(False)
    inject_adapter_in_model(PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                           target_modules=targets, bias="none"), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        if is_adapter(name):
            param.data = param.data.float()
            param.requires_grad_(True)


def initial_adapters(model, seed: int) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(adapter parameter, its whole initial value): PEFT's default initialisation drawn anew, the
    same at every worker count. Each A is kaiming-uniform as nn.Linear's (bound 1 / sqrt(fan_in)),
    drawn whole from one generator keyed by `seed` in the model's order; each B is zeros. The
    caller copies them in (an FSDP2-sharded parameter its rows): a meta-device load leaves the
    adapters unset, and PEFT's own draws depend on each rank's RNG."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(param.shape)
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            full.uniform_(-bound, bound, generator=generator)
        yield param, full.to(param.dtype)


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def adapter_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextmanager
def adapters_disabled(model):
    """The base model alone (the KL reference) for the duration; the adapters are back after,
    trainable again (PEFT's enable_adapters also sets their requires_grad)."""
    layers = adapter_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def base_name(name: str) -> str:
    """A parameter's name in the base model: `x.q_proj.base_layer.weight` -> `x.q_proj.weight`."""
    return name.replace(BASE, ".")


class MergedWeight:
    """An adapted weight W + scaling × B @ A, computed in fp32 only for the slice asked for
    (`narrow`): a tensor-parallel rank of the rollout engine merges its own rows or columns (a
    column-parallel slice takes B's rows, a row-parallel one A's columns), never the whole weight.
    `shape`, `detach` and `narrow` are what the engine's copy (rlscale.rollout.weights) reads."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float):
        self.base, self.lora_a, self.lora_b, self.scaling = base, lora_a, lora_b, scaling
        self.shape = base.shape

    def detach(self) -> MergedWeight:
        return self

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        a, b = self.lora_a.detach().float(), self.lora_b.detach().float()
        if dim == 0:
            b = b.narrow(0, start, length)
        else:
            a = a.narrow(1, start, length)
        return self.base.detach().narrow(dim, start, length).float() + (b @ a) * self.scaling

    def full(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])


def merged_weight(layer, base: torch.Tensor | None = None) -> MergedWeight:
    """A LoRA layer's merged weight; `base`: its base weight as handed over (a gathered FSDP2
    unit's), by default the layer's own."""
    base = layer.get_base_layer().weight if base is None else base
    return MergedWeight(base, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER])


def merged_pairs(model, pairs) -> Iterator[tuple[str, torch.Tensor | MergedWeight]]:
    """The base parameters among `pairs` (model-level name, tensor) under their base names, each
    adapted weight as a MergedWeight over the model's current adapters (so under FSDP2 the unit
    holding them must be gathered), the rest as they are; the adapters themselves are left out."""
    modules = dict(model.named_modules())
    for name, tensor in pairs:
        if is_adapter(name):
            continue
        owner, sep, leaf = name.partition(BASE)
        if sep and leaf == "weight":
            yield base_name(name), merged_weight(modules[owner], tensor)
        else:
            yield base_name(name), tensor


def merged_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, merged weight) for every base parameter, in the model's order: an adapted
    weight is base + delta in fp32, the rest as they are. One tensor is made at a time; consume
    it before the next."""
    for name, value in merged_pairs(model, model.named_parameters()):
        yield name, value.full() if isinstance(value, MergedWeight) else value.detach()


def merged_by_layer(model) -> Iterator[list[tuple[str, torch.Tensor | MergedWeight]]]:
    """merged_pairs of the whole model in groups of one decoder layer (and one group for each
    parameter outside the layers), for the rollout engine's copy, which makes each merged slice
    as it copies it: the transient memory is one layer's merged slices in fp32."""
    def layer_of(pair):
        parts = pair[0].split(".")
        return ".".join(parts[:3]) if "layers" in parts[:3] else pair[0]

    for _, group in itertools.groupby(merged_pairs(model, model.named_parameters()), key=layer_of):
        yield list(group)


class BaseNamesView:
    """The model as the rollout engine reads it when it is built: its config, its rotary module
    and its parameters under the base's names (unmerged: the engine is built empty and filled by
    a sync of `merged_by_layer`)."""

    def __init__(self, model):
        self.config, self.model = model.config, model.model
        self._source = model

    def named_parameters(self):
        return ((base_name(name), p) for name, p in self._source.named_parameters() if not is_adapter(name))


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name (what a LoRA checkpoint holds of the model)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_adapter(name)}
