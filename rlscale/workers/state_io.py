"""A policy worker's training state as checkpoint files, without pickle.

Layout inside a step directory (rank r of W, writer j of `writers_per_rank`), for workers that
are not sharded (one worker, or replicas):
  policy/model-r{r}-{j}.safetensors  weights by their Hugging Face names (+ config, tokenizer and
                                     the index the controller writes: a Hugging Face model dir)
  optim/optim-r{r}-{j}.safetensors   AdamW moments as "<param name>::<key>"; optim/meta.json holds
                                     param groups (by name) and the LR scheduler
  rng/rank{r}.safetensors / .json    torch (CPU, CUDA) and Python RNG states of rank r
Saving is spread over ranks: rank r writes the parameters in its contiguous, byte-balanced slice
of the parameter list (weights and moments together). Files hold whole tensors keyed by name;
each loading rank reads every weight and moment file (and keeps its slice when sharded).

FSDP2-sharded workers (several ranks) write the sharded layout instead (rlscale/ckpt/ranges.py):
policy/shard-r{r}-{j}.safetensors and optim/shard-r{r}-{j}.safetensors hold rank r's rows of
every weight and moment, nothing is gathered, and the manifest maps each tensor to its byte
ranges; a loading rank, sharded or not, reads only the ranges that overlap the rows it holds.
optim/meta.json, rng/ and policy/'s config and tokenizer are the same in both layouts.

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

from rlscale.ckpt import ranges, sharded, tensorfile
from rlscale.ckpt.engine import FileSpec, RankEngine
from rlscale.ckpt.reader import read_files, read_pieces
from rlscale.errors import UserError
from rlscale.models.lora import is_adapter

POLICY_DIR, OPTIM_DIR, RNG_DIR = "policy", "optim", "rng"
OPTIM_META = f"{OPTIM_DIR}/meta.json"


class ModelMismatch(ValueError):
    """The checkpoint's tensors are not this model's (another architecture or size)."""


def model_tensors(model) -> dict[str, torch.Tensor]:
    """Saved tensors by name; a tied weight appears once, under its first name (as HF saves it).
    A model with LoRA adapters saves (and loads) the adapters alone: the frozen base is the
    model's own files (policy.model_name, in the step's config.yaml)."""
    seen, out = set(), {}
    state = model.state_dict()
    if any(map(is_adapter, state)):
        state = {name: tensor for name, tensor in state.items() if is_adapter(name)}
    for name, tensor in state.items():
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
    if any(map(sharded.is_sharded, [*weights.values(), *moments.values()])):
        return sharded_tensor_files(rank, world, weights, moments, writers, name_of)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for flat, tensor in moments.items():
        by_param.setdefault(flat.split("::")[0], {})[flat] = tensor
    names = list(weights)
    sizes = [_nbytes(weights[n]) + sum(_nbytes(t) for t in by_param.get(n, {}).values()) for n in names]
    mine = split_by_bytes(sizes, world)[rank]
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
    weight_bytes = sum(_nbytes(weights[n]) for n in weight_map)
    if getattr(worker, "lora", False):
        weight_map = {}  # no Hugging Face weight index beside the adapters
    return TensorFiles(files, weight_map, weight_bytes, name_of)


def sharded_tensor_files(rank: int, world: int, weights: dict, moments: dict, writers: int,
                         name_of: dict[int, str]) -> TensorFiles:
    """The sharded layout's files of this rank: its rows of every sharded weight and moment, and
    its byte-balanced share of the tensors no rank shards (AdamW's step counters), in `writers`
    weight files and `writers` moment files. No collective: nothing is gathered."""
    held: dict[str, dict[str, tuple]] = {POLICY_DIR: {}, OPTIM_DIR: {}}  # name -> (local, first row, shape)
    whole = []
    for kind, tensors in ((POLICY_DIR, weights), (OPTIM_DIR, dict(sorted(moments.items())))):
        for name, tensor in tensors.items():
            if sharded.is_sharded(tensor):
                local, first = sharded.held_rows(tensor)
                if local.numel():  # FSDP2 leaves the last ranks of a short tensor empty
                    held[kind][name] = (local.detach(), first, tuple(tensor.shape))
            else:
                whole.append((kind, name, tensor.detach()))
    for i in split_by_bytes([_nbytes(t) for _, _, t in whole], world)[rank]:
        kind, name, tensor = whole[i]
        held[kind][name] = (tensor, 0, tuple(tensor.shape))
    files = []
    for kind, prefix in ((POLICY_DIR, "policy/shard"), (OPTIM_DIR, "optim/shard")):
        names = list(held[kind])
        for j, part in enumerate(split_by_bytes([_nbytes(held[kind][n][0]) for n in names], writers)):
            chosen = [names[i] for i in part]
            if chosen:
                files.append(FileSpec(f"{prefix}-r{rank:03d}-{j:03d}.safetensors",
                                      {n: held[kind][n][0] for n in chosen},
                                      rows={n: held[kind][n][1:] for n in chosen}))
    weight_bytes = sum(_nbytes(t) for t, _, _ in held[POLICY_DIR].values())
    return TensorFiles(files, {}, weight_bytes, name_of)


def small_files(worker, name_of: dict[int, str]) -> list[FileSpec]:
    """The files made anew at every save: param groups and LR scheduler, the Hugging Face side
    files (rank 0) and this rank's RNG states. `name_of`: param_names(worker.model)."""
    files = []
    if worker.rank == 0:
        meta = optimizer_meta(worker.optimizer, worker.scheduler, name_of)
        files.append(FileSpec(OPTIM_META, data=json.dumps(meta).encode()))
        if not getattr(worker, "lora", False):  # adapters alone are no Hugging Face model (ckpt export merges)
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


def load_worker_state(worker, step_dir: str | Path, manifest: dict, verify_checksums: bool, readers: int) -> dict:
    """Restore weights, optimizer, scheduler and this rank's RNG from a verified step directory.
    Files are read in parallel; weights land in the model's own tensors, moments on their
    parameter's device (into the optimizer's existing state tensors when it has them).
    Returns {"bytes_read": ...} for the sharded layout (its weights and moments)."""
    step_dir = Path(step_dir)
    if "tensors" in manifest:
        return _load_ranged(worker, step_dir, manifest, verify_checksums, readers)
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


def _load_ranged(worker, step_dir: Path, manifest: dict, verify: bool, readers: int) -> dict:
    """Load the sharded layout: this rank reads, of every weight and moment, only the saved
    ranges that overlap the rows it holds (all rows when it is not sharded), straight into the
    model's tensors and the optimizer's state where they exist; with `verify` each range read is
    checked against its checksum. The RNG file and meta.json are read whole."""
    table = manifest["tensors"]
    targets = model_tensors(worker.model)
    params = dict(worker.model.named_parameters())
    name_of = param_names(worker.model)
    state = {f"{name_of[id(p)]}::{key}": value for p, st in worker.optimizer.state.items()
             for key, value in st.items() if isinstance(value, torch.Tensor)}
    pieces, after, moments = [], [], {}

    def fill(entry: dict, tensor) -> None:
        """Plan the reads of this rank's rows of `tensor` (a DTensor's local rows, or all)."""
        if sharded.is_sharded(tensor):
            local, start = sharded.held_rows(tensor)
        else:
            local, start = tensor, 0
        rows = ranges.rows_of(tuple(local.shape))
        dest = local if local.is_contiguous() else torch.empty_like(local, memory_format=torch.contiguous_format)
        if dest is not local:
            after.append((local, dest))
        pieces.extend(ranges.plan_reads(entry, step_dir, start, start + rows, dest.detach(), verify))

    try:
        for name in table:
            if "::" not in name and name not in targets:
                raise ModelMismatch(f"the checkpoint holds {name!r}, which the model does not have")
        for name, target in targets.items():
            entry = table.get(name)
            if entry is None:
                raise ModelMismatch(f"no weights for {name}")
            if tuple(target.shape) != tuple(entry["shape"]):
                raise ModelMismatch(f"size mismatch for {name}: {entry['shape']} in the checkpoint, "
                                    f"{list(target.shape)} in the model")
            fill(entry, target)
        for flat, entry in table.items():
            if "::" not in flat:
                continue
            have, param = state.get(flat), params.get(flat.split("::")[0])
            shape, dtype = tuple(entry["shape"]), tensorfile.CODE_DTYPES[entry["dtype"]]
            if have is not None and tuple(have.shape) == shape:
                moments[flat] = have  # read into the optimizer's own state (its local rows)
            elif param is not None and sharded.is_sharded(param) and tuple(param.shape) == shape:
                local = torch.empty(sharded.held_rows(param)[0].shape, dtype=dtype, device=param.device)
                moments[flat] = sharded.shard_from_local(param, local)
            else:  # AdamW keeps its `step` counters on the host (unless capturable/fused)
                device = "cpu" if flat.endswith("::step") or param is None else param.device
                moments[flat] = torch.empty(shape, dtype=dtype, device=device)
            fill(entry, moments[flat])
        bytes_read = read_pieces(pieces, readers)
    except ModelMismatch as exc:
        raise UserError(f"checkpoint {str(step_dir)!r} does not match the model ({exc}); resume it with its "
                        "own policy.model_name, or use a new logger.log_dir") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"checkpoint {str(step_dir)!r} cannot be loaded: {exc}") from None
    with torch.no_grad():
        for local, dest in after:
            local.copy_(dest)
    _load_optimizer(worker, moments, json.loads((step_dir / OPTIM_META).read_text()), step_dir)
    rng_file = f"{RNG_DIR}/rank{worker.rank}.safetensors"
    if rng_file in manifest["files"]:  # a rank that did not exist at save time keeps its seeded RNG
        checksums = manifest.get("checksums", {}) if verify else None
        rng = {}
        read_files({rng_file: (str(step_dir / rng_file), manifest["files"][rng_file])}, 1, checksums,
                   lambda rel, slot: torch.empty(slot.shape, dtype=slot.dtype), lambda rel, t: rng.update(t), False)
        set_rng_state(rng, json.loads((step_dir / f"{RNG_DIR}/rank{worker.rank}.json").read_text()))
    return {"bytes_read": bytes_read}


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

    def load_checkpoint_shard(self, directory: str, manifest: dict, verify_checksums: bool = False) -> dict | None:
        self._ckpt_engine().fence()  # loading writes into the tensors in place
        self._ckpt_tensors = None  # may hold tensors the load replaces: let them go
        return load_worker_state(self, directory, manifest, verify_checksums, self.ckpt_settings.writers_per_rank)
