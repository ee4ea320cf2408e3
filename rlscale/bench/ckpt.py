"""`rlscale bench ckpt`: one training state, one directory, every way of saving it.

Measures, in one run: torch.save (baseline), torch.distributed.checkpoint save and async_save
(the peer, with its pinned stager on CUDA) and rlscale's engine; plus the limits of this machine
and directory: device->host copy bandwidth and parallel fsync'd write and read bandwidth.
stall_s is how long the training thread is held; durable_s is until the checkpoint is on disk
(and, for rlscale, committed); load_s reads it back into the live model and optimizer with the
page cache dropped first (POSIX_FADV_DONTNEED on every file). Each engine saves once untimed
first, so allocations of reusable staging buffers are not counted: steady state, as in a run.
It is a measurement, not a test: the lead runs it on the GPU machine and commits the JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlscale.bench import sync, write_result
from rlscale.bench.scale import QWEN2_SHAPES
from rlscale.ckpt.layout import fsync_path
from rlscale.errors import UserError
from rlscale.workers.state_io import CheckpointableWorker

# Qwen2 architectures' shapes, from the table `bench scale` uses; weights are random. Only the
# tied-embedding sizes the checkpoint benchmark is run at (qwen2_config ties them).
MODELS = {name: QWEN2_SHAPES[name] for name in ("qwen2-0.5b", "qwen2-1.5b")}


def qwen2_config(size_gb: float, model: str | None, dtype: torch.dtype):
    """The named shape, or a Qwen2 whose weights + AdamW moments come to about size_gb."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if model is not None:
        if model not in MODELS:
            raise UserError(f"--model {model!r}: known models are {', '.join(MODELS)}")
        return Qwen2Config(**MODELS[model], tie_word_embeddings=True, max_position_embeddings=4096)
    base = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=4096)

    def params(layers: int) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**base, num_hidden_layers=layers)).parameters())

    per_layer, one = params(2) - params(1), params(1)
    target = size_gb * 1e9 / (3 * dtype.itemsize)  # weights + two moments, all in the weights' dtype
    return Qwen2Config(**base, num_hidden_layers=max(1, round((target - one + per_layer) / per_layer)))


