"""TRL's half of `rlscale bench step`, run as its own process: python -m rlscale.bench.trl_grpo ...

GRPOTrainer with its default (transformers `generate`) generation, set up like the rlscale half:
per_device_train_batch_size × gradient_accumulation_steps = 32 prompts × 8 samples, so
steps_per_generation (= gradient_accumulation_steps) makes one generation batch of 256 samples
per optimizer step, num_iterations=1 (so TRL computes no separate old log-probs), beta=0 (no
reference model). The split is timed by wrapping the trainer's own methods, with a CUDA
synchronize at each boundary: generate (_generate_single_turn), logprobs (no-grad calls of
_get_per_token_logps_and_entropies), reward (_calculate_rewards), other (the rest of
_prepare_inputs: decoding, tokenizing, advantages), train (the rest of the step: forward,
backward, optimizer). The JSON is rewritten after every step, so a crash keeps the steps before it.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections import defaultdict
from pathlib import Path

import yaml

from rlscale.bench import write_result


def parity_reward(completions, **kwargs) -> list[float]:
    from rlscale.bench.rewards import parity

    return [parity(c if isinstance(c, str) else str(c), "") for c in completions]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--set", action="append", default=[], help="GRPOConfig field=value (YAML scalar), repeatable")
    args = p.parse_args(argv)
    result: dict = {"status": "starting", "per_step": []}

    def write() -> None:
        write_result(result, args.json)

    try:
        import trl  # noqa: F401
    except ImportError as exc:
        result.update(status="trl not installed", error=str(exc))
        write()
        return 0
    try:
        return run(args, result, write)
    except Exception as exc:  # noqa: BLE001 - report, whatever it is
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-6000:])
        write()
        return 1


def run(args, result: dict, write) -> int:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlscale.bench.step import GENERATIONS, KL_BETA, LEARNING_RATE, NEW_TOKENS, PROMPTS, bench_prompts

    cuda = torch.cuda.is_available()
    if not cuda:  # the thread count rlscale's worker takes on CPU (policy.cpu_threads unset), for a like run
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    samples = PROMPTS * GENERATIONS
    mbs = args.micro_batch_size
    if samples % mbs:
        raise ValueError(f"--micro-batch-size {mbs} must divide {samples}")
    settings = dict(
        output_dir=str(args.output_dir), per_device_train_batch_size=mbs, gradient_accumulation_steps=samples // mbs,
        num_generations=GENERATIONS, num_iterations=1, max_completion_length=NEW_TOKENS, temperature=1.0,
        top_p=1.0, top_k=0, beta=KL_BETA, learning_rate=LEARNING_RATE, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", seed=42, shuffle_dataset=False, gradient_checkpointing=False,
        bf16=cuda, use_cpu=not cuda, dataloader_num_workers=0, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
    )
    for item in args.set:
        key, _, raw = item.partition("=")
        settings[key.strip()] = yaml.safe_load(raw)
    config = GRPOConfig(**settings)
    result["trl_version"] = trl.__version__
    result["settings"] = {k: v for k, v in settings.items() if k != "output_dir"}
    result["settings"].update(steps_per_generation=config.steps_per_generation,
                              generation_batch_size=config.generation_batch_size, loss_type=config.loss_type,
                              scale_rewards=config.scale_rewards, generation="transformers generate (TRL default)")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    dataset = Dataset.from_dict({"prompt": bench_prompts(args.steps)})

    totals: dict[str, float] = defaultdict(float)

    def timed(name, fn, *a, **k):
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            sync()
            totals[name] += time.perf_counter() - t0

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            return timed("generate", super()._generate_single_turn, *a, **k)

        def _get_per_token_logps_and_entropies(self, *a, **k):
            if torch.is_grad_enabled():  # the training forward: part of train
                return super()._get_per_token_logps_and_entropies(*a, **k)
            return timed("logprobs", super()._get_per_token_logps_and_entropies, *a, **k)

        def _calculate_rewards(self, *a, **k):
            return timed("reward", super()._calculate_rewards, *a, **k)

        def _prepare_inputs(self, *a, **k):
            return timed("prepare", super()._prepare_inputs, *a, **k)

        def _generate_and_score_completions(self, *a, **k):
            out = super()._generate_and_score_completions(*a, **k)
            mask = out.get("completion_mask")
            if mask is not None:
                lengths.append(float(mask.sum(dim=1).float().mean()))
            return out

    lengths: list[float] = []
    logged: list[dict] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            sync()
            self.last = time.perf_counter()
            self.seen = dict(totals)

        def on_log(self, _args, state, control, logs=None, **k):
            if logs:
                logged.append({key: v for key, v in logs.items() if isinstance(v, (int, float))})

        def on_step_end(self, _args, state, control, **k):
            sync()
            now = time.perf_counter()
            delta = {name: totals[name] - self.seen.get(name, 0.0) for name in ("generate", "logprobs", "reward",
                                                                                "prepare")}
            step_s = now - self.last
            self.last, self.seen = now, dict(totals)
            row = {"step": state.global_step, "step_s": step_s, "generate_s": delta["generate"],
                   "logprobs_s": delta["logprobs"], "reward_s": delta["reward"],
                   "other_s": delta["prepare"] - delta["generate"] - delta["logprobs"] - delta["reward"],
                   "train_s": step_s - delta["prepare"], "checkpoint_s": 0.0,
                   "response_length_mean": lengths[-1] if lengths else None}
            result["per_step"].append(row)
            result["status"] = "running"
            write()

    trainer = TimedGRPOTrainer(model=str(args.model_dir), reward_funcs=parity_reward, args=config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    for row, log in zip(result["per_step"], [entry for entry in logged if "loss" in entry]):
        row["loss"], row["grad_norm"] = log.get("loss"), log.get("grad_norm")
    result["status"] = "ok"
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
