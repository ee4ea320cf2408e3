"""Start-up without whole copies: a model built on the meta device, sharded, and only then
materialised, each rank reading from the safetensors files just the part of each tensor it keeps.

`load_sharded` builds the Hugging Face model from its config on the meta device (no memory), lets
the caller shard it (FSDP2's `fully_shard`, see rlscale.workers.distributed.shard_model), then
allocates this rank's shards (`to_empty`) and fills them slice by slice. Nothing ever holds a
whole tensor it does not keep, nor a whole file: each tensor's file is opened for that tensor
alone and only this rank's rows are read from the mapping, which is closed before the next one.
Peak host memory is therefore the shard plus this rank's slice of one tensor (the pages of the
mapping the copy has touched; safetensors 0.8 slices are views of the mapping, a version that
returns a copy adds one slice more); on a GPU the peak is the shard plus, when the file's dtype
differs, one slice in the file's dtype.

FSDP2 and uneven dim 0: a DTensor parameter's `_local_tensor` holds this rank's rows only
(`compute_local_shape_and_global_offset` gives their count and first row, torch.chunk's
split: ceil(rows / world) a rank, the last ranks shorter or empty). FSDP2 all-gathers from
`FSDPParam._sharded_param_data`, a padded copy of every rank's rows sized for rank 0; after
`to_empty` it re-pads (`reset_sharded_param`) and points `_local_tensor` into that padded
storage as a narrowed view, so writing into the local tensor writes the memory the all-gather
reads, and the padding rows stay zeros.

Non-persistent buffers (rotary `inv_freq` and `original_inv_freq`) are in no file and `to_empty`
leaves garbage in them: they are recomputed on the device by the model's own `_init_weights`,
as transformers' `from_pretrained` does after its own meta-device load.

Keys are matched by name (a key saved without the base model's `model.` prefix is found too):
checkpoints whose keys transformers converts while loading (fused MoE experts, legacy names)
are reported as missing weights, not converted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from rlscale.errors import UserError, short_reason
from rlscale.models.loading import quiet_transformers

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def load_sharded(path: str, dtype: torch.dtype, device: torch.device, shard: Callable[[torch.nn.Module], None],
                 trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM in local directory `path` (config.json and safetensors weights), sharded by
    `shard(model)` (called on the meta-device model; it may also do nothing) and materialised on
    `device` in `dtype`, this rank reading only what it keeps. Returned in eval mode, as
    `from_pretrained` returns it. A weight missing from the files, or one whose shape there
    disagrees with the config, is a UserError naming the tensor and the file, raised before any
    memory is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    directory = Path(path)
    files = weight_files(directory)
    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad config
        raise UserError(f"cannot build model from {str(directory)!r}: {short_reason(exc)}") from None
    plan = _plan(model, files, directory)  # checked on the meta model: nothing allocated yet
    computed = _non_persistent_buffers(model)
    shard(model)
    model.to_empty(device=device)
    _retie(model, [names for names, _, _ in plan])
    with torch.no_grad():
        _recompute_buffers(model, computed)  # first: _init_weights of a module also sets its parameters
        for names, file, key in plan:
            _read_into(_tensor(model, names[0]), file, key)
    still_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"load_sharded: {still_meta[0]} is still on the meta device after to_empty")
    _load_generation_config(model, directory)
    return model.eval()


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the index, or the single file)."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = {str(name): str(file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index}: not a safetensors index ({short_reason(exc)})") from None
        for file in sorted(set(names.values())):
            if not (directory / file).is_file():
                raise UserError(f"{index}: names weight file {file!r}, which is not in {directory}")
        return {name: directory / file for name, file in names.items()}
    single = directory / SINGLE
    if single.is_file():
        return {name: single for name in _file_keys(single)}
    raise UserError(f"{directory}: no safetensors weights ({SINGLE} or {INDEX}); "
                    "convert the checkpoint to safetensors to load it sharded")


def _file_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error type for a corrupt header
        raise UserError(f"{file}: not a safetensors file ({short_reason(exc)})") from None


def _plan(model, files: dict[str, Path], directory: Path) -> list[tuple[list[str], Path, str]]:
    """Per distinct tensor (tied names together): its names in the model, the file and the key
    to read it from. Every tensor of the state dict must be in the files with the model's shape.
    A key saved without the base model's prefix (`model.`) is found too, as from_pretrained does."""
    from safetensors import safe_open

    persistent = set(model.state_dict().keys())
    groups: dict[int, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        if name in persistent:
            groups.setdefault(id(tensor), []).append(name)
            shapes[name] = tuple(tensor.shape)
    prefix = f"{getattr(model, 'base_model_prefix', '') or ''}."
    plan = []
    for names in groups.values():
        candidates = [*names, *(n[len(prefix):] for n in names if prefix != "." and n.startswith(prefix))]
        found = next((n for n in candidates if n in files), None)
        if found is None:
            where = INDEX if (directory / INDEX).is_file() else SINGLE
            tied = f" (tied with {', '.join(names[1:])})" if len(names) > 1 else ""
            raise UserError(f"model weight {names[0]!r}{tied} is missing from {directory / where}")
        plan.append((names, files[found], found))
    by_file: dict[Path, list[int]] = {}
    for i, (_, file, _) in enumerate(plan):
        by_file.setdefault(file, []).append(i)
    for file, entries in by_file.items():  # headers only: no tensor data is read here
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                for i in entries:
                    names, _, key = plan[i]
                    if key not in keys:
                        raise UserError(f"model weight {key!r} is missing from {file} (the index names that file)")
                    file_shape = tuple(f.get_slice(key).get_shape())
                    model_shape = shapes[names[0]]
                    if file_shape != model_shape:
                        raise UserError(f"model weight {key!r} has shape {list(file_shape)} in {file}, "
                                        f"the model's config gives {list(model_shape)}")
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{file}: not a safetensors file ({short_reason(exc)})") from None
    return sorted(plan, key=lambda entry: str(entry[1]))  # file by file


def _tensor(model, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(model.get_submodule(module_name), attr)
    except AttributeError:  # names are taken before `shard`: FSDP2 and HF checkpointing keep them
        raise RuntimeError(f"load_sharded: no tensor {name!r} after shard(); it must keep parameter names") from None


def _retie(model, groups: list[list[str]]) -> None:
    """Share tied tensors again (lm_head and embed_tokens under tie_word_embeddings): `to_empty`
    gives each module a Parameter of its own when moving plain tensors off the meta device
    (FSDP2's DTensors are swapped in place and stay shared)."""
    for names in groups:
        first = _tensor(model, names[0])
        for name in names[1:]:
            if _tensor(model, name) is not first:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                if isinstance(first, torch.nn.Parameter):
                    module.register_parameter(attr, first)
                else:
                    module.register_buffer(attr, first)


def _read_into(target: torch.Tensor, file: Path, key: str) -> None:
    """Copy this rank's part of tensor `key` of `file` into `target` (a DTensor's local shard,
    or a whole plain tensor), casting to its dtype. The file is mapped for this tensor alone."""
    from safetensors import safe_open

    if hasattr(target, "device_mesh"):  # a DTensor: only the rows (or block) this rank keeps
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        local = target.to_local()  # under no_grad: the `_local_tensor` itself, FSDP2's padded storage
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"load_sharded: {key}: local shard {tuple(local.shape)} "
                               f"but the placements give {tuple(shape)}")
    else:
        local, shape, offset = target, tuple(target.shape), (0,) * target.dim()
    if local.numel() == 0:  # a rank past the last row (torch.chunk leaves it nothing)
        return
    with safe_open(str(file), framework="pt") as f:
        if local.dim() == 0:
            part = f.get_tensor(key)
        else:
            part = f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        local.copy_(part)  # cast and (to a GPU) transfer in one; safetensors >= 0.7 slices are views of the mapping
        del part  # the mapping goes when the last view of it does


def _non_persistent_buffers(model) -> dict[str, torch.nn.Module]:
    """Buffers in no file (rotary frequencies): name -> the module that owns it."""
    owners = {}
    for name, _ in model.named_buffers(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._non_persistent_buffers_set:
            owners[name] = module
    return owners


def _recompute_buffers(model, owners: dict[str, torch.nn.Module]) -> None:
    """Fill the non-persistent buffers as from_pretrained does (`_init_weights` of their module,
    which recomputes "all the usual RotaryEmbeddings"); a float buffer it leaves alone (still the
    NaN put there first) means a model whose buffers this loader cannot compute."""
    modules = {id(module): module for module in owners.values()}
    for name in owners:
        buffer = _tensor(model, name)
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))
    init = getattr(model, "_init_weights", None)
    for module in modules.values():
        if init is not None:
            init(module)
    for name in owners:
        buffer = _tensor(model, name)
        if buffer.is_floating_point() and torch.isnan(buffer).any():
            raise UserError(f"cannot compute buffer {name!r} of {type(model).__name__} after a meta-device "
                            "build (its _init_weights does not set it); load this model whole")


def _load_generation_config(model, directory: Path) -> None:
    """from_pretrained also reads generation_config.json (sampling defaults, eos ids)."""
    if not (directory / "generation_config.json").is_file() or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    except Exception as exc:
        raise UserError(f"{directory / 'generation_config.json'}: {short_reason(exc)}") from None
