"""FSDP2-sharded (DTensor) tensors in checkpoints: the rows a rank holds, never a gathered copy.

A DTensor on a mesh of several ranks is saved as this rank's rows with their place in the whole
tensor (held_rows; the layout is rlscale/ckpt/ranges.py), so a save runs no collective. A DTensor
on a mesh of one rank is its whole local tensor (local_view), saved and loaded like an unsharded
one in the layout where files hold whole tensors by name (policy/ a Hugging Face model dir).
Loading that layout into sharded workers reads whole tensors and keeps this rank's slice
(assign, shard_like).
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


def held_rows(tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of a DTensor sharded on dim 0 over a 1-D mesh (FSDP2), and the index of
    the first one in the whole tensor. Other placements (tensor parallel, HSDP) are refused."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise NotImplementedError(f"checkpoints of DTensors placed {tensor.placements} on a "
                                  f"{tensor.device_mesh.ndim}-D mesh (only FSDP2's Shard(0))")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the {tuple(shape)} its placement gives")
    return local, (offset[0] if shape[0] else 0)


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


def shard_from_local(param, local: torch.Tensor):
    """A DTensor laid out like `param` whose local rows are `local` (an optimizer moment read in
    place, rows and all, by the sharded layout's ranged load)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
