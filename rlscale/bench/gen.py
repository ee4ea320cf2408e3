"""`rlscale bench gen`: generation throughput of the rollout engine against Hugging Face generate.

One process, one random-weight Qwen2-architecture model per shape, the same prompts for every
variant (by default EOS ignored, so every sequence decodes exactly `new_tokens`):
- hf_dynamic: `model.generate` with its default dynamic cache;
- hf_static: `cache_implementation="static"` (transformers compiles the decode step itself);
- engine: rlscale's rollout engine (slotted KV cache, decode steps replayed as CUDA graphs);
- engine_compiled: the same with the decode step compiled by torch.compile before capture (decode
  attention through flex attention, the engine's choice for a compiled step): the engine as
  `rlscale train` runs it, and with the two HF variants the default set (DEFAULT_VARIANTS);
- engine_sdpa: compiled, with decode attention through torch SDPA (cuDNN) instead;
- engine_matmul: compiled, with decode attention as two batched matmuls;
- engine_eager: the engine without graphs (what the graphs buy);
- engine_full_batch: compiled, as engine_compiled, but every decode step runs over the whole cache
  until the last sequence ends (`shrink_batch=False`: the engine before the shrinking batch).
Warm-up (compilation, graph capture) runs before the timed repetitions and is reported apart.
The bandwidth bound: every decode step must read all weights once plus each sequence's keys and
values so far; `bound_fraction` is the measured tokens/s over that bound's tokens/s.

Long-tailed lengths (`--lengths geometric|lognormal`, mean `--mean-tokens`, capped at
`--new-tokens`): in math RL the answers have uneven lengths, and a batch's time is set by its
longest answers while most rows have ended. Each sequence gets a response length drawn once (a
seeded generator: the same lengths for every variant and repetition) and ends exactly there: the
engine through `generate(length_caps=...)`, HF generate through a logits processor that forces the
EOS token at that length (and forbids it before), with generate stopping finished rows. Every
variant thus produces the same tokens' worth of work, and `useful_tokens_per_s` (the drawn lengths'
sum over the median time) compares what each does with rows that have ended: HF keeps decoding
them as padding until the batch's longest ends, engine_full_batch runs them in the whole cache,
engine_compiled drops them from the decode batch (`engine_over_full_batch`: what the shrinking
batch buys). The engine variants draw keyed samples here (`seed=`), as `rlscale train` does: only
then may the engine compact the live sequences into a smaller batch. The bound counts, per step,
the weights and the live sequences' caches only.

`--gpu-memory-utilization F` (CUDA): each engine variant's KV cache gets F of the device's memory
less what is allocated once the engine is built (as `policy.generation.gpu_memory_utilization`
does when the memory plan has no figure), so a batch that does not fit is admitted in waves
(`waves`, and `max_decode_batch` the most sequences a decode step ran over, in each engine result).
"""

from __future__ import annotations

import math
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
    "engine_full_batch": {"compiled": True, "shrink_batch": False},
    "engine_unshared": {"compiled": True, "share_prompts": False},  # every copy of a group's prompt prefilled
}
LENGTHS = ("fixed", "geometric", "lognormal")
LOGNORMAL_SIGMA = 1.0
LENGTH_SEED = 2  # the prompts' generator is seeded 1
EOS_ID = 1  # build_model's config: eos_token_id=1, pad_token_id=0
KEYED_SEED = 0  # the engine's draws in long-tailed mode (keyed, as `rlscale train` draws)
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


def geometric_lengths(count: int, mean: float, cap: int, generator: torch.Generator) -> list[int]:
    """`count` lengths from the geometric distribution on 1, 2, ... with this mean (success
    probability 1/mean), by inverse CDF, clipped to cap."""
    u = 1.0 - torch.rand(count, generator=generator, dtype=torch.float64)  # (0, 1]
    p = 1.0 / mean
    lengths = torch.ones(count, dtype=torch.float64) if p >= 1.0 else torch.floor(u.log() / math.log1p(-p)) + 1
    return lengths.clamp(1, cap).long().tolist()


