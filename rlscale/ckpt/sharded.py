"""FSDP2-sharded (DTensor) tensors in checkpoints: files always hold whole tensors, by name.

Saving gathers each sharded tensor (every rank, in the same order: it is a collective) and only
the rank that writes that name keeps the whole tensor. Loading reads whole tensors and keeps this
rank's slice. So any number of workers, sharded or not, loads any checkpoint, and `policy/`
stays a plain Hugging Face model directory.
"""

from __future__ import annotations

import torch


def is_sharded(tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def local_view(tensor):
    """A DTensor on a mesh of one rank (FSDP2 at one worker) as its local tensor, which is the
    whole tensor: saved and loaded in place like an unsharded one, without a gathered copy."""
    if is_sharded(tensor) and tensor.device_mesh.size() == 1:
        return tensor.to_local()
    return tensor


def storage_key(tensor: torch.Tensor) -> tuple:
    """What tied tensors share: their (local) memory."""
    local = tensor.to_local() if is_sharded(tensor) else tensor
    return (local.device, local.data_ptr())


def whole(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole tensor where this rank keeps it (a sharded one is gathered either way)."""
    if is_sharded(tensor):
        full = tensor.full_tensor()
        return full if keep else None
    return tensor if keep else None


def local_part(like, full: torch.Tensor) -> torch.Tensor:
    """The slice of a whole tensor that this rank holds of `like` (a DTensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def assign(target, full: torch.Tensor) -> None:
    """Copy a whole tensor into `target`, or into this rank's slice of it when it is sharded."""
    if is_sharded(target):
        target.to_local().copy_(local_part(target, full))
    else:
        target.detach().copy_(full)


def shard_like(param, full: torch.Tensor):
    """A DTensor laid out like `param` holding this rank's slice of `full` (optimizer state)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_part(param, full).clone(), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())