class BenchWorker(CheckpointableWorker):
    """A policy-worker stand-in: a random Qwen2 with one AdamW step taken (moments populated)."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype, writers: int):
        from transformers import Qwen2ForCausalLM

        from rlscale.config import CheckpointingConfig
        from rlscale.models.tiny import build_char_tokenizer
        self.rank, self.world_size, self.device = 0, 1, device
        self.ckpt_settings = CheckpointingConfig(writers_per_rank=writers, keep_top_k=None, staging_budget_gb=1024)
        self.tokenizer = build_char_tokenizer()
        with torch.device(device):
            self.model = Qwen2ForCausalLM(config).to(dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        for p in self.model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(device)

    def state_bytes(self) -> int:
        from rlscale.workers.state_io import model_tensors, optimizer_flat

        tensors = list(model_tensors(self.model).values())
        tensors += list(optimizer_flat(self.model, self.optimizer, self.scheduler)[0].values())
        return sum(t.numel() * t.element_size() for t in tensors)


class OneWorkerGroup:
    def __init__(self, worker):
        self.workers, self.world_size = [worker], 1

    def run_all(self, method: str, per_worker_args=None, **kwargs):
        return [getattr(self.workers[0], method)(*(per_worker_args or [()])[0], **kwargs)]


def drop_cache(directory: Path) -> None:
    """Evict the files' clean pages, so a read measures storage, not memory."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):  # macOS has none: reads there may be cached
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure_limits(directory: Path, nbytes: int, device: torch.device, writers: int) -> dict[str, float]:
    """d2h copy bandwidth; parallel fsync'd write and (cold) read bandwidth of `directory`."""
    copy_bytes = min(nbytes, 4 << 30)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(3):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - started)
    del src, dst
    part = -(-nbytes // writers)
    data = torch.randint(0, 256, (part,), dtype=torch.uint8)
    view = memoryview(data.numpy())
    target = Path(directory) / "limits"
    target.mkdir(parents=True, exist_ok=True)

    def write(i: int) -> None:
        fd = os.open(target / f"part{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for offset in range(0, part, 64 << 20):
                piece = view[offset:offset + (64 << 20)]
                while piece:
                    piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        buffer = bytearray(64 << 20)
        with open(target / f"part{i}", "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass

    with ThreadPoolExecutor(writers) as pool:
        started = time.perf_counter()
        list(pool.map(write, range(writers)))
        write_s = time.perf_counter() - started
        drop_cache(target)
        started = time.perf_counter()
        list(pool.map(read, range(writers)))
        read_s = time.perf_counter() - started
    shutil.rmtree(target)
    return {"d2h_GBps": copy_bytes / best / 1e9, "write_GBps": part * writers / write_s / 1e9,
            "read_GBps": part * writers / read_s / 1e9}


def bench_torch_save(worker, directory: Path) -> dict[str, float]:
    path = directory / "torch_save.pt"
    started = time.perf_counter()
    torch.save({"model": worker.model.state_dict(), "optim": worker.optimizer.state_dict()}, path)
    fsync_path(path)
    elapsed = time.perf_counter() - started
    path.unlink()
    return {"stall_s": elapsed, "durable_s": elapsed}


def bench_dcp(worker, directory: Path) -> tuple[dict, dict]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    own_group = not dist.is_initialized()
    if own_group:  # DCP plans through a process group; one rank of gloo is the plain case
        dist.init_process_group("gloo", init_method=f"file://{directory}/pg_store", rank=0, world_size=1)
    try:
        model_sd, optim_sd = get_state_dict(worker.model, worker.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=str(directory / "dcp"))
        sync(worker.device)
        sync_s = time.perf_counter() - started
        drop_cache(directory / "dcp")
        started = time.perf_counter()
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        sync(worker.device)
        load_s = time.perf_counter() - started
        shutil.rmtree(directory / "dcp")
        async_result, errors = {}, []
        for stager in (*_dcp_stagers(worker.device.type == "cuda"), None):  # its pinned stagers, else its default
            try:
                async_result = _time_dcp_async(dcp, state, directory, stager)
                if errors:
                    async_result["stager_errors"] = errors
                break
            except Exception as exc:  # noqa: BLE001 - some torch versions' stagers fail on some state dicts
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                async_result = {"error": errors[-1]}
                shutil.rmtree(directory / "dcp_async0", ignore_errors=True)
                shutil.rmtree(directory / "dcp_async1", ignore_errors=True)
            finally:
                if stager is not None:
                    stager.close()
    finally:
        if own_group:
            dist.destroy_process_group()
    return {"stall_s": sync_s, "durable_s": sync_s, "load_s": load_s}, async_result


def _time_dcp_async(dcp, state: dict, directory: Path, stager) -> dict:
    timings = []
    for attempt in range(2):  # the first fills the stager's cached buffers
        target = directory / f"dcp_async{attempt}"
        started = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(target), **({"async_stager": stager} if stager else {}))
        stall = time.perf_counter() - started
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        timings.append((stall, time.perf_counter() - started))
        shutil.rmtree(target)
    return {"stall_s": timings[-1][0], "durable_s": timings[-1][1], "first_stall_s": timings[0][0],
            "stager": type(stager).__name__ if stager is not None else "default"}


def _dcp_stagers(cuda: bool) -> list:
    """DCP's reusable stagers that keep pinned buffers between saves, newest API first, where
    this torch has them (torch 2.11's DefaultStager failed on every state dict we gave it)."""
    stagers = []
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stagers.append(DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda)))
    except (ImportError, TypeError):
        pass
    try:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        stagers.append(BlockingAsyncStager(cache_staged_state_dict=True))
    except (ImportError, TypeError):
        pass
    return stagers


