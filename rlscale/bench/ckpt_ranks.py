"""`rlscale bench ckpt --ranks N`: the sharded save and load of N FSDP2 ranks on one machine.

N processes (torch.multiprocessing, spawned) join one gloo group (file:// rendezvous); with
`--device cuda` all of them use the one GPU (gloo runs on CUDA tensors there; NCCL would refuse
two ranks on one device). Each rank holds its FSDP2 shard of the model (`fully_shard` of every
decoder block's unit, then the root, as a policy worker shards it) with fp32 master weights and
AdamW moments after one optimizer step: the state a training run saves, ~12 bytes a parameter.

Measured in one run, per rank and aggregated (the slowest rank, or rank 0's controller view):
  limits     device->host copy bandwidth (one rank alone) and fsync'd write / cold read GB/s of
             the directory with N x writers threads (what the N ranks' writers are together)
  dcp        torch.distributed.checkpoint save and load of the same sharded state dict
             (get_state_dict), every rank writing its own shards; dcp_async its async_save
  rlscale    the sharded save (each rank writes only its rows, rlscale/ckpt/ranges.py): stall_s
             is how long the training thread is blocked (rank 0's Checkpointer.save, which waits
             for every rank's snapshot), durable_s until the manifest is committed, load_s until
             every rank has read its ranges (cold cache); bytes written and read by every rank
Every load is checked bit-exact: each rank's tensors are overwritten before the load, and a
digest of every local tensor's bits after it must equal the one taken before the save. Bytes
per rank come from the engine (written) and the ranged reader (read), and for every method
from /proc/self/io (wchar, rchar: bytes through write and read system calls), on Linux.
Each method's files are deleted once it is measured, so the directory holds one copy at a time.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from rlscale.bench import code_revision, sync, write_result
from rlscale.bench.ckpt import (MODELS, _dcp_stagers, bench_directory, drop_cache, format_table, measure_limits,
                                qwen2_config, target_checks)
from rlscale.ckpt import sharded
from rlscale.errors import UserError
from rlscale.workers.state_io import CheckpointableWorker, model_tensors, optimizer_moments, param_names

DIGEST_CHUNK = 32 << 20  # elements per step of a digest (bounds its temporary memory)
SHARE_TOLERANCE = 0.1  # the bound: bytes per rank within 10% of total / N


class RankWorker(CheckpointableWorker):
    """One FSDP2 rank of a random Qwen2: fp32 master weights, AdamW after one step. Records when
    its writers finished (checkpoint_poll) and what its loads took (load_checkpoint_shard)."""

    def __init__(self, config, rank: int, world_size: int, device: torch.device, writers: int):
        from transformers import Qwen2ForCausalLM

        from rlscale.config import CheckpointingConfig
        from rlscale.models.tiny import build_char_tokenizer
        from rlscale.workers.distributed import shard_model

        self.rank, self.world_size, self.device = rank, world_size, device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what it computes in
        self.ckpt_settings = CheckpointingConfig(writers_per_rank=writers, keep_top_k=None, staging_budget_gb=1024)
        self.tokenizer = build_char_tokenizer()
        torch.manual_seed(0)  # every rank builds the same whole model and keeps its rows of it
        with torch.device(device):
            self.model = Qwen2ForCausalLM(config).to(torch.float32)
        mp_policy = None
        if device.type == "cuda":  # as rlscale.workers.precision casts for fp32 master weights
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(self.model, 6, mp_policy)  # policy.fsdp_layers_per_unit's default
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the whole model's memory, freed by the sharding
        # AdamW as rlscale.workers.precision.make_optimizer makes it for fp32 master weights
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        from torch.distributed.tensor import DTensor

        generator = torch.Generator(device=device).manual_seed(1 + rank)
        for p in self.model.parameters():
            local = torch.randn(p.to_local().shape, generator=generator, device=device, dtype=p.dtype) * 1e-3
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(device)
        self.writers_done_at: float | None = None
        self.load_report: dict = {}

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own memory of every saved tensor: its rows of the weights and moments
        (the step counters whole: every rank has its own copy of them)."""
        name_of = param_names(self.model)
        tensors = {**model_tensors(self.model), **optimizer_moments(self.optimizer, name_of)}
        return {name: (t.to_local() if sharded.is_sharded(t) else t) for name, t in tensors.items()}

    def global_bytes(self) -> int:
        """Bytes of the whole state (every tensor's global shape; a step counter once)."""
        name_of = param_names(self.model)
        tensors = {**model_tensors(self.model), **optimizer_moments(self.optimizer, name_of)}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def checkpoint_snapshot(self, directory: str) -> dict:
        self.writers_done_at = None
        return super().checkpoint_snapshot(directory)

    def checkpoint_poll(self) -> dict | None:
        result = super().checkpoint_poll()
        if result is not None and self.writers_done_at is None:
            self.writers_done_at = time.perf_counter()
        return result

    def load_checkpoint_shard(self, directory: str, manifest: dict, verify_checksums: bool = False):
        started = time.perf_counter()
        result = super().load_checkpoint_shard(directory, manifest, verify_checksums)
        sync(self.device)
        self.load_report = {"worker_load_s": time.perf_counter() - started, **(result or {})}
        return result


