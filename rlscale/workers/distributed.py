"""torch.distributed set-up for a policy worker: the process group and FSDP2 sharding.

Imports no Ray: in a Ray actor, the GPU Ray assigned comes from rlscale/ray_runtime.py."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from datetime import timedelta

import torch


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it, so concurrent runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def init_process_group(rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """Join the group at MASTER_ADDR:MASTER_PORT (set by the worker group): NCCL on GPU, gloo on CPU.
    A group of one (FSDP2 at one worker, see rlscale.workers.precision) needs no address: its
    store is in-process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if world_size == 1 and "MASTER_PORT" not in os.environ:
        # an in-process store: no port to take (a port picked free and released can be taken by
        # another process before the group binds it)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size, timeout=timeout)


def shard_model(model, layers_per_unit: int = 1, mp_policy=None) -> None:
    """FSDP2: shard the transformer blocks in units of `layers_per_unit` consecutive blocks (one
    all-gather and one reduce-scatter per unit), then the root (embeddings, norm, head).

    Blocks are found by the model's own `_no_split_modules` class names, so any Hugging Face
    decoder (Qwen2/3, Llama, ...) is sharded block by block. A GRPO step keeps the whole model
    gathered from generation to the last backward, so units of one block buy no memory, only
    more (and smaller) collectives, each with its own host-side cost.
    mp_policy: FSDP2's MixedPrecisionPolicy (fp32 master weights, rlscale.workers.precision).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    for start in range(0, len(blocks), layers_per_unit):
        unit = blocks[start:start + layers_per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], **kwargs)
    fully_shard(model, **kwargs)


def tensor_parallel_groups(size: int):
    """This rank's tensor-parallel group: `size` consecutive ranks (the worker groups number ranks
    by node, rlscale.workers.ray_group.ranks_by_node, so a group is on one node), and this rank's
    rank within it. Every rank calls torch.distributed.new_group for every group, in the same
    order (new_group is collective over the whole world). Returns (group, rank in group); a size
    of 1 needs no group: (None, 0)."""
    import torch.distributed as dist

    if size == 1:
        return None, 0
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the {world} workers")
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine, rank % size


def max_over_workers(value: int, device: torch.device) -> int:
    """The largest `value` any worker of the process group holds."""
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def clip_grad_norm(parameters, max_norm: float, sharded: bool) -> torch.Tensor:
    """torch's clip_grad_norm_ (total 2-norm, scale by max_norm / norm when above), returning the
    norm before clipping. Sharded: the norm is taken over the local shards of the FSDP2 gradients
    with one all-reduce of the squared sum, and the shards are scaled in place; torch's version
    dispatches every per-parameter op through DTensor, several milliseconds of host time a step."""
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    import torch.distributed as dist

    grads = [p.grad.to_local() for p in parameters if p.grad is not None]
    if not grads:  # as torch: nothing to clip, norm 0 (every rank holds shards of the same parameters)
        return torch.zeros(())
    squares = torch.stack([norm.float() for norm in torch._foreach_norm(grads)]).square().sum()
    dist.all_reduce(squares)
    total = squares.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch: a no-op multiply when below
    torch._foreach_mul_(grads, scale)
    return total


def as_float(value) -> float:
    """A scalar that may be a DTensor (e.g. the grad norm of sharded parameters)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def local_gpu_index() -> int:
    """The GPU this worker owns.

    Ray worker groups leave CUDA_VISIBLE_DEVICES unmasked (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES):
    with one GPU visible per process, NCCL loses its peer-to-peer paths and falls back to slow
    transports. Each worker then selects Ray's assignment itself, as torchrun's LOCAL_RANK does.
    """
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        from rlscale.ray_runtime import assigned_gpu_ids  # only set inside a Ray worker actor

        gpu_ids = assigned_gpu_ids()
        if gpu_ids:
            return int(gpu_ids[0])
    return int(os.environ.get("LOCAL_RANK", 0))


@contextmanager
def gathered(model, enabled: bool = True, keep: bool = False):
    """Hold the full parameters of an FSDP2 model for a while (generation, logprob passes).

    Sharded, every forward all-gathers every block: per token when decoding, with all ranks
    in lockstep. Gathered once, each rank runs forwards on its own, as many as it needs.
    keep: leave them gathered afterwards, for an update that follows with the same weights (its
    first forward then all-gathers nothing; its last backward reshards); `reshard` ends it early.
    """
    if not enabled:
        yield
        return
    modules = fsdp_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            if not keep:
                module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


def fsdp_units(model) -> list[tuple[torch.nn.Module, list[str]]]:
    """The FSDP2 units of a model `shard_model` sharded, in its order (the blocks' units, then the
    root): one module of each unit (a unit of several blocks shares one state: unsharding one
    unshards all) and the model-level names of the parameters the unit shards (each parameter
    belongs to its nearest sharded ancestor; a tied parameter counts once, under its first name)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = {name: module for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    if "" not in sharded:
        raise ValueError("the model is not FSDP2-sharded at its root")
    units: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for name, module in sharded.items():
        units.setdefault(id(module._get_fsdp_state()), (module, []))
    for name, _ in model.named_parameters():
        parts = name.split(".")[:-1]
        owner = next(".".join(parts[:n]) for n in range(len(parts), -1, -1) if ".".join(parts[:n]) in sharded)
        units[id(sharded[owner]._get_fsdp_state())][1].append(name)
    root = units.pop(id(model._get_fsdp_state()))
    return [unit for unit in units.values() if unit[1]] + [root]


@torch.no_grad()
def streamed_sync(model, copy_named) -> list:
    """Hand an FSDP2 model's full parameters to `copy_named` one unit at a time: unshard a unit,
    `copy_named([(model-level name, full tensor), ...])` for its parameters, reshard it. The
    transient memory is one unit's gathered parameters (in FSDP2's all-gather dtype), not the
    whole model's: for a rollout engine that cannot hold the gathered model besides its own copy
    (policy.keep_gathered=false). Every rank of the group calls it (each unshard is collective).
    Returns what the calls returned, concatenated (the rollout engine's: the names it filled)."""
    returned: list = []
    for module, names in fsdp_units(model):
        module.unshard()
        try:
            returned += copy_named([(name, model.get_parameter(name)) for name in names]) or []
        finally:
            module.reshard()
    return returned


def reshard(model, enabled: bool = True) -> None:
    """Free gathered FSDP2 parameters (a no-op for modules already sharded)."""
    if enabled:
        for module in fsdp_modules(model):
            module.reshard()


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_reference(setting: bool | None, model, device: torch.device) -> bool:
    """Whether to FSDP2-shard the frozen reference model (policy.shard_reference). A whole copy
    per GPU costs its weights in memory but no all-gather per step; below 10% of the GPU's
    memory (a 0.5B–1.5B model on any current GPU) the copy is the better trade."""
    if setting is not None:
        return setting
    if device.type != "cuda":
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights > 0.1 * torch.cuda.get_device_properties(device).total_memory


@contextmanager
def accumulating(model, enabled: bool = True):
    """One optimizer step's micro-batches under FSDP2: parameters stay gathered from the first
    forward to the last backward and gradients are reduce-scattered once, at the last micro-batch
    (see `last_micro_batch`), instead of one all-gather and one reduce-scatter per micro-batch.
    Costs the unsharded parameters and gradients in memory for the step's duration."""
    if not enabled:
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def last_micro_batch(model, is_last: bool, enabled: bool = True) -> None:
    if enabled:
        model.set_requires_gradient_sync(is_last)
        model.set_reshard_after_backward(is_last)
