"""A policy worker's training state as checkpoint files, without pickle.

Layout inside a step directory (rank r of W, writer j of `writers_per_rank`):
  policy/model-r{r}-{j}.safetensors  weights by their Hugging Face names (+ config, tokenizer and
                                     the index the controller writes: a Hugging Face model dir)
  optim/optim-r{r}-{j}.safetensors   AdamW moments as "<param name>::<key>"; optim/meta.json holds
                                     param groups (by name) and the LR scheduler
  rng/rank{r}.safetensors / .json    torch (CPU, CUDA) and Python RNG states of rank r

Saving is spread over ranks: rank r writes the parameters in its contiguous, byte-balanced slice
of the parameter list (weights and moments together); FSDP2-sharded tensors are gathered for it
(see rlscale/ckpt/sharded.py). Files hold whole tensors keyed by name, so any worker count,
sharded or not, loads any checkpoint: each rank reads every weight and moment file.

A worker that is not sharded saves the same tensors, updated in place, save after save: it keeps
the weight and moment files' FileSpecs while state_signature is unchanged, so a warm snapshot
does little more than queue the copies. Only the small files (param groups and scheduler, RNG)
are made anew every save.
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from rlscale.ckpt import sharded
from rlscale.ckpt.engine import FileSpec, RankEngine
from rlscale.ckpt.reader import read_files
from rlscale.errors import UserError

POLICY_DIR, OPTIM_DIR, RNG_DIR = "policy", "optim", "rng"
OPTIM_META = f"{OPTIM_DIR}/meta.json"


class ModelMismatch(ValueError):
    """The checkpoint's tensors are not this model's (another architecture or size)."""


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Saved tensors by name; a tied weight appears once, under its first name (as HF saves it)."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        key = sharded.storage_key(tensor)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = sharded.local_view(tensor)
    return out


def optimizer_flat(model, optimizer, scheduler) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state keyed by parameter name (not position), so it survives re-sharding."""
    name_of = param_names(model)
    return optimizer_moments(optimizer, name_of), optimizer_meta(optimizer, scheduler, name_of)