class DistGroup:
    """The controller's worker group, as every rank sees it: every rank calls run_all in the same
    order; once all have arrived each runs its own worker and every rank gets every result."""

    def __init__(self, worker):
        import torch.distributed as dist

        self.dist, self.worker, self.world_size = dist, worker, dist.get_world_size()

    def run_all(self, method, per_worker_args=None, **kwargs):
        self.dist.barrier()  # rank 0 has made the tmp dir before anyone writes into it
        args = (per_worker_args or [()] * self.world_size)[self.dist.get_rank()]
        results = [None] * self.world_size
        self.dist.all_gather_object(results, getattr(self.worker, method)(*args, **kwargs))
        return results


def digest(tensor: torch.Tensor) -> list[int]:
    """An exact fingerprint of a tensor's bits: sums of its 16-bit halves of every 32-bit word,
    plain and position-weighted (no overflow below 2^44 elements; equal bits, equal digest)."""
    flat = tensor.detach().contiguous().reshape(-1)
    acc = torch.zeros(4, dtype=torch.int64, device=flat.device)
    if flat.numel() == 0:
        return acc.tolist()
    size = flat.element_size()
    words = flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)
    mask = 0xFFFFFFFF if size >= 4 else 0xFFFF if size == 2 else 0xFF
    for start in range(0, words.numel(), DIGEST_CHUNK):
        x = words[start:start + DIGEST_CHUNK].to(torch.int64) & mask
        weight = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64) % 251 + 1
        lo, hi = x & 0xFFFF, x >> 16
        acc += torch.stack([lo.sum(), hi.sum(), (lo * weight).sum(), (hi * weight).sum()])
    return acc.tolist()


def state_digest(worker: RankWorker) -> dict[str, list[int]]:
    return {name: digest(t) for name, t in worker.local_tensors().items()}


def overwrite(worker: RankWorker) -> None:
    """Overwrite every tensor a load must restore (so a load that restores nothing is caught)."""
    with torch.no_grad():
        for tensor in worker.local_tensors().values():
            tensor.fill_(7)
    sync(worker.device)


def io_counters() -> dict[str, int]:
    """This process's bytes through read and write system calls (all its threads), on Linux."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    fields = dict(line.split(": ") for line in text.splitlines() if ": " in line)
    return {"rchar": int(fields["rchar"]), "wchar": int(fields["wchar"])}


def io_delta(before: dict[str, int]) -> dict[str, int]:
    after = io_counters()
    return {k: after[k] - before[k] for k in before}


def _check(worker: RankWorker, before: dict, overwritten: dict) -> dict:
    after = state_digest(worker)
    return {"bit_exact": after == before, "mismatches": sorted(n for n in before if after.get(n) != before[n])[:5],
            "overwrite_changed_state": overwritten != before}


def rank_dcp(worker: RankWorker, directory: Path, rank: int) -> tuple[dict, dict]:
    """DCP's save, load (cold, bit-checked) and async_save of the same sharded state, this rank's side."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    target = directory / "dcp"
    before = state_digest(worker)
    dist.barrier()
    counters, started = io_counters(), time.perf_counter()
    dcp.save(state, checkpoint_id=str(target))
    sync(worker.device)
    save_s = time.perf_counter() - started
    written = io_delta(counters)
    dist.barrier()
    if rank == 0:
        drop_cache(target)
    overwrite(worker)
    overwritten = state_digest(worker)
    dist.barrier()
    counters, started = io_counters(), time.perf_counter()
    dcp.load(state, checkpoint_id=str(target))
    set_state_dict(worker.model, worker.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sync(worker.device)
    load_s = time.perf_counter() - started
    read = io_delta(counters)
    checked = _check(worker, before, overwritten)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(target)
    result = {"stall_s": save_s, "durable_s": save_s, "load_s": load_s, "wchar": written.get("wchar"),
              "rchar": read.get("rchar"), **checked}
    async_result, errors = {}, []
    for stager in (*_dcp_stagers(worker.device.type == "cuda"), None):  # its pinned stagers, else its default
        try:
            async_result = _rank_dcp_async(dcp, dist, state, directory, stager, rank)
            failed = None
        except Exception as exc:  # noqa: BLE001 - some torch versions' stagers fail on some state dicts
            failed = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            if stager is not None:
                stager.close()
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, failed)  # every rank moves on to the next stager together
        if rank == 0:
            for leftover in ("dcp_async0", "dcp_async1"):
                shutil.rmtree(directory / leftover, ignore_errors=True)
        dist.barrier()
        failures = [f for f in outcomes if f is not None]
        if not failures:
            if errors:
                async_result["stager_errors"] = errors
            break
        errors.append(failures[0])
        async_result = {"error": errors[-1]}
    return result, async_result