def lognormal_mu(mean: float, sigma: float = LOGNORMAL_SIGMA) -> float:
    """The log-normal's mu for this mean: mean = exp(mu + sigma²/2)."""
    return math.log(mean) - sigma ** 2 / 2


def lognormal_lengths(count: int, mean: float, cap: int, generator: torch.Generator,
                      sigma: float = LOGNORMAL_SIGMA) -> list[int]:
    """`count` lengths exp(mu + sigma·z) with this mean, rounded and clipped to 1..cap."""
    z = torch.randn(count, generator=generator, dtype=torch.float64)
    return (lognormal_mu(mean, sigma) + sigma * z).exp().round().clamp(1, cap).long().tolist()


def draw_lengths(kind: str, count: int, mean: float, cap: int, seed: int = LENGTH_SEED) -> list[int]:
    """One response length per sequence (the same for a given seed); `fixed`: every one the cap."""
    if kind == "fixed":
        return [cap] * count
    draw = {"geometric": geometric_lengths, "lognormal": lognormal_lengths}[kind]
    return draw(count, mean, cap, torch.Generator().manual_seed(seed))


def length_summary(kind: str, mean: float, cap: int, lengths: list[int], seed: int = LENGTH_SEED) -> dict:
    """The JSON's record of a long-tailed run's lengths: the distribution and what was drawn."""
    params = {"p": 1.0 / mean} if kind == "geometric" else {"mu": lognormal_mu(mean), "sigma": LOGNORMAL_SIGMA}
    ordered = sorted(lengths)
    return {"distribution": kind, "mean_tokens": mean, "cap": cap, "seed": seed, **params,
            "drawn": {"mean": statistics.fmean(lengths), "median": statistics.median(lengths),
                      "p90": ordered[math.ceil(0.9 * len(ordered)) - 1], "max": ordered[-1],
                      "at_cap_fraction": sum(n == cap for n in lengths) / len(lengths)}}


def bandwidth_bound_tokens_per_s(model, batch: int, prompt: int, new: int, bandwidth: float,
                                 lengths: list[int] | None = None) -> float:
    """Tokens/s if each decode step only had to read the weights and the live KV cache once.
    lengths: each sequence's response length (default: every one `new`); a step reads only the
    caches of the sequences still running, and the tokens are the lengths' sum."""
    from rlscale.rollout.weights import model_shape

    lengths = [new] * batch if lengths is None else lengths
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = model_shape(model.config).kv_values_per_token * model.dtype.itemsize
    seconds = sum((weight_bytes + sum(n > t for n in lengths) * (prompt + t) * kv_per_token) / bandwidth
                  for t in range(max(lengths)))
    return sum(lengths) / seconds


def _timed(fn, device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def eos_at_lengths(prompt_tokens: int, lengths: list[int], device, eos_id: int = EOS_ID):
    """A transformers logits processor: row i's response ends with the EOS token at lengths[i]
    (all its other logits -inf there) and samples no EOS before (HF pads the row after it)."""
    from transformers import LogitsProcessor

    class EosAtLength(LogitsProcessor):
        def __init__(self):
            self.last = torch.tensor(lengths, device=device) - 1  # the EOS token's response position

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            step = input_ids.shape[1] - prompt_tokens  # the response position sampled now
            force = (self.last == step).unsqueeze(1)
            scores = scores.masked_fill(force, -math.inf)
            eos = torch.where(self.last > step, -math.inf, torch.where(self.last == step, 0.0, scores[:, eos_id]))
            scores[:, eos_id] = eos
            return scores

    return EosAtLength()


def _hf_generate(model, prompts: torch.Tensor, new_tokens: int, static: bool, lengths: list[int] | None = None):
    """lengths: each row's response length, EOS forced there (None: every row decodes new_tokens, EOS ignored)."""
    from transformers import GenerationConfig, LogitsProcessorList

    common = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, pad_token_id=0,
                  use_cache=True, cache_implementation="static" if static else None)
    mask = torch.ones_like(prompts)
    if lengths is None:
        config = GenerationConfig(**common, min_new_tokens=new_tokens, eos_token_id=None)
        return lambda: model.generate(input_ids=prompts, attention_mask=mask, generation_config=config)
    config = GenerationConfig(**common, eos_token_id=EOS_ID)  # generate stops finished rows; no min_new_tokens
    processors = LogitsProcessorList([eos_at_lengths(prompts.shape[1], lengths, prompts.device)])
    return lambda: model.generate(input_ids=prompts, attention_mask=mask, generation_config=config,
                                  logits_processor=processors)


