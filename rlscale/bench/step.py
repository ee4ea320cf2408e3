"""`rlscale bench step`: one full GRPO step, rlscale against TRL's GRPOTrainer, same GPU, same run.

Both halves train the same model dir (Qwen2 architecture, random weights, a byte-level BPE
tokenizer trained here) on the same prompts (rlscale's arithmetic stream, in the same order),
32 prompts × 8 samples, 256 new tokens at temperature 1, the same dependency-free reward
(rlscale.bench.rewards:parity), one optimizer step on all 256 samples per GRPO step, no reference
model (KL weight 0), no gradient checkpointing, bf16 on CUDA (float32 on CPU), no checkpoint saves.
The first step warms up and is left out of the medians.

rlscale runs as `rlscale train` in a subprocess (through rlscale.bench.scale.run_one); TRL runs in
a subprocess of its own (rlscale.bench.trl_grpo), so a crash or a missing TRL still lets the
rlscale half report. The JSON file is rewritten after each half.
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

from rlscale.bench import code_revision, write_result
from rlscale.bench.scale import QWEN2_SHAPES, run_one, save_random_qwen2
from rlscale.telemetry.torch_profile import sections_line

PROMPTS, GENERATIONS, NEW_TOKENS = 32, 8, 256
LEARNING_RATE = 1e-6  # TRL's default; the same for both (speed does not depend on it)
KL_BETA = 0.0  # TRL's default: no reference model in either half
BPE_MERGES_TARGET = 2048  # learned vocabulary of the BPE tokenizer (bytes + merges + specials)
SPECIALS = ["<pad>", "<eos>", "<unk>"]
REWARD = "rlscale.bench.rewards:parity"


def tokenizer_corpus(lines: int = 20000, seed: int = 0) -> list[str]:
    """Arithmetic text like the prompts and answers the models see (`47+38=85`), plus numbers."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(f"{a}{op}{b}={c}")
    return out


