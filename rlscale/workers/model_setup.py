"""The models a policy worker holds: the trained policy and the frozen reference, each loaded,
prepared for packed micro-batches (rlscale.models.packed_attention), optionally checkpointed and
compiled per layer, and FSDP2-sharded over the workers (rlscale.workers.distributed)."""

from __future__ import annotations

import torch

from rlscale.ckpt.sharded import assign
from rlscale.config import PolicyConfig
from rlscale.models import load_model
from rlscale.models.loading import local_weights_dir
from rlscale.models.lora import add_adapters, initial_adapters
from rlscale.models.packed_attention import use_packed_attention
from rlscale.models.sharded_load import load_sharded
from rlscale.workers import distributed
from rlscale.workers.precision import Precision


def build_policy(policy: PolicyConfig, precision: Precision, device: torch.device, sharded: bool,
                 world_size: int, compiled: bool, seed: int):
    """The trained model, in precision.weights. Sharded with the weights on local disk, it is
    built on the meta device, each rank reading only the shards it keeps (no whole copy).
    LoRA adapters start from `seed` (the same at every rank and worker count)."""

    def prepare(model) -> None:
        """Activation checkpointing, then compile, then FSDP2, as torchtitan orders them."""
        model.config.use_cache = False
        if policy.lora.enabled:  # frozen base, fp32 adapters (before checkpointing and compile wrap the layers)
            add_adapters(model, policy.lora)
        # by the compute dtype and device: fp32 master weights, or a model still on the meta
        # device, would otherwise take the per-document SDPA loop instead of varlen
        use_packed_attention(model, policy.attention_backend, device, precision.compute)
        if policy.activation_checkpointing:
            enable_activation_checkpointing(model)
        if compiled:
            compile_layers(model)
        if sharded:
            distributed.shard_model(model, policy.fsdp_layers_per_unit, precision.fsdp_policy(world_size))

    weights_dir = local_weights_dir(policy.model_name, policy.trust_remote_code)
    if sharded and weights_dir is not None:
        model = load_sharded(weights_dir, precision.weights, device, prepare, policy.trust_remote_code)
    else:
        model = load_model(policy.model_name, precision.weights, device, policy.trust_remote_code)
        prepare(model)
    if policy.lora.enabled:
        with torch.no_grad():
            for param, value in initial_adapters(model, seed):
                assign(param, value)  # this rank's rows when sharded
    return model


def build_reference(policy: PolicyConfig, dtype: torch.dtype, device: torch.device, world_size: int,
                    compiled: bool) -> tuple[torch.nn.Module, bool]:
    """The frozen reference model in the compute dtype, and whether it is FSDP2-sharded
    (policy.shard_reference; never at one worker)."""
    reference = load_model(policy.model_name, dtype, device, policy.trust_remote_code)
    reference.eval().requires_grad_(False)
    use_packed_attention(reference, policy.attention_backend, device, dtype)
    if compiled:
        compile_layers(reference)
    sharded = world_size > 1 and distributed.shard_reference(policy.shard_reference, reference, device)
    if sharded:
        distributed.shard_model(reference, policy.fsdp_layers_per_unit)
    return reference, sharded


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant checkpoints)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def auto_compile(device: torch.device, precision: Precision, sharded: bool) -> bool:
    """policy.compile=null: compile the layers on CUDA, except under FSDP2's MixedPrecisionPolicy
    (fp32 master weights or stochastic rounding, sharded). There, on an H200 (2026-12-03), 3 steps
    of a Qwen2-0.5B shape did not finish in 130 s where plain bf16 with compiled layers took 55 s;
    on an H100 (2026-12-05) the first step took 256 s, 231 s of it compiling the update; on CPU the
    compiled layers recompiled step after step. One worker's bf16 compute copy (fp32 master
    weights kept gathered) has no FSDP2 hooks: its layers compile as plain bf16's do."""
    return device.type == "cuda" and not (sharded and precision.mixed)


def compile_layers(model) -> None:
    """torch.compile every decoder layer in place (hooks, checkpointing and FSDP2 keep working);
    shapes vary with each packed row, so they are compiled dynamic."""
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True)