def hf_response_lengths(sequences: torch.Tensor, prompt_tokens: int, eos_id: int = EOS_ID) -> list[int]:
    """Each row's response length from `model.generate`'s output: through its first EOS (all of it if none)."""
    response = sequences[:, prompt_tokens:]
    is_eos = response == eos_id
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, response.shape[1])
    return first.tolist()


def kv_budget_bytes(fraction: float, device: torch.device) -> int:
    """The fraction of the device's memory less what is allocated now (0 if nothing is left)."""
    return max(0, int(fraction * torch.cuda.get_device_properties(device).total_memory)
               - torch.cuda.memory_allocated(device))


class EngineCall:
    """One engine variant's generate call; keeps the last Generation (its waves and decode batches)."""

    def __init__(self, engine, prompts: torch.Tensor, new_tokens: int, lengths: list[int] | None):
        from rlscale.rollout import SamplingMode

        self.engine, self.rows, self.new_tokens, self.lengths = engine, prompts.tolist(), new_tokens, lengths
        self.mode = SamplingMode(1.0)
        self.last = None

    def __call__(self):
        # long-tailed: each row ends at its length, with keyed draws (as `rlscale train`) so that
        # the engine may compact the rows still running
        self.last = self.engine.generate(self.rows, self.new_tokens, self.mode, eos_ids=[EOS_ID], pad_id=0,
                                         ignore_eos=True, length_caps=self.lengths,
                                         seed=None if self.lengths is None else KEYED_SEED)
        return self.last