def build_bpe_model(shape: str, out_dir: Path) -> dict:
    """A Qwen2-architecture model dir with random weights and a byte-level BPE tokenizer.

    The model keeps its shape's embedding rows (151,936 for the Qwen2 shapes: the honest cost of
    the embedding and LM head). The BPE tokenizer learns up to BPE_MERGES_TARGET tokens; its
    vocabulary is then padded to exactly the model's rows with filler tokens (`<t123>`) that no
    merge produces, so text never encodes to them but every id the sampler can pick decodes.
    (A tokenizer smaller than the embedding lets an untrained model sample ids the tokenizer
    cannot map back, which is one way a second step can fail.) Returns what was built, for the JSON.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    params = {"tie_word_embeddings": True, **QWEN2_SHAPES[shape]}
    rows = params["vocab_size"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    target = min(BPE_MERGES_TARGET, rows)
    trainer = trainers.BpeTrainer(vocab_size=target, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    learned = core.get_vocab_size()
    if learned > rows:
        raise ValueError(f"{shape}: the BPE tokenizer learned {learned} tokens, more than the model's {rows} rows")
    spec = json.loads(core.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    filler = 0
    while next_id < rows:
        vocab[f"<t{filler}>"] = next_id
        next_id, filler = next_id + 1, filler + 1
    core = Tokenizer.from_str(json.dumps(spec))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    save_random_qwen2(params, tokenizer, out_dir)
    # Loaded back as the model type's tokenizer class (transformers 5 picks Qwen2Tokenizer from
    # config.json), which adds its default unk token unless one is named: every id must stay
    # below the embedding rows, or a padded or unknown id would index past them on the GPU.
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if len(reloaded) != rows or max(reloaded.all_special_ids) >= rows:
        raise ValueError(f"{shape}: the tokenizer has {len(reloaded)} ids, special ids "
                         f"{reloaded.all_special_ids}; the model has {rows} rows")
    return {"shape": shape, "model_vocab_rows": rows, "tokenizer": "byte-level BPE trained with `tokenizers` on "
            "arithmetic text", "bpe_learned_tokens": learned, "filler_tokens": rows - learned,
            "tokenizer_size": len(reloaded), "tokenizer_class": type(reloaded).__name__,
            "special_ids": {"pad": reloaded.pad_token_id, "eos": reloaded.eos_token_id, "unk": reloaded.unk_token_id},
            "note": "model keeps its shape's embedding rows; the tokenizer is padded to the same size with "
                    "filler tokens no text encodes to, so every sampled id decodes"}


def bench_prompts(steps: int) -> list[str]:
    """The prompt texts `rlscale train` draws for `steps` steps with the bench's settings, in order."""
    from rlscale.config_loading import load_config
    from rlscale.data.loader import PromptLoader
    from rlscale.data.presets import build_datasets

    cfg = load_config(None, ["data.arithmetic.num_val_problems=16"])
    datasets = build_datasets(cfg.data, cfg.grpo.seed)
    loader = PromptLoader(datasets.train, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
    return [p.text for _ in range(steps) for p in loader.next_batch(PROMPTS)]


def micro_batch_size() -> int:
    """rlscale's own default micro batch for 256 samples on one worker; TRL gets the same."""
    from rlscale.config import derive_sizes
    from rlscale.config_loading import load_config

    cfg = load_config(None, [f"grpo.num_prompts_per_step={PROMPTS}", f"grpo.num_generations_per_prompt={GENERATIONS}",
                             f"policy.train_global_batch_size={PROMPTS * GENERATIONS}",
                             f"policy.generation.max_new_tokens={NEW_TOKENS}", "policy.max_total_sequence_length=1024"])
    return derive_sizes(cfg).micro_batch_size


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def rlscale_overrides() -> list[str]:
    """What the rlscale half sets beyond bench scale's run (the settings both halves share)."""
    return ["cluster.backend=local", f"rewards.function={REWARD}", f"policy.optimizer.lr={LEARNING_RATE}",
            "policy.generation.temperature=1.0", f"loss.reference_policy_kl_penalty={KL_BETA}"]


def run_rlscale(model_dir: Path, steps: int, log_dir: Path, profile_step: int | None = None,
                extra: list[str] | None = None) -> dict:
    """The rlscale half; profile_step: that step is timed section by section (sections_ms) and
    left out of the medians; extra: config overrides after the bench's own."""
    summary = run_one(model_dir, 1, PROMPTS, GENERATIONS, NEW_TOKENS, steps, log_dir,
                      [*rlscale_overrides(), *(extra or [])], profile_step)
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step_s" in r]
    profiled = [r for r in rows if r.get("step") == profile_step]
    rows = [r for r in rows if r.get("step") != profile_step]
    per_step = [{"step_s": r["time/step_s"], "generate_s": r.get("time/generate_s"),
                 "logprobs_s": 0.0,  # one optimizer step, no reference: pi_old is the training forward itself
                 "reward_s": r.get("time/reward_s"), "train_s": r.get("time/train_s"),
                 "checkpoint_s": r.get("time/checkpoint_s", 0.0),
                 "response_length_mean": r.get("response/length_mean"),
                 "skipped_fraction": r.get("train/skipped_fraction")} for r in rows]
    return {"status": "ok", "steps_run": len(rows) + len(profiled), "per_step": per_step, **summarize(per_step),
            "micro_batch_size": micro_batch_size(), "rlscale_summary": summary,
            **({"profiled_step": profile_step, "sections_ms": summary.pop("sections_ms")} if profile_step else {})}


def summarize(per_step: list[dict]) -> dict:
    """Medians over the steps after the first (warm-up); with one step only, that step."""
    timed = per_step[1:] or per_step
    keys = ("step_s", "generate_s", "logprobs_s", "reward_s", "other_s", "train_s", "checkpoint_s",
            "response_length_mean")
    return {"steps_timed": len(timed), **{f"median_{k}": _median(timed, k) for k in keys}}


def run_trl(model_dir: Path, steps: int, work: Path, trl_set: list[str], out: Path | None = None) -> dict:
    """TRL's half in its own process: 'trl not installed' or its error still lets the bench report.

    The process rewrites `out` after every step, so a run cut short keeps the steps it finished."""
    out = out or work / "trl.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "rlscale.bench.trl_grpo", "--model-dir", str(model_dir), "--steps", str(steps),
           "--json", str(out), "--output-dir", str(work / "trl-out"), "--micro-batch-size", str(micro_batch_size())]
    for item in trl_set:
        cmd += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    result = json.loads(out.read_text()) if out.exists() else {}
    if done.returncode != 0 and result.get("status") != "trl not installed":
        # e.g. a CUDA device-side assert aborts the process: the steps it finished are kept
        result["status"] = "failed"
        result.setdefault("error", f"exit code {done.returncode} (see stderr_tail)")
        result["returncode"] = done.returncode
        result["stderr_tail"] = done.stderr[-4000:]
    if result.get("per_step"):
        result.update(summarize(result["per_step"]))
    result["wall_s"] = time.perf_counter() - started
    return result


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("rlscale", "torch", "transformers", "tokenizers", "trl", "accelerate", "datasets", "pyarrow"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_benchmark(shape: str, steps: int, json_file: Path | None, only: str | None = None,
                  trl_set: list[str] | None = None, echo=print, profile_step: int | None = None,
                  rlscale_set: list[str] | None = None) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "model": shape, "prompts_per_step": PROMPTS, "generations_per_prompt": GENERATIONS,
           "max_new_tokens": NEW_TOKENS, "steps": steps, "versions": versions(),
           "settings": {"temperature": 1.0, "top_p": 1.0, "top_k": None, "stop_on_eos": True,
                        "reward": REWARD, "kl_beta": KL_BETA, "reference_model": KL_BETA > 0, "learning_rate": LEARNING_RATE,
                        "optimizer_steps_per_grpo_step": 1, "dtype": "bfloat16" if cuda else "float32",
                        "gradient_checkpointing": False, "checkpoint_saves": "none in either half",
                        "median_over": "steps 2..N (step 1 warms up)",
                        "rlscale_set": rlscale_set or [], "trl_set": trl_set or []},
           "rlscale": None, "trl": None}

    def write() -> None:
        write_result(out, json_file)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / shape
        out["model_dir"] = build_bpe_model(shape, model_dir)
        write()
        if only in (None, "rlscale"):
            echo("rlscale: running `rlscale train` ...")
            try:
                out["rlscale"] = run_rlscale(model_dir, steps, work / "rlscale-run", profile_step, rlscale_set)
            except Exception as exc:  # noqa: BLE001 - the TRL half still runs and reports
                out["rlscale"] = {"status": "failed", "error": str(exc)[-4000:]}
            write()
        if only in (None, "trl"):
            echo("trl: running GRPOTrainer in a subprocess ...")
            steps_file = json_file.with_name(json_file.stem + ".trl-steps.json") if json_file else None
            out["trl"] = run_trl(model_dir, steps, work, trl_set or [], steps_file)
            write()
    r, t = out["rlscale"] or {}, out["trl"] or {}
    if r.get("median_step_s") and t.get("median_step_s"):
        out["speedup_rlscale_vs_trl"] = t["median_step_s"] / r["median_step_s"]
    write()
    return out


