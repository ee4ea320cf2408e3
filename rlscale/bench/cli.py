"""`rlscale bench ...`: the benchmark commands (rlscale.cli adds `bench_app` as `bench`).

Options are checked here, before anything is built or written; the measuring is in the modules
beside this one, imported inside each command so that `rlscale --help` stays quick.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlscale.errors import UserError

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (measurements, not tests).")


def check_models(models: list[str]) -> None:
    """Each --model must be one of the benchmark shapes (rlscale.bench.scale.QWEN2_SHAPES)."""
    from rlscale.bench.scale import QWEN2_SHAPES

    for name in models:
        if name not in QWEN2_SHAPES:
            raise UserError(f"--model {name!r}: choose one of {', '.join(QWEN2_SHAPES)}")


def check_device(device: str) -> None:
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device!r}: choose auto, cpu or cuda")


def check_profile_step(profile_step: int | None, steps: int) -> None:
    if profile_step is not None and (profile_step > steps or steps < 3):
        raise UserError(f"--profile-step {profile_step} with --steps {steps}: the runs need at least "
                        f"{max(3, profile_step)} steps (step 1 warms up and the profiled step is not timed)")


def _parse_batch(text: str) -> tuple[int, int]:
    samples, sep, seq_len = text.lower().partition("x")
    if not sep or not samples.isdigit() or not seq_len.isdigit() or int(samples) < 1 or int(seq_len) < 4:
        raise UserError(f"--batch {text!r}: expected SAMPLESxSEQ_LEN, e.g. 16x320")
    return int(samples), int(seq_len)


@bench_app.command("ckpt")
def bench_ckpt(
    directory: Optional[Path] = typer.Option(None, "--dir", help="target directory (default: a fresh temporary one)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here as JSON"),
    size_gb: float = typer.Option(1.0, "--size-gb", min=0.001, help="state size (weights + AdamW) when --model is not given"),
    model: Optional[str] = typer.Option(None, "--model", help="qwen2-0.5b, qwen2-1.5b: that architecture, random weights"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    writers: int = typer.Option(4, "--writers", min=1, help="rlscale writers (and readers) per rank"),
    grpo_steps: int = typer.Option(0, "--grpo-steps", min=0,
                                   help="also time N GRPO steps with and without a save every step"),
    grpo_set: Optional[list[str]] = typer.Option(None, "--grpo-set", help="config override for those runs (repeatable)"),
    ranks: int = typer.Option(1, "--ranks", min=1,
                              help="N > 1: N FSDP2 ranks (gloo, all on this device) save and load the sharded "
                                   "layout, fp32 master weights + AdamW, against DCP on the same shards"),
) -> None:
    """Checkpoint save/load: torch.save, DCP save/async_save and rlscale on one state and directory."""
    check_device(device)
    if ranks > 1:
        from rlscale.bench.ckpt_ranks import run_ranked_benchmark

        if grpo_steps:
            raise UserError("--grpo-steps runs with one rank only (leave out --ranks)")
        run_ranked_benchmark(directory, json_file, size_gb, model, device, writers, ranks, echo=typer.echo)
        return
    from rlscale.bench.ckpt import run_benchmark

    run_benchmark(directory, json_file, size_gb, model, device, writers, grpo_steps, grpo_set, echo=typer.echo)


@bench_app.command("io")
def bench_io(
    path: Path = typer.Argument(..., help="directory to measure (e.g. the checkpoint file system)"),
    writers: int = typer.Option(8, "--writers", min=1, help="try 1, 2, 4, ... up to this many writers"),
    file_size_mb: int = typer.Option(256, "--file-size-mb", min=1, help="size of each shard-like file"),
    total_gb: float = typer.Option(2.0, "--total-gb", min=0.001, help="bytes written per trial"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here as JSON"),
) -> None:
    """fsync'd write and read throughput with 1..N writers, and the writers/stripes to use."""
    from rlscale.bench.io import format_table, io_command

    typer.echo(format_table(io_command(path, writers, file_size_mb, total_gb, json_file)))