def _engine_generate(model, prompts: torch.Tensor, new_tokens: int, graphs: bool = True, compiled: bool = False,
                     attention: str = "auto", compile_mode: str | None = None,
                     flex_kernel_options: dict | None = None, shrink_batch: bool = True, share_prompts: bool = True,
                     lengths: list[int] | None = None, budget_fraction: float | None = None) -> EngineCall:
    """lengths: each row's response length (None: every row new_tokens). budget_fraction: on CUDA,
    the KV budget is that fraction of the device's memory less what is allocated once the engine is built."""
    from rlscale.rollout import RolloutEngine

    engine = RolloutEngine(model, prompts.device, model.dtype, max_length=prompts.shape[1] + new_tokens + 64,
                           use_cuda_graphs=graphs and prompts.device.type == "cuda", compile_decode=compiled,
                           decode_attention=attention, compile_mode=compile_mode,
                           flex_kernel_options=flex_kernel_options, shrink_batch=shrink_batch,
                           share_prompts=share_prompts)
    if budget_fraction is not None and prompts.device.type == "cuda":
        engine.kv_budget_bytes = kv_budget_bytes(budget_fraction, prompts.device)
    return EngineCall(engine, prompts, new_tokens, lengths)


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
                kernel_tables: list[str] | None = None, lengths: list[int] | None = None,
                budget_fraction: float | None = None) -> dict:
    """kernel_tables: if given, one more (untimed) call runs under torch.profiler and its operator
    and kernel tables are appended (kernels replayed from CUDA graphs are listed one by one).
    lengths: long-tailed mode, each row ends at its length and the result has `useful_tokens_per_s`
    (the lengths' sum over the median time) instead of `tokens_per_s`. budget_fraction: the engine
    variants' KV budget (`kv_budget_bytes`)."""
    device = prompts.device
    if name.startswith("hf_"):
        fn = _hf_generate(model, prompts, new_tokens, static=name == "hf_static", lengths=lengths)
    else:
        fn = _engine_generate(model, prompts, new_tokens, **ENGINE_VARIANTS[name], lengths=lengths,
                              budget_fraction=budget_fraction)
    # compiles / captures; the timed calls' lengths (full-length in fixed mode) so every shape is seen
    warmup_s = _timed(fn, device)
    times = [_timed(fn, device) for _ in range(reps)] or [warmup_s]  # reps 0: the warm-up is the figure
    median = statistics.median(times)
    result = {"warmup_s": warmup_s, "times_s": times, "median_s": median, "timed_includes_warmup": reps == 0}
    if lengths is None:
        result["tokens_per_s"] = prompts.shape[0] * new_tokens / median
    else:
        result["useful_tokens_per_s"] = sum(lengths) / median
    if isinstance(fn, EngineCall):  # the last timed call's admission rounds and widest decode step
        result["waves"] = fn.last.waves
        result["max_decode_batch"] = max(fn.last.decode_batches, default=0)
        result["host_checks"] = fn.last.host_checks
        if fn.engine.kv_budget_bytes is not None:
            result["kv_budget_bytes"] = fn.engine.kv_budget_bytes
    if kernel_tables is not None:
        kernel_tables.append(_profiled_call(fn, device))
    return result


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
                  reps: int, json_file: Path | None, echo=print, kernel_profile: Path | None = None,
                  lengths: str = "fixed", mean_tokens: float | None = None,
                  gpu_memory_utilization: float | None = None, group: int = 1) -> dict:
    """kernel_profile: a text file for torch.profiler tables of one extra call per variant.
    lengths: fixed (every row decodes new_tokens, EOS ignored), geometric or lognormal (each row
    ends at a length drawn with mean mean_tokens, default new_tokens/4, capped at new_tokens).
    gpu_memory_utilization: the engine variants' KV budget as a fraction of the device (CUDA only).
    group: batch / group distinct prompts, each `group` times in a row (a GRPO step's layout)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = device_name()
    bandwidth = next((bw for key, bw in MEMORY_BANDWIDTH.items() if key in name), None)
    out = {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
           "batch": batch, "group": group, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "reps": reps,
           "memory_bandwidth_Bps": bandwidth, "models": {}}
    drawn = None  # fixed mode: every row new_tokens, EOS ignored
    if lengths != "fixed":
        mean = mean_tokens if mean_tokens is not None else max(1.0, new_tokens / 4)
        drawn = draw_lengths(lengths, batch, mean, new_tokens)
        out["lengths"] = length_summary(lengths, mean, new_tokens, drawn)
        echo(f"{lengths} lengths, mean {mean:g} capped at {new_tokens}: drawn {out['lengths']['drawn']}")
    budget = gpu_memory_utilization if device.type == "cuda" else None
    if gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = budget
        if budget is None:
            echo(f"note: --gpu-memory-utilization {gpu_memory_utilization} is ignored on CPU (no KV budget)")
    metric = "tokens_per_s" if drawn is None else "useful_tokens_per_s"
    for shape in shapes:
        model = build_model(shape, device, dtype)
        generator = torch.Generator().manual_seed(1)
        distinct = torch.randint(2, model.config.vocab_size, (batch // group, prompt_tokens), generator=generator)
        prompts = distinct.repeat_interleave(group, dim=0).to(device)
        entry = out["models"][shape] = {"params": sum(p.numel() for p in model.parameters()), "results": {}}
        if bandwidth:
            entry["bound_tokens_per_s"] = bandwidth_bound_tokens_per_s(model, batch, prompt_tokens, new_tokens,
                                                                       bandwidth, drawn)
        for variant in variants:
            try:
                tables: list[str] | None = [] if kernel_profile else None
                result = run_variant(variant, model, prompts, new_tokens, reps, tables, drawn, budget)
                if tables:
                    what = f"up to {new_tokens} new tokens ({lengths} lengths)" if drawn else f"{new_tokens} new tokens"
                    with open(kernel_profile, "a") as f:
                        f.write(f"# {shape} {variant}, {batch} sequences × {prompt_tokens} prompt + "
                                f"{what}, one call\n\n{tables[0]}\n")
            except Exception as exc:  # one failing variant must not lose the others' numbers
                result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            if bandwidth and metric in result:
                result["bound_fraction"] = result[metric] / entry["bound_tokens_per_s"]
            entry["results"][variant] = result
            unit = "tok/s" if drawn is None else "useful tok/s"
            echo(f"{shape} {variant}: " + (f"{result[metric]:,.0f} {unit} (warm-up {result['warmup_s']:.1f} s)"
                                           if metric in result else result["error"][:300]))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write_result(out, json_file)
        try:
            entry["engine_logprobs_vs_forward"] = logprob_agreement(model, prompts, new_tokens)
        except Exception as exc:
            entry["engine_logprobs_vs_forward"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        echo(f"{shape} engine logprobs vs forward: {entry['engine_logprobs_vs_forward']}")
        speeds = {k: r[metric] for k, r in entry["results"].items() if metric in r}
        hf = [v for k, v in speeds.items() if k.startswith("hf_")]
        engines = [v for k, v in speeds.items() if k.startswith("engine")]
        if hf and engines:
            entry["best_engine_vs_best_hf"] = max(engines) / max(hf)
        if "engine_compiled" in speeds and "engine_unshared" in speeds:
            entry["shared_over_unshared"] = speeds["engine_compiled"] / speeds["engine_unshared"]
        if drawn is not None and "engine_compiled" in speeds and "engine_full_batch" in speeds:
            entry["engine_over_full_batch"] = speeds["engine_compiled"] / speeds["engine_full_batch"]
        del model
        write_result(out, json_file)
    return out


def format_table(out: dict) -> str:
    lengths = out.get("lengths")
    metric, column = ("tokens_per_s", "tokens/s") if lengths is None else ("useful_tokens_per_s", "useful tok/s")
    if lengths is None:
        head = f"{out['new_tokens']} new tokens"
    else:
        d = lengths["drawn"]
        head = (f"up to {out['new_tokens']} new tokens, {lengths['distribution']} lengths of mean "
                f"{lengths['mean_tokens']:g} (drawn: mean {d['mean']:.1f}, median {d['median']:g}, p90 {d['p90']}, "
                f"max {d['max']}, {d['at_cap_fraction']:.0%} at the cap)")
    lines = [f"{out['device']}: {out['batch']} sequences × {out['prompt_tokens']} prompt + {head}",
             f"model        variant           {column:>12}  warm-up_s  of bound"]
    for shape, entry in out["models"].items():
        for variant, r in entry["results"].items():
            if metric not in r:
                lines.append(f"{shape:12} {variant:17} failed: {r['error'][:60]}")
                continue
            frac = f"{r['bound_fraction']:.0%}" if "bound_fraction" in r else "-"
            waves = f"  {r['waves']} waves" if r.get("waves", 1) > 1 else ""
            lines.append(f"{shape:12} {variant:17} {r[metric]:12,.0f}  {r['warmup_s']:9.1f}  {frac:>8}{waves}")
        if "best_engine_vs_best_hf" in entry:
            lines.append(f"{shape:12} best engine / best HF: {entry['best_engine_vs_best_hf']:.2f}x")
        if "engine_over_full_batch" in entry:
            lines.append(f"{shape:12} engine_compiled / engine_full_batch: {entry['engine_over_full_batch']:.2f}x")
    return "\n".join(lines)