def run_pairs(shape: str, steps: int, pairs: int, json_file: Path | None, trl_set: list[str] | None = None,
              rlscale_set: list[str] | None = None, compare_set: list[str] | None = None, echo=print) -> dict:
    """`pairs` alternating runs on one model dir: rlscale, then TRL (a noisy baseline: the median of the
    pair ratios is the figure). compare_set: a second rlscale configuration run after each pair (say,
    plain bf16 master weights), reported as its step time over the first's, pair by pair."""
    import torch

    cuda = torch.cuda.is_available()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code_revision(),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "model": shape, "steps": steps,
           "prompts_per_step": PROMPTS, "generations_per_prompt": GENERATIONS, "max_new_tokens": NEW_TOKENS,
           "versions": versions(), "rlscale_set": rlscale_set or [], "trl_set": trl_set or [],
           "compare_set": compare_set, "median_over": "steps 2..N of each run (step 1 warms up)", "pairs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out["model_dir"] = build_bpe_model(shape, work / shape)
        for i in range(pairs):
            pair = {}
            runs = [("rlscale", rlscale_set), ("trl", None)] + ([("compare", compare_set)] if compare_set else [])
            for name, extra in runs:
                echo(f"pair {i + 1}/{pairs}: {name} ...")
                if name == "trl":
                    pair[name] = run_trl(work / shape, steps, work, trl_set or [])
                    continue
                try:
                    pair[name] = run_rlscale(work / shape, steps, work / f"run-{i}-{name}", extra=extra)
                except Exception as exc:  # noqa: BLE001 - the other runs still report
                    pair[name] = {"status": "failed", "error": str(exc)[-4000:]}
            r, t, c = (pair.get(k, {}).get("median_step_s") for k in ("rlscale", "trl", "compare"))
            pair["trl_over_rlscale"] = t / r if r and t else None
            pair["compare_over_rlscale"] = c / r if r and c else None
            out["pairs"].append(pair)
            write_result(out, json_file)
    for key in ("trl_over_rlscale", "compare_over_rlscale"):
        ratios = [p[key] for p in out["pairs"] if p[key] is not None]
        out[f"median_{key}"] = statistics.median(ratios) if ratios else None
    write_result(out, json_file)
    return out


