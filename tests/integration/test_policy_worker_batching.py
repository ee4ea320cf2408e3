"""The policy worker's extra forward passes (pi_old, reference) respect the micro-batch size."""

from __future__ import annotations

import torch

from rlscale.config import derive_sizes, load_config
from rlscale.workers.batch import build_train_batch
from rlscale.workers.policy import PolicyWorker, SamplingParams


def test_old_and_reference_logprobs_are_computed_in_micro_batches(tiny_model):
    torch.set_num_threads(1)
    # 16 samples, 8 per optimizer step (so pi_old is recomputed), KL on (so the reference runs too)
    cfg = load_config(None, [f"policy.model_name={tiny_model}", "policy.device=cpu", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
                             "loss.reference_policy_kl_penalty=0.01"])
    assert derive_sizes(cfg).micro_batch_size == 8  # the auto rule; the controller may pass less
    worker = PolicyWorker(cfg)
    rollouts = worker.generate(["12+30="] * 16, SamplingParams(temperature=1.0, max_new_tokens=6))
    pad = worker.tokenizer.pad_token_id
    advantages = [(-1.0) ** i for i in range(16)]
    steps = [build_train_batch(rollouts.prompt_ids[i:i + 8], rollouts.response_ids[i:i + 8], advantages[i:i + 8],
                               pad, cfg.policy.max_total_sequence_length) for i in (0, 8)]
    tokens = [float(sum(len(r) for r in rollouts.response_ids[i:i + 8])) for i in (0, 8)]
    seen = {"policy": [], "reference": []}
    for name, model in (("policy", worker.model), ("reference", worker.reference)):
        model.register_forward_pre_hook(
            lambda module, args, kwargs, name=name: seen[name].append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    stats = worker.train(steps, tokens, 8, 2)
    assert seen["reference"] == [2] * 8  # 2 optimizer steps × 8 samples, 2 at a time
    assert seen["policy"] == [2] * 16  # pi_old for both steps, then the training passes
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