def bench_rlscale(worker, directory: Path) -> dict[str, float]:
    from rlscale.ckpt import Checkpointer

    root = directory / "rlscale"
    checkpointer = Checkpointer(root, worker.ckpt_settings, "{}\n", "bench")
    checkpointer.prepare(notify=print)
    group = OneWorkerGroup(worker)
    first = checkpointer.save(1, group, {"step": 1}, {})  # allocates the staging buffers
    checkpointer.wait()
    shutil.rmtree(root / "step_1")
    started = time.perf_counter()
    report = checkpointer.save(2, group, {"step": 2}, {})
    stall = time.perf_counter() - started
    checkpointer.wait()
    durable = time.perf_counter() - started
    profile = profile_save(checkpointer, group)
    drop_cache(root / "step_2")
    started = time.perf_counter()
    checkpointer.load(root / "step_2", group)
    sync(worker.device)
    load_s = time.perf_counter() - started
    checkpointer.close()  # ends its claim on the directory
    shutil.rmtree(root)
    return {"stall_s": stall, "durable_s": durable, "load_s": load_s, "first_stall_s": first.stall_s,
            "bytes_written": report.bytes, "staging_registered": worker._engine._arena.registered,
            "save_profile": profile}


def profile_save(checkpointer, group, rows: int = 30) -> list[str]:
    """Where a warm save's stall goes: cProfile of one more save, the top functions by
    cumulative time (a blocking device copy shows up as time inside its torch call)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    checkpointer.save(3, group, {"step": 3}, {})
    profiler.disable()
    checkpointer.wait()
    shutil.rmtree(checkpointer.root / "step_3")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(rows)
    return [line for line in text.getvalue().splitlines() if line.strip()][-rows - 1:]


def bench_grpo_overhead(worker, directory: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    """Mean GRPO step time with a save every step against the same run without checkpoints.
    The policy is the benchmark's model; the first step of each run is left out (warm-up, and
    the staging buffers' allocation). Rewards: rlscale.bench.rewards:parity."""
    from rlscale.config_loading import load_config
    from rlscale.controller import train

    model_dir = directory / "grpo-model"
    worker.model.save_pretrained(model_dir)
    worker.tokenizer.save_pretrained(model_dir)
    common = [f"policy.model_name={model_dir}", f"policy.device={worker.device.type}", "grpo.val_at_start=false",
              "grpo.val_at_end=false", "logger.progress=false", f"grpo.max_num_steps={steps}",
              "rewards.function=rlscale.bench.rewards:parity", *overrides]
    means = {}
    for name, extra in (("no_ckpt", ["checkpointing.enabled=false"]),
                        ("save_every_step", ["checkpointing.save_period=1", "checkpointing.keep_top_k=1"])):
        run_dir = directory / f"grpo-{name}"
        train(load_config(None, [*common, *extra, f"logger.log_dir={run_dir}"]))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [row for row in rows if "time/step_s" in row][1:]
        keys = ("time/step_s", "time/generate_s", "time/reward_s", "time/train_s", "time/checkpoint_s",
                "ckpt/wait_s", "ckpt/stall_s", "ckpt/persist_s")
        means[name] = {key: sum(row[key] for row in rows if key in row) / max(1, sum(key in row for row in rows))
                       for key in keys if any(key in row for row in rows)}
        shutil.rmtree(run_dir)
    shutil.rmtree(model_dir)
    plain, saving = means["no_ckpt"]["time/step_s"], means["save_every_step"]["time/step_s"]
    return {"steps": steps, "overrides": overrides, "no_ckpt_step_s": plain, "save_every_step_step_s": saving,
            "overhead": saving / plain - 1, "breakdown": means}


def target_checks(nbytes: int, limits: dict, results: dict) -> dict[str, dict]:
    """The issue's targets, as measured ratio vs. allowed bound (pass when value <= bound)."""
    rl, copy_bound = results["rlscale"], nbytes / limits["d2h_GBps"] / 1e9
    write_bound = nbytes / limits["write_GBps"] / 1e9
    checks = {
        "stall_vs_copy_bound": {"value": rl["stall_s"], "bound": 1.5 * copy_bound},
        "stall_vs_dcp_async": {"value": rl["stall_s"], "bound": 0.5 * results["dcp_async"].get("stall_s", float("nan"))},
        "durable_vs_write_bound": {"value": rl["durable_s"], "bound": 1.25 * write_bound + 1.0},
        "durable_vs_dcp": {"value": rl["durable_s"], "bound": 0.4 * results["dcp"]["durable_s"]},
        "load_vs_read_bound": {"value": rl["load_s"], "bound": nbytes / (0.8 * limits["read_GBps"] * 1e9)},
    }
    if "grpo" in results:
        grpo = results["grpo"]
        checks["grpo_step_time"] = {"value": grpo["save_every_step_step_s"], "bound": 1.02 * grpo["no_ckpt_step_s"]}
    return checks


