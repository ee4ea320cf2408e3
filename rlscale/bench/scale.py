"""`rlscale bench scale`: GRPO step time and tokens/s on 1..N workers, same per-worker work.

Each worker count runs the real `rlscale train` (Ray workers, FSDP2, colocated generation) on a
Qwen2-architecture model built from a config with random weights (speed does not depend on the
weights), with `prompts_per_worker` prompts per worker per step, so ideal scaling keeps the step
time flat and multiplies tokens/s by the worker count. The first step (warm-up) is left out.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlscale.bench import write_result
from rlscale.telemetry.torch_profile import CALL_VARIABLE, DIR_VARIABLE, TORCH_VARIABLE, sections_line

QWEN2_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),  # a CPU smoke run of the benchmark itself
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # LoRA's one-GPU target (issue 27: the 14B step on one H200); 29.5 GB of bf16 weights on disk
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def build_random_model(shape: str, out_dir: Path) -> Path:
    """A Qwen2-architecture model dir with random bf16 weights and a tokenizer covering its vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlscale.models.tiny import CHARACTERS, SPECIAL_TOKENS

    params = {"tie_word_embeddings": True, **QWEN2_SHAPES[shape]}
    vocab_size = params["vocab_size"]
    # Characters first (prompts are text), then filler tokens so every sampled id decodes.
    words = SPECIAL_TOKENS + CHARACTERS
    words += [f"<t{i}>" for i in range(vocab_size - len(words))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    save_random_qwen2(params, tokenizer, out_dir)
    return out_dir


def save_random_qwen2(params: dict, tokenizer, out_dir: Path) -> None:
    """A Qwen2 shaped by `params` with random bf16 weights (seed 0), saved beside its tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**params, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the benchmarked runs load it in processes of their own


def train_overrides(model_dir: Path, workers: int, prompts: int, generations: int, new_tokens: int, steps: int,
                    log_dir: Path) -> list[str]:
    """A bench's `rlscale train` settings: one optimizer step on all samples per GRPO step, no
    validation, no checkpoints, 1024 tokens at most per sample (overrides after these win)."""
    return [
        f"policy.model_name={model_dir}", f"cluster.gpus_per_node={workers}", "cluster.backend=ray",
        f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={generations}",
        f"policy.train_global_batch_size={prompts * generations}",
        f"policy.generation.max_new_tokens={new_tokens}", "policy.max_total_sequence_length=1024",
        f"grpo.max_num_steps={steps}", "grpo.val_at_start=false", "grpo.val_at_end=false", "grpo.val_period=0",
        "checkpointing.enabled=false", "logger.progress=false", f"logger.log_dir={log_dir}",
        "data.arithmetic.num_val_problems=16",
    ]


def run_one(model_dir: Path, workers: int, prompts_per_worker: int, generations: int, new_tokens: int,
            steps: int, log_dir: Path, extra: list[str], profile_step: int | None = None) -> dict:
    """One `rlscale train` run; medians over its steps after the first. profile_step: that step's
    generate and train are timed section by section on every worker (synchronised at each
    section's end, so the step is left out of the medians) into the result's `sections_ms`."""
    prompts = prompts_per_worker * workers
    overrides = train_overrides(model_dir, workers, prompts, generations, new_tokens, steps, log_dir) + extra
    env = dict(os.environ)
    profile_dir = log_dir / "profile"
    if profile_step is not None:
        # validation is off, so the Nth generate and train calls are step N's
        env.update({DIR_VARIABLE: str(profile_dir), CALL_VARIABLE: str(profile_step), TORCH_VARIABLE: "0"})
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlscale.cli", "train", *overrides], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{workers} workers: rlscale train failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    # step 1 warms up kernels and allocators; a profiled step waits at every section
    rows = [r for r in rows if "time/step_s" in r][1:]
    rows = [r for r in rows if r.get("step") != profile_step]
    step_s = statistics.median(r["time/step_s"] for r in rows)
    tokens = statistics.median(r["throughput/tokens_per_s"] * r["time/step_s"] for r in rows)
    return {
        "workers": workers, "prompts_per_step": prompts, "samples_per_step": prompts * generations,
        "median_step_s": step_s, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s,
        "generate_s": statistics.median(r["time/generate_s"] for r in rows),
        "train_s": statistics.median(r["time/train_s"] for r in rows),
        "reward_s": statistics.median(r["time/reward_s"] for r in rows),
        "steps_timed": len(rows), "wall_s": time.perf_counter() - started,
        **({"sections_ms": profiled_sections(profile_dir)} if profile_step is not None else {}),
    }


def profiled_sections(directory: Path) -> dict[str, list]:
    """{"rank0-train": [[section, ms], ...], ...} from the workers' profile files."""
    return {path.name.rsplit("-call", 1)[0]: json.loads(path.read_text())["sections_ms"]
            for path in sorted(directory.glob("rank*-call*.json"))}


def run_benchmark(shape: str, worker_counts: list[int], prompts_per_worker: int, generations: int,
                  new_tokens: int, steps: int, json_file: Path | None, extra: list[str],
                  profile_step: int | None = None) -> dict:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_model(shape, Path(tmp) / shape)
        runs = [run_one(model_dir, n, prompts_per_worker, generations, new_tokens, steps,
                        Path(tmp) / f"run-{n}", extra, profile_step) for n in worker_counts]
    add_speedups(runs)
    out = {"date": time.strftime("%Y-%m-%d"), "device": device, "model": shape,
           "prompts_per_worker": prompts_per_worker, "generations_per_prompt": generations,
           "max_new_tokens": new_tokens, "runs": runs}
    write_result(out, json_file)
    return out


def add_speedups(runs: list[dict]) -> None:
    """tokens/s against the one-worker run of the same invocation; none without one (another
    run's baseline would mix machines and code)."""
    base = next((run["tokens_per_s"] for run in runs if run["workers"] == 1), None)
    for run in runs:
        run["speedup_vs_1"] = run["tokens_per_s"] / base if base else None


def format_table(out: dict) -> str:
    lines = [f"{out['model']} on {out['device']}, {out['prompts_per_worker']} prompts × "
             f"{out['generations_per_prompt']} samples per worker, {out['max_new_tokens']} new tokens",
             "workers  step_s  generate_s  train_s  tokens/s  speedup"]
    for r in out["runs"]:
        lines.append(f"{r['workers']:7d}  {r['median_step_s']:6.2f}  {r['generate_s']:10.2f}  {r['train_s']:7.2f}"
                     f"  {r['tokens_per_s']:8.0f}  " + (f"{r['speedup_vs_1']:6.2f}x" if r["speedup_vs_1"] else "     -"))
    for r in out["runs"]:
        for call, sections in r.get("sections_ms", {}).items():
            lines.append(f"{r['workers']} workers, {call} (ms): {sections_line(sections)}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rlscale.bench.scale  (also: rlscale bench scale)
    result = run_benchmark("qwen2-0.5b", [1, 2], 16, 8, 256, 4, None, os.environ.get("EXTRA", "").split())
    print(format_table(result))