def format_pairs(out: dict) -> str:
    lines = [f"{out['model']} on {out['device']}, {len(out['pairs'])} alternating pairs, step medians (s)",
             "pair  rlscale    trl  trl/rlscale" + ("  compare  compare/rlscale" if out.get("compare_set") else "")]
    for i, pair in enumerate(out["pairs"], 1):
        cells = [pair.get(k, {}).get("median_step_s") for k in ("rlscale", "trl")]
        cells.append(pair["trl_over_rlscale"])
        if out.get("compare_set"):
            cells += [pair.get("compare", {}).get("median_step_s"), pair["compare_over_rlscale"]]
        lines.append(f"{i:4d}  " + "  ".join(f"{c:7.3f}" if c is not None else f"{'-':>7s}" for c in cells))
    for key in ("trl_over_rlscale", "compare_over_rlscale"):
        if out.get(f"median_{key}") is not None:
            lines.append(f"median {key.replace('_over_', '/')}: {out[f'median_{key}']:.3f}")
    return "\n".join(lines)


def format_table(out: dict) -> str:
    lines = [f"{out['model']} on {out['device']}: {out['prompts_per_step']} prompts × {out['generations_per_prompt']} "
             f"samples, {out['max_new_tokens']} new tokens, medians of steps 2..{out['steps']}",
             "          step_s  generate_s  logprobs_s  reward_s  train_s  ckpt_s  resp_len  status"]
    for name in ("rlscale", "trl"):
        half = out.get(name) or {}
        if half.get("median_step_s") is None:
            lines.append(f"{name:8s}  {half.get('status', 'not run')}: {half.get('error', '')}".rstrip(": "))
            continue
        cells = [half.get(f"median_{k}") for k in ("step_s", "generate_s", "logprobs_s", "reward_s", "train_s",
                                                     "checkpoint_s", "response_length_mean")]
        text = "  ".join(f"{c:8.2f}" if isinstance(c, (int, float)) else f"{'-':>8s}" for c in cells)
        lines.append(f"{name:8s}  {text}  {half.get('status')}")
    if out.get("speedup_rlscale_vs_trl"):
        lines.append(f"TRL step / rlscale step: {out['speedup_rlscale_vs_trl']:.2f}x")
    for call, sections in ((out.get("rlscale") or {}).get("sections_ms") or {}).items():
        lines.append(f"rlscale step {out['rlscale']['profiled_step']}, {call} (ms): {sections_line(sections)}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rlscale.bench.step  (also: rlscale bench step)
    print(format_table(run_benchmark(os.environ.get("MODEL", "tiny"), 3, None)))
