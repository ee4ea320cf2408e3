"""`rlscale bench train`: tokens/s and MFU of one policy update, rlscale against plain Hugging Face.

One update = forward + backward over a fixed batch + gradient clipping + the optimizer step. On
the same random-weight Qwen2-architecture model and the same batch, in the same process:

- `hf_sdpa` / `hf_eager`: the textbook path. Padded micro-batches of `--hf-micro-batch`
  samples through the Hugging Face model (SDPA or eager attention), full-vocabulary logits,
  float32 log-softmax over all of them, default AdamW.
- `rlscale`: PolicyWorker.train itself: packed micro-batches of `--micro-tokens` tokens,
  attention per document (varlen flash on CUDA), LM head and log-softmax in chunks over the
  response positions only, the loss's gradient taken in the head's forward
  (policy.fused_head_loss), fused AdamW. `rlscale_ac` adds activation checkpointing,
  `rlscale_compile` torch.compile of the decoder layers (its compile time is reported apart),
  `rlscale_compile_unfused` is that with the head's backward recomputing the logits instead.

Each variant is timed warm: `--warmup` updates first (the first one's time is reported as
first_update_s, its excess over a warm update as first_update_overhead_s: compilation happens
there), then the median of `--reps`. Every model/variant
runs in its own try/except and the JSON is rewritten after each, so one failure (e.g. out of
memory) still leaves every other number and the error.

MFU = model FLOPs per update / time / the device's dense bf16 peak (PEAK_TFLOPS); the FLOP
count is `update_flops`:
    6 · (P_layers · T + V · d · R) + 6 · L · H · d_head · Σ_docs s²
with P_layers the parameters of the decoder layers (the matmuls), T the batch's tokens, R its
response tokens (the only positions whose logits an update needs; a path that computes the
head everywhere does extra work that is not credited), and the last term causal attention
(QKᵀ and PV, half of the s×s square, forward + 2× backward). `mfu_6nt` is the cruder
6 · N_params · T (no attention), the formula of the anchor measurement.
"""

from __future__ import annotations

import gc
import platform
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from rlscale.bench import sync, write_result

# dense (non-sparse) bf16 tensor-core peaks, TFLOP/s; the first matching name wins
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
]
VARIANTS = ("hf_sdpa", "hf_eager", "rlscale", "rlscale_ac", "rlscale_compile", "rlscale_compile_unfused")
DEFAULT_VARIANTS = ("hf_sdpa", "rlscale", "rlscale_compile")


def peak_tflops(device_name: str) -> float | None:
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def layer_params(shape: dict) -> int:
    """Matmul parameters of the decoder layers (projections and MLP; norms and biases left out)."""
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim", d // shape["num_attention_heads"])
    q = d * shape["num_attention_heads"] * head_dim
    kv = 2 * d * shape["num_key_value_heads"] * head_dim
    return layers * (2 * q + kv + 3 * d * ff)


def update_flops(shape: dict, doc_lengths: list[int], response_tokens: int) -> float:
    """Model FLOPs of one forward + backward over documents of these lengths (formula above)."""
    d, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim", d // shape["num_attention_heads"])
    tokens = sum(doc_lengths)
    dense = 6 * (layer_params(shape) * tokens + shape["vocab_size"] * d * response_tokens)
    attention = 6 * layers * shape["num_attention_heads"] * head_dim * sum(s * s for s in doc_lengths)
    return float(dense + attention)