def _rank_dcp_async(dcp, dist, state: dict, directory: Path, stager, rank: int) -> dict:
    timings = []
    for attempt in range(2):  # the first fills the stager's cached buffers
        target = directory / f"dcp_async{attempt}"
        dist.barrier()
        counters, started = io_counters(), time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(target), **({"async_stager": stager} if stager else {}))
        stall = time.perf_counter() - started
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        timings.append((stall, time.perf_counter() - started, io_delta(counters).get("wchar")))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(target)
    return {"stall_s": timings[-1][0], "durable_s": timings[-1][1], "first_stall_s": timings[0][0],
            "wchar": timings[-1][2], "stager": type(stager).__name__ if stager is not None else "default"}


def rank_rlscale(worker: RankWorker, directory: Path, rank: int) -> dict:
    """rlscale's sharded save (warm: the first save allocates the staging buffers) and ranged load."""
    import torch.distributed as dist

    from rlscale.ckpt import Checkpointer, layout
    from rlscale.ckpt.checkpointer import wait_for_writers

    root = directory / "rlscale"
    group = DistGroup(worker)
    checkpointer = Checkpointer(root, worker.ckpt_settings, "{}\n", "bench")
    if rank == 0:
        checkpointer.prepare(notify=print)
    dist.barrier()

    def save(step: int) -> dict:
        """rank 0 is the controller (Checkpointer.save, then its commit); the others mirror its
        calls, poll for poll. Times from a common barrier."""
        dist.barrier()
        counters, started = io_counters(), time.perf_counter()
        if rank == 0:
            report = checkpointer.save(step, group, {"step": step}, {})
            stall = time.perf_counter() - started
            checkpointer.wait()
            durable = time.perf_counter() - started
        else:
            group.run_all("checkpoint_snapshot", [(str(root / layout.tmp_dir_name(step)),)] * group.world_size)
            stall = time.perf_counter() - started
            wait_for_writers(group)
            durable, report = None, None
        written = io_delta(counters)
        out = {"stall_s": stall, "writers_done_s": worker.writers_done_at - started, "wchar": written.get("wchar")}
        if rank == 0:
            out.update(durable_s=durable, bytes_written_total=report.bytes)
        dist.barrier()
        return out

    first = save(1)
    if rank == 0:
        shutil.rmtree(root / "step_1")
    before = state_digest(worker)
    timed = save(2)
    step_dir = root / "step_2"
    manifest = layout.read_manifest(step_dir)
    mine = [f"policy/shard-r{rank:03d}-", f"optim/shard-r{rank:03d}-"]
    timed["shard_file_bytes"] = sum(size for rel, size in manifest["files"].items() if rel.startswith(tuple(mine)))
    timed["bytes_written"] = sum(size for rel, size in manifest["files"].items()
                                 if rel.startswith(tuple(mine)) or rel == f"rng/rank{rank}.safetensors"
                                 or rel == f"rng/rank{rank}.json"
                                 or (rank == 0 and not rel.startswith(("policy/shard-", "optim/shard-", "rng/"))))
    timed["format"], timed["first_stall_s"] = manifest.get("format"), first["stall_s"]
    timed["staging_registered"] = worker._engine._arena.registered
    if rank == 0:
        drop_cache(step_dir)
    overwrite(worker)
    overwritten = state_digest(worker)
    dist.barrier()
    counters, started = io_counters(), time.perf_counter()
    if rank == 0:
        checkpointer.load(step_dir, group)  # the controller's side: sizes, small files' checksums
    else:
        group.run_all("load_checkpoint_shard", [(str(step_dir), manifest, worker.ckpt_settings.verify_checksums)]
                      * group.world_size)
    sync(worker.device)
    load_s = time.perf_counter() - started
    read = io_delta(counters)
    timed.update(load_s=load_s, rchar=read.get("rchar"), bytes_read=worker.load_report.get("bytes_read"),
                 worker_load_s=worker.load_report.get("worker_load_s"), **_check(worker, before, overwritten))
    dist.barrier()
    if rank == 0:
        checkpointer.close()  # ends its claim on the directory
        shutil.rmtree(root)
    worker._engine.close()  # its pinned staging buffers
    dist.barrier()
    return timed