@bench_app.command("scale")
def bench_scale(
    model: str = typer.Option("qwen2-0.5b", "--model", help="qwen2-0.5b, qwen2-1.5b, qwen2-7b (random weights), tiny"),
    workers: list[int] = typer.Option([1, 2], "--workers", help="worker counts to run (repeatable)"),
    prompts_per_worker: int = typer.Option(16, "--prompts-per-worker", min=1),
    generations: int = typer.Option(8, "--generations", min=2),
    new_tokens: int = typer.Option(256, "--new-tokens", min=1),
    steps: int = typer.Option(4, "--steps", min=2, help="GRPO steps per run; the first is not timed"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here as JSON"),
    override: Optional[list[str]] = typer.Option(None, "--set", help="extra config override (repeatable)"),
    profile_step: Optional[int] = typer.Option(
        None, "--profile-step", min=2, help="time this step's phases section by section on every worker "
        "(left out of the medians)"),
) -> None:
    """GRPO step time and tokens/s on 1..N Ray workers with the same work per worker."""
    from rlscale.bench.scale import format_table, run_benchmark

    check_models([model])
    if any(count < 1 for count in workers):
        raise UserError(f"--workers {min(workers)}: a run needs at least one worker")
    check_profile_step(profile_step, steps)
    out = run_benchmark(model, workers, prompts_per_worker, generations, new_tokens, steps, json_file, override or [],
                        profile_step)
    typer.echo(format_table(out))


def check_gen_lengths(lengths: str, mean_tokens: float | None, new_tokens: int) -> None:
    """`bench gen`'s long-tailed options: a known distribution, a mean inside 1..the cap."""
    from rlscale.bench.gen import LENGTHS

    if lengths not in LENGTHS:
        raise UserError(f"--lengths {lengths!r}: choose fixed, geometric or lognormal")
    if mean_tokens is None:
        return
    if lengths == "fixed":
        raise UserError("--mean-tokens needs --lengths geometric or lognormal (fixed: every response --new-tokens)")
    if not 1 <= mean_tokens <= new_tokens:
        raise UserError(f"--mean-tokens {mean_tokens:g}: the mean response length must be 1..{new_tokens} "
                        "(--new-tokens, the cap)")


def check_fraction(option: str, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise UserError(f"{option} {value:g}: expected a fraction F with 0 < F <= 1")


@bench_app.command("gen")
def bench_gen(
    model: list[str] = typer.Option(["qwen2-0.5b"], "--model", help="qwen2-0.5b, qwen2-1.5b, qwen2-7b, tiny (repeatable)"),
    variant: Optional[list[str]] = typer.Option(
        None, "--variant", help="hf_dynamic, hf_static, engine, engine_compiled, engine_sdpa, engine_matmul, "
        "engine_autotune, engine_flex_defaults, engine_eager, engine_full_batch, engine_unshared (repeatable); "
        "default: hf_dynamic, "
        "hf_static, engine_compiled (the engine as `rlscale train` runs it: compiled, CUDA graphs)"),
    batch: int = typer.Option(256, "--batch", min=1, help="sequences per generate call"),
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", min=1),
    new_tokens: int = typer.Option(256, "--new-tokens", min=2, help="response length (the cap with --lengths)"),
    reps: int = typer.Option(3, "--reps", min=0,
                            help="timed repetitions after the warm-up; 0 times the warm-up call itself "
                                 "(compile and capture included: for runs too long to repeat)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here as JSON"),
    kernel_profile: Optional[Path] = typer.Option(
        None, "--kernel-profile", help="append torch.profiler tables (device kernels by time) of one extra "
        "call per variant to this text file"),
    lengths: str = typer.Option(
        "fixed", "--lengths", help="fixed (every response --new-tokens, EOS ignored), geometric or lognormal "
        "(each response ends at a length drawn once per sequence, capped at --new-tokens; reports useful tok/s)"),
    mean_tokens: Optional[float] = typer.Option(
        None, "--mean-tokens", help="the drawn lengths' mean (default: --new-tokens / 4)"),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, "--gpu-memory-utilization", help="CUDA: the engine's KV cache may fill this fraction of the GPU "
        "less what is allocated (a batch that does not fit is admitted in waves); ignored on CPU"),
    group: int = typer.Option(
        1, "--group", min=1, help="GRPO groups: --batch / G distinct prompts, each G times in a row (the engine "
        "prefills a group's prompt once; engine_unshared prefills every copy)"),
) -> None:
    """Generation tokens/s: rlscale's rollout engine against Hugging Face generate."""
    from rlscale.bench.gen import DEFAULT_VARIANTS, VARIANTS, format_table, run_benchmark

    check_models(model)
    variants = variant or list(DEFAULT_VARIANTS)
    for name in variants:
        if name not in VARIANTS:
            raise UserError(f"--variant {name!r}: choose one of {', '.join(VARIANTS)}")
    check_gen_lengths(lengths, mean_tokens, new_tokens)
    check_fraction("--gpu-memory-utilization", gpu_memory_utilization)
    if batch % group:
        raise UserError(f"--group {group} does not divide --batch {batch}")
    out = run_benchmark(model, variants, batch, prompt_tokens, new_tokens, reps, json_file, echo=typer.echo,
                        kernel_profile=kernel_profile, lengths=lengths, mean_tokens=mean_tokens,
                        gpu_memory_utilization=gpu_memory_utilization, group=group)
    typer.echo(format_table(out))


@bench_app.command("step")
def bench_step(
    model: str = typer.Option("qwen2-0.5b", "--model",
                              help="qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen2.5-14b (random weights), tiny"),
    steps: int = typer.Option(4, "--steps", min=2, help="GRPO steps per half; the first is not timed"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here (after each half)"),
    only: Optional[str] = typer.Option(None, "--only", help="rlscale or trl: run one half"),
    trl_set: Optional[list[str]] = typer.Option(None, "--trl-set", help="GRPOConfig field=value for TRL (repeatable)"),
    rlscale_set: Optional[list[str]] = typer.Option(
        None, "--set", help="config override for the rlscale half, after the bench's own (repeatable)"),
    profile_step: Optional[int] = typer.Option(
        None, "--profile-step", min=2, help="time rlscale's step N section by section (left out of its medians)"),
    pairs: int = typer.Option(0, "--pairs", min=0, help="N alternating rlscale/TRL pairs on one model dir; "
                              "reports the median pair ratio"),
    compare_set: Optional[list[str]] = typer.Option(
        None, "--compare-set", help="with --pairs: also run rlscale with this override after each pair (repeatable)"),
) -> None:
    """One full GRPO step (32 prompts × 8 samples, 256 new tokens): rlscale vs TRL's GRPOTrainer."""
    from rlscale.bench.step import format_pairs, format_table, run_benchmark, run_pairs

    check_models([model])
    if only not in (None, "rlscale", "trl"):
        raise UserError(f"--only {only!r}: choose rlscale or trl")
    check_profile_step(profile_step, steps)
    if compare_set and not pairs:
        raise UserError("--compare-set needs --pairs N")
    if pairs:
        if only or profile_step:
            raise UserError("--pairs runs both halves unprofiled: leave out --only and --profile-step")
        out = run_pairs(model, steps, pairs, json_file, trl_set or [], rlscale_set or [], compare_set, echo=typer.echo)
        typer.echo(format_pairs(out))
        if any(p["trl_over_rlscale"] is None for p in out["pairs"]):
            raise typer.Exit(1)  # a run failed or TRL is not installed: not every pair compares
        return
    out = run_benchmark(model, steps, json_file, only, trl_set or [], echo=typer.echo,
                        profile_step=profile_step, rlscale_set=rlscale_set or [])
    typer.echo(format_table(out))
    if any((out[half] or {}).get("status") != "ok" for half in ("rlscale", "trl") if only in (None, half)):
        raise typer.Exit(1)  # a half that failed or could not run (TRL not installed): no comparison


@bench_app.command("train")
def bench_train(
    model: list[str] = typer.Option(["qwen2-0.5b"], "--model", help="qwen2-0.5b, qwen2-1.5b, qwen2-7b (random "
                                    "weights), tiny (a CPU smoke run); repeatable"),
    variant: Optional[list[str]] = typer.Option(
        None, "--variant", help="hf_sdpa, hf_eager, rlscale, rlscale_ac, rlscale_compile, rlscale_compile_unfused "
        "(repeatable); default: hf_sdpa, rlscale, rlscale_compile"),
    batch: list[str] = typer.Option(["16x320", "128x320"], "--batch", help="SAMPLESxSEQ_LEN (repeatable)"),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1, help="prompt tokens per sample; the rest is response"),
    ragged: bool = typer.Option(False, "--ragged", help="response lengths drawn from 1/4..1 of the room"),
    micro_tokens: int = typer.Option(16384, "--micro-tokens", min=8, help="rlscale's policy.train_micro_batch_tokens"),
    hf_micro: int = typer.Option(16, "--hf-micro-batch", min=1, help="samples per padded HF micro-batch"),
    warmup: int = typer.Option(2, "--warmup", min=1, help="untimed updates first (the first one compiles)"),
    reps: int = typer.Option(5, "--reps", min=1, help="timed updates; the median is reported"),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here (after every variant)"),
) -> None:
    """tokens/s and MFU of one policy update: rlscale's packed path against padded Hugging Face."""
    from rlscale.bench.train import DEFAULT_VARIANTS, VARIANTS, format_table, run_benchmark

    check_models(model)
    check_device(device)
    variants = variant or list(DEFAULT_VARIANTS)
    for name in variants:
        if name not in VARIANTS:
            raise UserError(f"--variant {name!r}: choose from {', '.join(VARIANTS)}")
    batches = [_parse_batch(b) for b in batch]
    for samples, seq_len in batches:
        if prompt_len >= seq_len:
            raise UserError(f"--prompt-len {prompt_len} leaves no response in --batch {samples}x{seq_len}")
        if micro_tokens < seq_len:
            raise UserError(f"--micro-tokens {micro_tokens} cannot hold one {seq_len}-token sample")
    out = run_benchmark(model, variants, batches, prompt_len, micro_tokens, hf_micro, warmup, reps, ragged, device,
                        json_file, echo=typer.echo)
    typer.echo(format_table(out))


@bench_app.command("mem")
def bench_mem(
    model: list[str] = typer.Option(["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"], "--model",
                                    help="qwen2-0.5b, qwen2-1.5b, qwen2-7b (random weights), tiny (repeatable)"),
    steps: int = typer.Option(2, "--steps", min=1, help="GRPO steps per model"),
    override: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE",
                                                 help="extra config override (repeatable)"),
    json_file: Optional[Path] = typer.Option(None, "--json", help="write the results here as JSON"),
) -> None:
    """Measured device-memory peaks per phase of GRPO steps against the memory plan's figures."""
    check_models(model)
    from rlscale.bench.mem import format_table, mem_command

    typer.echo(format_table(mem_command(model, steps, override or [], json_file)))