def synthetic_batch(samples: int, seq_len: int, prompt_len: int, vocab: int, ragged: bool, seed: int = 0):
    """A fixed TrainBatch: prompt_len prompt tokens, the rest response (ragged: response lengths
    drawn from [1/4, 1] of the room, so padding is visible), advantages ±1."""
    import torch

    from rlscale.workers.batch import build_train_batch

    gen = torch.Generator().manual_seed(seed)
    room = seq_len - prompt_len
    prompts, responses = [], []
    for _ in range(samples):
        length = int(torch.randint(max(1, room // 4), room + 1, (1,), generator=gen)) if ragged else room
        prompts.append(torch.randint(2, vocab, (prompt_len,), generator=gen).tolist())
        responses.append(torch.randint(2, vocab, (length,), generator=gen).tolist())
    advantages = [1.0 if i % 2 else -1.0 for i in range(samples)]
    return build_train_batch(prompts, responses, advantages, pad_id=0, max_length=seq_len)


def _timed(update, device, warmup: int, reps: int) -> dict:
    times = []
    for _ in range(warmup + reps):
        sync(device)
        started = time.perf_counter()
        update()
        sync(device)
        times.append(time.perf_counter() - started)
    return {"first_update_s": times[0], "median_update_s": statistics.median(times[warmup:]),
            "update_times_s": times[warmup:]}


def _hf_update(model, optimizer, batch, micro: int, device):
    """Padded micro-batches, full logits, float32 log-softmax everywhere: the textbook update."""
    import torch

    from rlscale.grpo.loss import grpo_token_loss

    def update():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = batch.response_mask.sum()
        for start in range(0, len(batch), micro):
            part = batch.slice(start, start + micro).to(device)
            logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, part.input_ids[:, 1:, None]).squeeze(-1)
            terms = grpo_token_loss(logprobs, logprobs.detach(), part.advantages)
            (terms.loss * part.response_mask / total).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return update


def _memory_gb(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def run_hf(model_dir: Path, variant: str, batch, micro: int, device, dtype, warmup: int, reps: int) -> dict:
    import torch

    from rlscale.models import load_model

    model = load_model(str(model_dir), dtype, device)
    model.config.use_cache = False
    model.set_attn_implementation("sdpa" if variant == "hf_sdpa" else "eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    try:
        return {**_timed(_hf_update(model, optimizer, batch, micro, device), device, warmup, reps),
                "micro_batch_samples": micro}
    finally:
        del model, optimizer


def run_rlscale(model_dir: Path, variant: str, batch, micro_tokens: int, device, warmup: int, reps: int,
                seq_len: int, check_against_hf: bool) -> dict:
    from rlscale.config_loading import load_config
    from rlscale.workers.policy import PolicyWorker

    samples = len(batch)
    overrides = [
        f"policy.model_name={model_dir}", f"policy.device={device.type}", "loss.reference_policy_kl_penalty=0",
        f"policy.max_total_sequence_length={seq_len}", f"policy.generation.max_new_tokens={seq_len // 2}",
        f"policy.train_micro_batch_tokens={micro_tokens}", f"policy.train_global_batch_size={samples}",
        f"grpo.num_prompts_per_step={samples}", "grpo.num_generations_per_prompt=2",
        f"policy.activation_checkpointing={str(variant == 'rlscale_ac').lower()}",
        f"policy.compile={str(variant.startswith('rlscale_compile')).lower()}",
        f"policy.fused_head_loss={str(variant != 'rlscale_compile_unfused').lower()}",
        "policy.scheduler.warmup_steps=0",
    ]
    cfg = load_config(None, overrides)
    worker = PolicyWorker(cfg)
    out: dict = {"micro_batch_tokens": micro_tokens,
                 "attention_backend": getattr(worker.model.get_decoder().layers[0].self_attn,
                                              "_rlscale_attention_backend", None)}
    if check_against_hf:
        out["max_abs_logprob_diff_vs_hf"] = logprob_agreement(worker, batch)
    tokens = float(batch.response_mask.sum())
    try:
        timing = _timed(lambda: worker.train([batch], [tokens], samples, samples), device, warmup, reps)
        started = time.perf_counter()
        worker.compute_logprobs(batch)
        sync(device)
        out["logprob_pass_s"] = time.perf_counter() - started  # no-grad pass (pi_old, reference), warm
        out["logprob_pass_tokens_per_s"] = float(batch.attention_mask.sum()) / out["logprob_pass_s"]
        return {**out, **timing}
    finally:
        del worker


def logprob_agreement(worker, batch) -> float:
    """Largest |packed logprob - padded HF logprob| over the batch's response tokens, same weights."""
    import torch

    from rlscale.grpo.loss import token_logprobs_and_entropy

    packed = worker.compute_logprobs(batch)
    model = worker.model
    worst = 0.0
    with torch.no_grad():
        for start in range(0, len(batch), 8):
            part = batch.slice(start, start + 8)
            on_device = part.to(worker.device)
            logits = model(input_ids=on_device.input_ids, attention_mask=on_device.attention_mask).logits
            lp, _ = token_logprobs_and_entropy(logits[:, :-1], on_device.input_ids[:, 1:])
            mask = part.response_mask.bool()
            width = mask.shape[1]
            diff = (lp.cpu() - packed[start:start + 8, :width])[mask]
            worst = max(worst, float(diff.abs().max()) if diff.numel() else 0.0)
    return worst


def run_benchmark(models: list[str], variants: list[str], batches: list[tuple[int, int]], prompt_len: int,
                  micro_tokens: int, hf_micro: int, warmup: int, reps: int, ragged: bool, device_name: str,
                  json_file: Path | None, echo=print) -> dict:
    import torch
    import transformers

    from rlscale.bench.scale import QWEN2_SHAPES, build_random_model
    from rlscale.models import pick_device, pick_dtype

    device = pick_device(device_name)
    dtype = pick_dtype("auto", device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = peak_tflops(gpu) if device.type == "cuda" else None
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": gpu, "torch": torch.__version__,
           "transformers": transformers.__version__, "dtype": str(dtype).removeprefix("torch."),
           "peak_tflops": peak, "peak_table_tflops": dict(PEAK_TFLOPS),
           "flops_formula": "6*(P_layers*T + V*d*R) + 6*L*H*d_head*sum(s^2); mfu_6nt: 6*N_params*T",
           "warmup": warmup, "reps": reps, "results": []}

    def save():
        write_result(out, json_file)

    for name in models:
        shape = {"tie_word_embeddings": True, **QWEN2_SHAPES[name]}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                model_dir = build_random_model(name, Path(tmp) / name)
            except Exception as exc:  # noqa: BLE001 - recorded, the next model still runs
                out["results"].append({"model": name, "error": f"building the model: {exc!r}"})
                save()
                continue
            n_params = _count_params(shape)
            for samples, seq_len in batches:
                batch = synthetic_batch(samples, seq_len, prompt_len, shape["vocab_size"], ragged)
                lengths = batch.attention_mask.sum(1).tolist()
                tokens, response = sum(lengths), int(batch.response_mask.sum())
                flops = update_flops(shape, lengths, response)
                for variant in variants:
                    row = {"model": name, "variant": variant, "samples": samples, "seq_len": seq_len,
                           "tokens": tokens, "response_tokens": response, "padded_tokens": samples * max(lengths),
                           "flops_per_update": flops, "params": n_params}
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    try:
                        if variant.startswith("hf_"):
                            row.update(run_hf(model_dir, variant, batch, hf_micro, device, dtype, warmup, reps))
                        else:
                            row.update(run_rlscale(model_dir, variant, batch, micro_tokens, device, warmup, reps,
                                                   seq_len, check_against_hf=variant == "rlscale"))
                        seconds = row["median_update_s"]
                        # the first update's excess over a warm one: compilation, allocator and kernel warm-up
                        row["first_update_overhead_s"] = row["first_update_s"] - seconds
                        row["tokens_per_s"] = tokens / seconds
                        row["achieved_tflops"] = flops / seconds / 1e12
                        row["mfu"] = row["achieved_tflops"] / peak if peak else None
                        row["mfu_6nt"] = 6 * n_params * tokens / seconds / 1e12 / peak if peak else None
                        row["peak_memory_gb"] = _memory_gb(device)
                    except Exception as exc:  # noqa: BLE001 - recorded, the next variant still runs
                        row["error"] = f"{exc!r}"
                        row["traceback"] = traceback.format_exc()[-4000:]
                    out["results"].append(row)
                    save()
                    echo(format_row(row))
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    _add_speedups(out["results"])
    save()
    return out


def _count_params(shape: dict) -> int:
    d, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head_dim = shape.get("head_dim", d // shape["num_attention_heads"])
    biases = layers * head_dim * (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    norms = (2 * layers + 1) * d
    heads = 1 if shape.get("tie_word_embeddings", True) else 2
    return layer_params(shape) + biases + norms + heads * shape["vocab_size"] * d


def _add_speedups(rows: list[dict]) -> None:
    """tokens/s of each variant over hf_sdpa's on the same model and batch."""
    base = {(r["model"], r["samples"], r["seq_len"]): r["tokens_per_s"]
            for r in rows if r.get("variant") == "hf_sdpa" and "tokens_per_s" in r}
    for r in rows:
        key = (r.get("model"), r.get("samples"), r.get("seq_len"))
        if key in base and "tokens_per_s" in r:
            r["speedup_vs_hf_sdpa"] = r["tokens_per_s"] / base[key]


def format_row(row: dict) -> str:
    where = f"{row['model']:11s} {row.get('variant', '-'):16s} {row.get('samples', 0):4d}×{row.get('seq_len', 0):<5d}"
    if "error" in row:
        return f"{where} ERROR {row['error'][:200]}"
    mfu = f"{100 * row['mfu']:5.1f}%" if row.get("mfu") is not None else "    -"
    return (f"{where} {row['median_update_s'] * 1e3:9.1f} ms  {row['tokens_per_s']:10.0f} tok/s  MFU {mfu}"
            f"  first update +{row['first_update_overhead_s']:.1f} s")


def format_table(out: dict) -> str:
    head = f"{out['device']}  torch {out['torch']}  peak {out['peak_tflops']} TFLOP/s bf16"
    lines = [head, "model       variant          batch       update        tokens/s       MFU"]
    lines += [format_row(r) for r in out["results"]]
    return "\n".join(lines)
