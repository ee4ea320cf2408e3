"""Tensor-parallel generation on one GPU: the CUDA kernels and the collectives' capture (CUDA only).

    python bench/tp_one_gpu.py OUT.json [--model qwen2-0.5b] [--batch 64] [--new-tokens 128]

NCCL refuses two ranks on one GPU, so the tensor-parallel engine is exercised there in two ways:
- T = 2 as two processes sharing the GPU over gloo (gloo all-reduces and all-gathers CUDA tensors;
  its collectives cannot be captured, so the engine runs eagerly): the bf16 sharded kernels and
  the sampling across vocabulary shards, against T = 1 eager on the same weights and prompts;
- a one-rank NCCL group with `TensorParallel(communicate_alone=True)`: the tensor-parallel path
  with its all-reduces and all-gathers inside the captured decode step, eager (against T = 1
  eager: a one-rank all-reduce is the identity, so tokens agree exactly, as measured on an H100,
  2026-12-05) and compiled (against T = 1 compiled: the collectives are fusion boundaries, so bf16
  intermediates may round elsewhere and rows part at near-ties; 5 of 64 rows agreed in full).
In bf16 a different summation order (two partial sums per row-parallel layer at T = 2) moves
logits by bf16 rounding, so greedy rows at T = 2 may part from T = 1 at a near-tie; the JSON
reports how many rows agree in full, the mean agreeing prefix, and the log-prob difference over it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlscale.bench import code_revision, write_result
from rlscale.bench.gen import build_model
from rlscale.rollout import RolloutEngine, SamplingMode, TensorParallel

PROMPT_TOKENS, SEED, REPS = 64, 7, 3
MODES = {"greedy": SamplingMode(0.0), "sampled": SamplingMode(1.0, top_p=0.9)}


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, vocab, (batch, PROMPT_TOKENS), generator=g).tolist()


def timed_generations(engine: RolloutEngine, rows, new_tokens: int) -> dict:
    """Each mode: one warm-up call, then REPS timed ones (keyed draws: the same tokens each call)."""
    out = {}
    for name, mode in MODES.items():
        call = lambda: engine.generate(rows, new_tokens, mode, eos_ids=[1], pad_id=0, ignore_eos=True, seed=SEED)  # noqa: E731
        call()
        times = []
        for _ in range(REPS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        out[name] = {"tokens": result.tokens, "logprobs": result.logprobs, "seconds": seconds,
                     "tokens_per_s": len(rows) * new_tokens / seconds}
    return out


def agreement(reference: dict, got: dict) -> dict:
    """Rows agreeing in full, mean agreeing prefix, and log-prob differences over the agreeing prefixes."""
    full, prefixes, diffs = 0, [], []
    for ref_t, got_t, ref_l, got_l in zip(reference["tokens"], got["tokens"], reference["logprobs"], got["logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(ref_t, got_t)) if a != b), len(ref_t))
        full += n == len(ref_t)
        prefixes.append(n / len(ref_t))
        diffs += [abs(a - b) for a, b in zip(ref_l[:n], got_l[:n])]
    return {"rows_identical": full, "rows": len(reference["tokens"]), "mean_agreeing_fraction": statistics.fmean(prefixes),
            "logprob_max_abs": max(diffs, default=0.0), "logprob_mean_abs": statistics.fmean(diffs) if diffs else 0.0}


def fingerprint(model) -> float:
    return float(sum(p.float().sum() for p in model.parameters()))


def gloo_rank(rank: int, size: int, init_file: str, expected: float, args, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        device = torch.device("cuda", 0)
        model = build_model(args.model, device, torch.bfloat16)  # seeded: the parent's weights
        if fingerprint(model) != expected:
            raise RuntimeError(f"rank {rank}: the model's weights differ from the parent's")
        tp = TensorParallel(rank, size, dist.new_group(list(range(size))))
        engine = RolloutEngine(model, device, torch.bfloat16, max_length=PROMPT_TOKENS + args.new_tokens + 64, tp=tp)
        del model
        result = timed_generations(engine, prompts(args.batch, engine.shape.vocab_size), args.new_tokens)
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen2-0.5b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    model = build_model(args.model, device, torch.bfloat16)
    max_length = PROMPT_TOKENS + args.new_tokens + 64
    rows = prompts(args.batch, model.config.vocab_size)
    work = Path(tempfile.mkdtemp(prefix="tp_one_gpu_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    expected = fingerprint(model)

    results = {"model": args.model, "batch": args.batch, "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens,
               "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "code": code_revision(), "reps": REPS}

    def stage(name: str, fn):
        """Run one stage; a failure is recorded (its last traceback lines) and the others still run."""
        try:
            return fn()
        except Exception:  # noqa: BLE001 - a benchmark records what broke and goes on
            results.setdefault("errors", {})[name] = traceback.format_exc().splitlines()[-12:]
            print(f"stage {name} failed:", *results["errors"][name], sep="\n", file=sys.stderr)
            return None

    def engine(**options):
        return RolloutEngine(model, device, torch.bfloat16, max_length, **options)

    eager = stage("t1_eager", lambda: timed_generations(engine(use_cuda_graphs=False), rows, args.new_tokens))
    captured = stage("t1_captured", lambda: timed_generations(engine(use_cuda_graphs=True, compile_decode=True), rows,
                                                            args.new_tokens))
    # the captured step's tensor-parallel path without compile, then compiled (as training runs it)
    dist.init_process_group("nccl", init_method=f"file://{work}/nccl_init", rank=0, world_size=1,
                            device_id=device)
    alone = TensorParallel(0, 1, dist.group.WORLD, communicate_alone=True)

    def nccl_run(compiled: bool):
        tp_engine = engine(use_cuda_graphs=True, compile_decode=compiled, tp=alone)
        assert tp_engine.tp is alone and tp_engine.use_graphs, "the one-rank NCCL engine keeps collectives and graphs"
        out = timed_generations(tp_engine, rows, args.new_tokens)
        out["graphs_captured"] = len(tp_engine.graphs)
        return out

    nccl_graphs = stage("nccl_one_rank_graphs", lambda: nccl_run(False))
    nccl = stage("nccl_one_rank_compiled", lambda: nccl_run(True))
    dist.destroy_process_group()
    del model
    torch.cuda.empty_cache()

    # T = 2 over gloo, two processes on the one GPU
    t2 = stage("t2_gloo_eager", lambda: (mp.start_processes(
        gloo_rank, (2, str(work / "gloo_init"), expected, args, str(work / "t2.pt")), nprocs=2, start_method="spawn"),
        torch.load(work / "t2.pt", weights_only=False))[1])

    def summary(name: str, run: dict | None, reference: dict | None) -> dict | None:
        if run is None:
            return None
        return {mode: {"tokens_per_s": run[mode]["tokens_per_s"], "seconds": run[mode]["seconds"],
                       **({"against": name, **agreement(reference[mode], run[mode])} if reference else {})}
                for mode in MODES}

    results["t1_eager"] = summary("", eager, None)
    results["t1_captured"] = summary("t1_eager", captured, eager)
    results["nccl_one_rank_graphs"] = summary("t1_eager", nccl_graphs, eager)
    results["nccl_one_rank_compiled"] = summary("t1_captured", nccl, captured)
    results["t2_gloo_eager"] = summary("t1_eager", t2, eager)
    write_result(results, args.out)
    print(json.dumps({k: v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