def param_names(model) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def optimizer_moments(optimizer, name_of: dict[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors as "<param name>::<key>"."""
    return {f"{name_of[id(p)]}::{key}": sharded.local_view(value) for p, state in optimizer.state.items()
            for key, value in state.items() if isinstance(value, torch.Tensor)}


def optimizer_meta(optimizer, scheduler, name_of: dict[int, str]) -> dict:
    """Param groups (hyperparameters, parameters by name) and the LR scheduler: optim/meta.json."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"param_groups": groups, "scheduler": scheduler.state_dict()}


def split_by_bytes(sizes: list[int], parts: int) -> list[range]:
    """Cut indices 0..len(sizes) into `parts` contiguous ranges of near-equal byte totals
    (a range is empty when one item outweighs a share)."""
    total, bounds, running, index = sum(sizes), [0], 0, 0
    for part in range(1, parts):
        while index < len(sizes) and running + sizes[index] / 2 <= total * part / parts:
            running += sizes[index]
            index += 1
        bounds.append(index)
    bounds.append(len(sizes))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class TensorFiles:
    """A rank's weight and moment files, and what the controller's weight index needs from it."""

    files: list[FileSpec]
    weight_map: dict[str, str]  # weight name -> file name inside policy/
    weight_bytes: int
    param_names: dict[int, str]  # id(parameter) -> name, as the moments were named


def tensor_files(worker, writers: int) -> TensorFiles:
    """This rank's share of the weights and AdamW moments, in `writers` pairs of files."""
    rank, world = worker.rank, worker.world_size
    weights = model_tensors(worker.model)
    name_of = param_names(worker.model)
    moments = optimizer_moments(worker.optimizer, name_of)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for flat, tensor in moments.items():
        by_param.setdefault(flat.split("::")[0], {})[flat] = tensor
    names = list(weights)
    sizes = [_nbytes(weights[n]) + sum(_nbytes(t) for t in by_param.get(n, {}).values()) for n in names]
    mine = split_by_bytes(sizes, world)[rank]
    owned = {names[i] for i in mine}
    for name in names:  # same order on every rank: gathering a sharded tensor is a collective
        weights[name] = sharded.whole(weights[name], name in owned)
        for flat in sorted(by_param.get(name, {})):
            by_param[name][flat] = sharded.whole(by_param[name][flat], name in owned)
    files, weight_map = [], {}
    for j, part in enumerate(split_by_bytes([sizes[i] for i in mine], writers)):
        chosen = [names[mine[i]] for i in part]
        if not chosen:
            continue
        model_file = f"model-r{rank:03d}-{j:03d}.safetensors"
        files.append(FileSpec(f"{POLICY_DIR}/{model_file}", {n: weights[n] for n in chosen}, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(chosen, model_file))
        optim = {k: v for n in chosen for k, v in by_param.get(n, {}).items()}
        if optim:
            files.append(FileSpec(f"{OPTIM_DIR}/optim-r{rank:03d}-{j:03d}.safetensors", optim))
    return TensorFiles(files, weight_map, sum(_nbytes(weights[n]) for n in weight_map), name_of)


def small_files(worker, name_of: dict[int, str]) -> list[FileSpec]:
    """The files made anew at every save: param groups and LR scheduler, the Hugging Face side
    files (rank 0) and this rank's RNG states. `name_of`: param_names(worker.model)."""
    files = []
    if worker.rank == 0:
        meta = optimizer_meta(worker.optimizer, worker.scheduler, name_of)
        files.append(FileSpec(OPTIM_META, data=json.dumps(meta).encode()))
        files += [FileSpec(f"{POLICY_DIR}/{name}", data=blob) for name, blob in hf_side_files(worker).items()]
    rng_tensors, rng_meta = rng_state()
    files.append(FileSpec(f"{RNG_DIR}/rank{worker.rank}.safetensors", rng_tensors))
    files.append(FileSpec(f"{RNG_DIR}/rank{worker.rank}.json", data=json.dumps(rng_meta).encode()))
    return files


def state_signature(model, optimizer) -> tuple | None:
    """What a rank's tensor files read: every parameter and buffer (by name and object) and every
    optimizer state tensor (by parameter and key), each with the memory it occupies (pointer,
    shape, strides, dtype, device). Equal signatures mean files made for the first would read
    the same memory under the same names now: true across in-place updates (optimizer.step, a
    load into the existing tensors), false once a tensor is replaced, moved or added. None when
    a tensor is sharded: those are gathered into fresh whole tensors at every save."""
    named = [(name, sharded.local_view(t)) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    states = [(id(p), key, sharded.local_view(value)) for p, state in optimizer.state.items()
              for key, value in state.items() if isinstance(value, torch.Tensor)]
    tensors = [t for _, t in named] + [value for _, _, value in states]
    if any(map(sharded.is_sharded, tensors)):
        return None
    owners = tuple((name, id(t)) for name, t in named) + tuple((pid, key) for pid, key, _ in states)
    return owners, tuple(map(_memory, tensors))


def _memory(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device


def reads_only(made: TensorFiles, signature: tuple) -> bool:
    """Whether every tensor in the files is one the signature watches (not, say, a copy that a
    state_dict hook made): only then may the files be reused while the signature holds."""
    watched = set(signature[1])
    return all(_memory(t) in watched for f in made.files for t in f.tensors.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def hf_side_files(worker) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files, made once per worker: they do not
    change during training, and the tokenizer of a large vocabulary takes a while to serialise."""
    cached = getattr(worker, "_ckpt_hf_files", None)
    if cached is None:
        model = worker.model
        with tempfile.TemporaryDirectory() as tmp:
            config = copy.deepcopy(model.config)
            # the dtype the model computes in (fp32 master weights are saved as they train, and
            # `rlscale ckpt export` writes this dtype)
            dtype = getattr(worker, "dtype", None) or next(model.parameters()).dtype
            config.dtype = str(dtype).split(".")[1]
            config.architectures = [type(model).__name__]
            config.use_cache = True  # workers switch it off for training; an exported model generates
            config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            worker.tokenizer.save_pretrained(tmp)
            cached = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
        worker._ckpt_hf_files = cached
    return cached


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"].clone())
    cuda_keys = sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    cuda = [tensors[k].clone() for k in cuda_keys]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def load_worker_state(worker, step_dir: str | Path, manifest: dict, verify_checksums: bool, readers: int) -> None:
    """Restore weights, optimizer, scheduler and this rank's RNG from a verified step directory.
    Files are read in parallel; weights land in the model's own tensors, moments on their
    parameter's device (into the optimizer's existing state tensors when it has them)."""
    step_dir = Path(step_dir)
    files = manifest["files"]
    targets = model_tensors(worker.model)
    params = dict(worker.model.named_parameters())
    name_of = param_names(worker.model)
    existing = optimizer_moments(worker.optimizer, name_of)
    # the state tensors themselves (a one-rank DTensor's local view is read into in place)
    existing_state = {f"{name_of[id(p)]}::{key}": value for p, state in worker.optimizer.state.items()
                      for key, value in state.items() if isinstance(value, torch.Tensor)}
    rng_file = f"{RNG_DIR}/rank{worker.rank}.safetensors"
    wanted = [rel for rel in files if rel.endswith(".safetensors")
              and (rel.startswith((f"{POLICY_DIR}/", f"{OPTIM_DIR}/")) or rel == rng_file)]
    loaded, moments, rng, lock = set(), {}, {}, threading.Lock()

    def destination(rel: str, slot) -> torch.Tensor:
        if rel.startswith(f"{POLICY_DIR}/"):
            target = targets.get(slot.name)
            if target is None:
                raise ModelMismatch(f"{rel} holds {slot.name!r}, which the model does not have")
            if tuple(target.shape) != slot.shape:
                raise ModelMismatch(f"size mismatch for {slot.name}: {list(slot.shape)} in the checkpoint, "
                                    f"{list(target.shape)} in the model")
            if target.dtype == slot.dtype and target.is_contiguous() and not sharded.is_sharded(target):
                return target  # read straight into the parameter
            return torch.empty(slot.shape, dtype=slot.dtype, device=target.device)
        if rel.startswith(f"{OPTIM_DIR}/"):
            have = existing.get(slot.name)
            if (have is not None and have.dtype == slot.dtype and tuple(have.shape) == slot.shape
                    and have.is_contiguous() and not sharded.is_sharded(have)):
                return have
            # AdamW keeps its `step` counters on the host (unless capturable/fused)
            param = params.get(slot.name.split("::")[0])
            device = "cpu" if slot.name.endswith("::step") or param is None else param.device
            return torch.empty(slot.shape, dtype=slot.dtype, device=device)
        return torch.empty(slot.shape, dtype=slot.dtype)

    def done(rel: str, tensors: dict[str, torch.Tensor]) -> None:
        if rel.startswith(f"{POLICY_DIR}/"):
            for name, tensor in tensors.items():
                if tensor is not targets[name]:
                    sharded.assign(targets[name], tensor)  # a slice of it, or another dtype
        elif rel.startswith(f"{OPTIM_DIR}/"):
            for flat, tensor in list(tensors.items()):
                have, param = existing.get(flat), params.get(flat.split("::")[0])
                if have is not None and tensor is have:
                    tensors[flat] = existing_state[flat]  # read in place (through a local view)
                elif have is not None and sharded.is_sharded(have):
                    sharded.assign(have, tensor)
                    tensors[flat] = have
                elif param is not None and sharded.is_sharded(param) and not flat.endswith("::step"):
                    tensors[flat] = sharded.shard_like(param, tensor)
        with lock:
            if rel.startswith(f"{POLICY_DIR}/"):
                loaded.update(tensors)
            elif rel.startswith(f"{OPTIM_DIR}/"):
                moments.update(tensors)
            else:
                rng.update(tensors)

    paths = {rel: (str(step_dir / rel), files[rel]) for rel in wanted}
    checksums = manifest.get("checksums", {}) if verify_checksums else None
    cuda = any(t.is_cuda for t in targets.values())
    try:
        read_files(paths, readers, checksums, destination, done, cuda)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ModelMismatch(f"no weights for {', '.join(missing[:3])}")
    except ModelMismatch as exc:
        raise UserError(f"checkpoint {str(step_dir)!r} does not match the model ({exc}); resume it with its "
                        "own policy.model_name, or use a new logger.log_dir") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"checkpoint {str(step_dir)!r} cannot be loaded: {exc}") from None
    meta = json.loads((step_dir / OPTIM_META).read_text())
    _load_optimizer(worker, moments, meta, step_dir)
    if rng:  # a rank that did not exist at save time keeps the RNG it was seeded with
        set_rng_state(rng, json.loads((step_dir / f"{RNG_DIR}/rank{worker.rank}.json").read_text()))


def _load_optimizer(worker, moments: dict[str, torch.Tensor], meta: dict, step_dir: Path) -> None:
    groups = meta["param_groups"]
    names = [n for g in groups for n in g["params"]]
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for flat, value in moments.items():
        name, key = flat.split("::")
        state.setdefault(index[name], {})[key] = value
    loaded_groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
    for group in loaded_groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    # torch matches optimizer state by position: the saved groups must list our parameters in order
    current = [_names_of(worker.model, g["params"]) for g in worker.optimizer.param_groups]
    if current != [g["params"] for g in groups]:
        raise UserError(f"checkpoint {str(step_dir)!r}: its optimizer's parameter groups do not match the model")
    worker.optimizer.load_state_dict({"state": state, "param_groups": loaded_groups})
    worker.scheduler.load_state_dict(meta["scheduler"])


def _names_of(model, params) -> list[str]:
    name_of = param_names(model)
    return [name_of[id(p)] for p in params]


class CheckpointableWorker:
    """Checkpoint methods for a worker with model, optimizer, scheduler, tokenizer, rank,
    world_size and `ckpt_settings` (a CheckpointingConfig). The controller calls them through
    its worker group: snapshot (returns once the state is on the host), poll or finish (the
    persist's files and checksums), abort, load."""

    def _ckpt_engine(self) -> RankEngine:
        if getattr(self, "_engine", None) is None:
            s = self.ckpt_settings
            self._engine = engine = RankEngine(s.writers_per_rank, int(s.staging_budget_gb * 1e9))
            # a snapshot's device copies may still be reading the weights and moments: an update waits
            self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: engine.fence())
        return self._engine

    def checkpoint_snapshot(self, directory: str) -> dict:
        engine = self._ckpt_engine()
        tensors = self._ckpt_tensor_files()
        # a reused TensorFiles' param_names are still right: the signature holds every parameter's id
        return {**engine.snapshot(directory, tensors.files + small_files(self, tensors.param_names)),
                "weight_map": tensors.weight_map, "weight_bytes": tensors.weight_bytes}

    def _ckpt_tensor_files(self) -> TensorFiles:
        """The last save's tensor files while the state's signature and the file split are
        unchanged: the same FileSpecs, so the engine reuses their plans and views. Made anew
        otherwise (a new optimizer state, a moved tensor), and always when sharded. The kept
        files hold their tensors, so no new tensor can take their memory and match a stale
        signature; replaced tensors stay allocated until the next save or load."""
        writers = self.ckpt_settings.writers_per_rank
        signature = state_signature(self.model, self.optimizer)
        key = (writers, self.rank, self.world_size, signature)
        cached = getattr(self, "_ckpt_tensors", None)
        if signature is not None and cached is not None and cached[0] == key:
            return cached[1]
        made = tensor_files(self, writers)
        self._ckpt_tensors = (key, made) if signature is not None and reads_only(made, signature) else None
        return made

    def checkpoint_finish(self) -> dict:
        return self._ckpt_engine().finish()

    def checkpoint_poll(self) -> dict | None:
        return self._ckpt_engine().poll()

    def checkpoint_abort(self) -> None:
        self._ckpt_engine().abort()

    def load_checkpoint_shard(self, directory: str, manifest: dict, verify_checksums: bool = False) -> None:
        self._ckpt_engine().fence()  # loading writes into the tensors in place
        self._ckpt_tensors = None  # may hold tensors the load replaces: let them go
        load_worker_state(self, directory, manifest, verify_checksums, self.ckpt_settings.writers_per_rank)