def bench_directory(directory: Path | None) -> tuple[Path, bool]:
    """`--dir`, created (a fresh temporary one when None); and whether it is the bench's own."""
    own_dir = directory is None
    directory = Path(tempfile.mkdtemp(prefix="rlscale-bench-ckpt-")) if own_dir else Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--dir {str(directory)!r} cannot be created: {exc.strerror}") from None
    return directory, own_dir


def run_benchmark(directory: Path | None, json_file: Path | None, size_gb: float, model: str | None,
                  device_name: str, writers: int, grpo_steps: int = 0, grpo_overrides: list[str] | None = None,
                  echo=print) -> dict:
    from rlscale.models.loading import pick_device

    if model is not None and model not in MODELS:
        raise UserError(f"--model {model!r}: known models are {', '.join(MODELS)}")
    device = pick_device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    directory, own_dir = bench_directory(directory)
    worker = BenchWorker(qwen2_config(size_gb, model, dtype), device, dtype, writers)
    nbytes = worker.state_bytes()
    params = sum(p.numel() for p in worker.model.parameters())
    echo(f"state: {params / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB with AdamW, {dtype}, on {device}; dir {directory}")
    limits = measure_limits(directory, nbytes, device, writers)
    results = {"torch_save": bench_torch_save(worker, directory)}
    results["dcp"], results["dcp_async"] = bench_dcp(worker, directory)
    results["rlscale"] = bench_rlscale(worker, directory)
    if grpo_steps:
        results["grpo"] = bench_grpo_overhead(worker, directory, grpo_steps, grpo_overrides or [])
    out = {"bytes": nbytes, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": model or f"qwen2-arch {params / 1e6:.0f}M", "params": params, "dtype": str(dtype).split(".")[1],
           "writers_per_rank": writers, "dir": str(directory), "limits": limits, "results": results,
           "targets": target_checks(nbytes, limits, results)}
    if own_dir:
        shutil.rmtree(directory, ignore_errors=True)
    echo(format_table(out))
    if json_file is not None:
        write_result(out, json_file)
        echo(f"wrote {json_file}")
    return out


def format_table(out: dict) -> str:
    limits = out["limits"]
    lines = [f"limits: d2h {limits['d2h_GBps']:.1f} GB/s, write {limits['write_GBps']:.2f} GB/s, "
             f"read {limits['read_GBps']:.2f} GB/s  ({out['bytes'] / 1e9:.2f} GB state on {out['device']})",
             f"{'engine':<12}{'stall_s':>10}{'durable_s':>11}{'load_s':>9}"]
    for name, row in out["results"].items():
        if name == "grpo":
            lines.append(f"grpo step    {row['no_ckpt_step_s']:.3f} s without checkpoints, "
                         f"{row['save_every_step_step_s']:.3f} s saving every step ({row['overhead']:+.1%})")
            continue
        if "error" in row:
            lines.append(f"{name:<12}failed: {row['error']}")
            continue
        load = f"{row['load_s']:9.3f}" if "load_s" in row else " " * 9
        lines.append(f"{name:<12}{row['stall_s']:10.3f}{row['durable_s']:11.3f}{load}")
    for name, check in out["targets"].items():
        verdict = "ok" if check["value"] <= check["bound"] else "MISSED" if check["bound"] == check["bound"] else "n/a"
        lines.append(f"target {name:<24} {check['value']:.3f} <= {check['bound']:.3f}  {verdict}")
    return "\n".join(lines)
