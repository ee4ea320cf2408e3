"""`rlscale bench gen`: generation throughput of the rollout engine against Hugging Face generate.

One process, one random-weight Qwen2-architecture model per shape, the same prompts for every
variant (EOS ignored, so every sequence decodes exactly `new_tokens`):
- hf_dynamic: `model.generate` with its default dynamic cache;
- hf_static: `cache_implementation="static"` (transformers compiles the decode step itself);
- engine: rlscale's rollout engine (slotted KV cache, decode steps replayed as CUDA graphs);
- engine_compiled: the same with the decode step compiled by torch.compile before capture (decode
  attention through flex attention, the engine's choice for a compiled step): the engine as
  `rlscale train` runs it, and with the two HF variants the default set (DEFAULT_VARIANTS);
- engine_sdpa: compiled, with decode attention through torch SDPA (cuDNN) instead;
- engine_matmul: compiled, with decode attention as two batched matmuls;
- engine_eager: the engine without graphs (what the graphs buy).
Warm-up (compilation, graph capture) runs before the timed repetitions and is reported apart.
The bandwidth bound: every decode step must read all weights once plus each sequence's keys and
values so far; `bound_fraction` is the measured tokens/s over that bound's tokens/s.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from rlscale.bench import sync, write_result
from rlscale.bench.scale import QWEN2_SHAPES
from rlscale.grpo.loss import token_logprobs_and_entropy

# HBM bandwidth, bytes/s (vendor figures), for the bound; unknown devices report no fraction.
MEMORY_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12}
# engine variants: RolloutEngine options beyond the default (graphs on CUDA, not compiled)
ENGINE_VARIANTS = {
    "engine": {},
    "engine_compiled": {"compiled": True},
    "engine_sdpa": {"compiled": True, "attention": "sdpa"},
    "engine_matmul": {"compiled": True, "attention": "matmul"},
    "engine_autotune": {"compiled": True, "compile_mode": "max-autotune-no-cudagraphs"},
    "engine_flex_defaults": {"compiled": True, "flex_kernel_options": {}},
    "engine_eager": {"graphs": False},
}
VARIANTS = ("hf_dynamic", "hf_static", *ENGINE_VARIANTS)
# without --variant: the HF baselines and the engine as `rlscale train` runs it (policy.generation.compile
# and cuda_graphs, both on by default: rlscale/workers/policy.py)
DEFAULT_VARIANTS = ("hf_dynamic", "hf_static", "engine_compiled")


def build_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    params = {"tie_word_embeddings": True, **QWEN2_SHAPES[shape]}
    config = Qwen2Config(**params, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def bandwidth_bound_tokens_per_s(model, batch: int, prompt: int, new: int, bandwidth: float) -> float:
    """Tokens/s if each decode step only had to read the weights and the live KV cache once."""
    from rlscale.rollout.weights import model_shape

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = model_shape(model.config).kv_values_per_token * model.dtype.itemsize
    seconds = sum((weight_bytes + batch * (prompt + t) * kv_per_token) / bandwidth for t in range(new))
    return batch * new / seconds


def _timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def _hf_generate(model, prompts: torch.Tensor, new_tokens: int, static: bool):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, use_cache=True,
                              cache_implementation="static" if static else None)
    mask = torch.ones_like(prompts)
    return lambda: model.generate(input_ids=prompts, attention_mask=mask, generation_config=config)


def _engine_generate(model, prompts: torch.Tensor, new_tokens: int, graphs: bool = True, compiled: bool = False,
                     attention: str = "auto", compile_mode: str | None = None,
                     flex_kernel_options: dict | None = None):
    from rlscale.rollout import RolloutEngine, SamplingMode

    engine = RolloutEngine(model, prompts.device, model.dtype, max_length=prompts.shape[1] + new_tokens + 64,
                           use_cuda_graphs=graphs and prompts.device.type == "cuda", compile_decode=compiled,
                           decode_attention=attention, compile_mode=compile_mode,
                           flex_kernel_options=flex_kernel_options)
    rows = prompts.tolist()
    return lambda: engine.generate(rows, new_tokens, SamplingMode(1.0), eos_ids=[1], pad_id=0, ignore_eos=True)


def logprob_agreement(model, prompts: torch.Tensor, new_tokens: int, rows: int = 16) -> dict:
    """Engine logprobs of its own samples against the model's forward pass (what the trainer sees),
    from the engine as training runs it: on CUDA compiled, with flex decode attention."""
    from rlscale.rollout import RolloutEngine, SamplingMode

    cuda = prompts.device.type == "cuda"
    engine = RolloutEngine(model, prompts.device, model.dtype, max_length=prompts.shape[1] + new_tokens + 64,
                           use_cuda_graphs=cuda, compile_decode=cuda)
    sample = prompts[:rows]
    out = engine.generate(sample.tolist(), new_tokens, SamplingMode(1.0), eos_ids=[1], pad_id=0, ignore_eos=True)
    full = torch.cat([sample, torch.tensor(out.tokens, device=sample.device)], dim=1)
    with torch.no_grad():
        logits = model(full).logits[:, sample.shape[1] - 1:-1]
    trainer, _ = token_logprobs_and_entropy(logits, full[:, sample.shape[1]:])
    diff = (torch.tensor(out.logprobs, device=trainer.device) - trainer).abs()
    # NeMo-RL's token_mult_prob_error: mean of exp(|logprob difference|), 1.0 = identical
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "token_mult_prob_error": float(diff.exp().mean())}


def run_variant(name: str, model, prompts: torch.Tensor, new_tokens: int, reps: int,
                kernel_tables: list[str] | None = None) -> dict:
    """kernel_tables: if given, one more (untimed) call runs under torch.profiler and its operator
    and kernel tables are appended (kernels replayed from CUDA graphs are listed one by one)."""
    device = prompts.device
    if name.startswith("hf_"):
        fn = _hf_generate(model, prompts, new_tokens, static=name == "hf_static")
    else:
        fn = _engine_generate(model, prompts, new_tokens, **ENGINE_VARIANTS[name])
    warmup_s = _timed(fn, device)  # compiles / captures; a full-length call so every shape is seen
    times = [_timed(fn, device) for _ in range(reps)]
    if kernel_tables is not None:
        kernel_tables.append(_profiled_call(fn, device))
    median = statistics.median(times)
    tokens = prompts.shape[0] * new_tokens
    return {"warmup_s": warmup_s, "times_s": times, "median_s": median, "tokens_per_s": tokens / median}


def _profiled_call(fn, device: torch.device) -> str:
    from torch.profiler import ProfilerActivity, profile

    from rlscale.telemetry.torch_profile import profile_tables

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    return profile_tables(prof)


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_benchmark(shapes: list[str], variants: list[str], batch: int, prompt_tokens: int, new_tokens: int,
                  reps: int, json_file: Path | None, echo=print, kernel_profile: Path | None = None) -> dict:
    """kernel_profile: a text file for torch.profiler tables of one extra call per variant."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = device_name()
    bandwidth = next((bw for key, bw in MEMORY_BANDWIDTH.items() if key in name), None)
    out = {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
           "batch": batch, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "reps": reps,
           "memory_bandwidth_Bps": bandwidth, "models": {}}
    for shape in shapes:
        model = build_model(shape, device, dtype)
        generator = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, model.config.vocab_size, (batch, prompt_tokens), generator=generator).to(device)
        entry = out["models"][shape] = {"params": sum(p.numel() for p in model.parameters()), "results": {}}
        if bandwidth:
            entry["bound_tokens_per_s"] = bandwidth_bound_tokens_per_s(model, batch, prompt_tokens, new_tokens, bandwidth)
        for variant in variants:
            try:
                tables: list[str] | None = [] if kernel_profile else None
                result = run_variant(variant, model, prompts, new_tokens, reps, tables)
                if tables:
                    with open(kernel_profile, "a") as f:
                        f.write(f"# {shape} {variant}, {batch} sequences × {prompt_tokens} prompt + "
                                f"{new_tokens} new tokens, one call\n\n{tables[0]}\n")
            except Exception as exc:  # one failing variant must not lose the others' numbers
                result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if bandwidth and "tokens_per_s" in result:
                result["bound_fraction"] = result["tokens_per_s"] / entry["bound_tokens_per_s"]
            entry["results"][variant] = result
            echo(f"{shape} {variant}: " + (f"{result['tokens_per_s']:,.0f} tok/s (warm-up {result['warmup_s']:.1f} s)"
                                           if "tokens_per_s" in result else result["error"][:300]))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_result(out, json_file)
        try:
            entry["engine_logprobs_vs_forward"] = logprob_agreement(model, prompts, new_tokens)
        except Exception as exc:
            entry["engine_logprobs_vs_forward"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        echo(f"{shape} engine logprobs vs forward: {entry['engine_logprobs_vs_forward']}")
        hf = [r["tokens_per_s"] for k, r in entry["results"].items() if k.startswith("hf_") and "tokens_per_s" in r]
        engines = [r["tokens_per_s"] for k, r in entry["results"].items()
                   if k.startswith("engine") and "tokens_per_s" in r]
        if hf and engines:
            entry["best_engine_vs_best_hf"] = max(engines) / max(hf)
        del model
        write_result(out, json_file)
    return out


def format_table(out: dict) -> str:
    lines = [f"{out['device']}: {out['batch']} sequences × {out['prompt_tokens']} prompt + "
             f"{out['new_tokens']} new tokens", "model        variant        tokens/s   warm-up_s  of bound"]
    for shape, entry in out["models"].items():
        for variant, r in entry["results"].items():
            if "tokens_per_s" not in r:
                lines.append(f"{shape:12} {variant:13}  failed: {r['error'][:60]}")
                continue
            frac = f"{r['bound_fraction']:.0%}" if "bound_fraction" in r else "-"
            lines.append(f"{shape:12} {variant:13} {r['tokens_per_s']:9,.0f}  {r['warmup_s']:9.1f}  {frac:>8}")
        if "best_engine_vs_best_hf" in entry:
            lines.append(f"{shape:12} best engine / best HF: {entry['best_engine_vs_best_hf']:.2f}x")
    return "\n".join(lines)