def rank_main(rank: int, world: int, rdzv: str, config, device_name: str, directory: str, writers: int,
              out_dir: str) -> None:
    """One rank of the benchmark: builds its shard, runs every method, writes rank{R}.json."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=60))
    directory = Path(directory)
    say = print if rank == 0 else (lambda *_, **__: None)
    try:
        started = time.perf_counter()
        worker = RankWorker(config, rank, world, device, writers)
        local = sum(t.numel() * t.element_size() for t in worker.local_tensors().values())
        nbytes = worker.global_bytes()
        params = sum(p.numel() for p in worker.model.parameters())
        say(f"state: {params / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB (fp32 weights + AdamW) over {world} "
            f"ranks on {device}, built in {time.perf_counter() - started:.1f} s; dir {directory}", flush=True)
        out = {"rank": rank, "local_state_bytes": local, "state_bytes": nbytes, "params": params}
        if device.type == "cuda":
            out["gpu_allocated_GB"] = torch.cuda.memory_allocated(device) / 1e9
        dist.barrier()
        if rank == 0:  # the machine's bounds, measured alone: every rank's writers together
            out["limits"] = measure_limits(directory, nbytes, device, writers * world)
            say(f"limits: {out['limits']}", flush=True)
        dist.barrier()
        out["dcp"], out["dcp_async"] = rank_dcp(worker, directory, rank)
        say(f"dcp: {out['dcp']}\ndcp_async: {out['dcp_async']}", flush=True)
        out["rlscale"] = rank_rlscale(worker, directory, rank)
        say(f"rlscale: {out['rlscale']}", flush=True)
        if device.type == "cuda":
            out["gpu_peak_GB"] = torch.cuda.max_memory_allocated(device) / 1e9
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def aggregate(ranks: list[dict]) -> dict:
    """The run's numbers from every rank's: the slowest rank (or rank 0, the controller) per method."""
    world = len(ranks)
    nbytes = ranks[0]["state_bytes"]
    share = nbytes / world

    def spread(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return max(abs(v - share) / share for v in values) if len(values) == world else None

    rl = [r["rlscale"] for r in ranks]
    rlscale = {"stall_s": rl[0]["stall_s"],  # the controller's save returns once every snapshot has
               "durable_s": rl[0]["durable_s"], "load_s": max(r["load_s"] for r in rl),
               "first_stall_s": rl[0]["first_stall_s"], "format": rl[0]["format"],
               "bytes_written": rl[0]["bytes_written_total"],
               "slowest_writers_done_s": max(r["writers_done_s"] for r in rl),
               "bytes_written_per_rank": [r["bytes_written"] for r in rl],
               "bytes_read_per_rank": [r["bytes_read"] for r in rl],
               "wchar_per_rank": [r["wchar"] for r in rl], "rchar_per_rank": [r["rchar"] for r in rl],
               "max_share_deviation_written": spread([r["shard_file_bytes"] for r in rl]),
               "max_share_deviation_read": spread([r["bytes_read"] for r in rl]),
               "bit_exact": all(r["bit_exact"] for r in rl)}
    dcp_rows = [r["dcp"] for r in ranks]
    dcp = {"stall_s": max(r["stall_s"] for r in dcp_rows), "durable_s": max(r["durable_s"] for r in dcp_rows),
           "load_s": max(r["load_s"] for r in dcp_rows), "wchar_per_rank": [r["wchar"] for r in dcp_rows],
           "rchar_per_rank": [r["rchar"] for r in dcp_rows], "bit_exact": all(r["bit_exact"] for r in dcp_rows)}
    async_rows = [r["dcp_async"] for r in ranks]
    if "error" in async_rows[0]:
        dcp_async = {"error": async_rows[0]["error"]}
    else:
        dcp_async = {"stall_s": max(r["stall_s"] for r in async_rows),
                     "durable_s": max(r["durable_s"] for r in async_rows),
                     "first_stall_s": max(r["first_stall_s"] for r in async_rows), "stager": async_rows[0]["stager"],
                     "wchar_per_rank": [r["wchar"] for r in async_rows]}
        if "stager_errors" in async_rows[0]:
            dcp_async["stager_errors"] = async_rows[0]["stager_errors"]
    return {"dcp": dcp, "dcp_async": dcp_async, "rlscale": rlscale}


def run_ranked_benchmark(directory: Path | None, json_file: Path | None, size_gb: float, model: str | None,
                         device_name: str, writers: int, ranks: int, echo=print, config=None) -> dict:
    """Spawn `ranks` gloo ranks, run every method, gather their numbers. `config`: a Qwen2Config
    instead of --model / --size-gb (the tests' tiny one)."""
    import torch.multiprocessing as mp

    from rlscale.models.loading import pick_device

    if ranks < 2:
        raise UserError("--ranks: the ranked benchmark needs 2 or more ranks (1 is the plain one)")
    if model is not None and model not in MODELS:
        raise UserError(f"--model {model!r}: known models are {', '.join(MODELS)}")
    device = pick_device(device_name)
    if config is None:
        config = qwen2_config(size_gb, model, torch.float32)
    directory, own_dir = bench_directory(directory)
    work = Path(tempfile.mkdtemp(prefix="rlscale-bench-ranks-"))  # rendezvous and per-rank results
    try:
        mp.spawn(rank_main, args=(ranks, str(work / "rdzv"), config, device.type, str(directory), writers,
                                  str(work)), nprocs=ranks, start_method="spawn")
        per_rank = [json.loads((work / f"rank{r}.json").read_text()) for r in range(ranks)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)
    nbytes, limits = per_rank[0]["state_bytes"], per_rank[0].pop("limits")
    results = aggregate(per_rank)
    targets = target_checks(nbytes, limits, results)
    for kind in ("written", "read"):
        deviation = results["rlscale"][f"max_share_deviation_{kind}"]
        targets[f"bytes_{kind}_per_rank_vs_share"] = {"value": float("nan") if deviation is None else deviation,
                                                      "bound": SHARE_TOLERANCE}
    out = {"bytes": nbytes, "ranks": ranks,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code": code_revision(), "torch": torch.__version__,
           "model": model or f"qwen2-arch {per_rank[0]['params'] / 1e6:.0f}M", "params": per_rank[0]["params"],
           "dtype": "float32", "master_weights": "fp32", "writers_per_rank": writers, "dir": str(directory),
           "limits": limits,
           "bounds_s": {"copy": nbytes / limits["d2h_GBps"] / 1e9, "write": nbytes / limits["write_GBps"] / 1e9,
                        "read": nbytes / limits["read_GBps"] / 1e9},
           "results": results, "targets": targets, "per_rank": per_rank}
    echo(format_table(out))
    echo(format_ranks(out))
    if json_file is not None:
        write_result(out, json_file)
        echo(f"wrote {json_file}")
    return out


def format_ranks(out: dict) -> str:
    share = out["bytes"] / out["ranks"]
    lines = [f"{'rank':<6}{'stall_s':>9}{'writers_s':>11}{'load_s':>9}{'written_GB':>12}{'read_GB':>9}"
             f"{'dcp_save_s':>12}{'dcp_load_s':>12}  (share {share / 1e9:.3f} GB)"]
    for r in out["per_rank"]:
        rl, dcp = r["rlscale"], r["dcp"]
        lines.append(f"{r['rank']:<6}{rl['stall_s']:9.3f}{rl['writers_done_s']:11.3f}{rl['load_s']:9.3f}"
                     f"{rl['bytes_written'] / 1e9:12.3f}{(rl['bytes_read'] or 0) / 1e9:9.3f}"
                     f"{dcp['durable_s']:12.3f}{dcp['load_s']:12.3f}")
    rl = out["results"]["rlscale"]
    lines.append(f"bit-exact loads: rlscale {rl['bit_exact']}, dcp {out['results']['dcp']['bit_exact']}")
    return "\n".join(lines)
