"""The policy worker's passes (pi_old, reference, training) run in packed micro-batches sized by tokens."""

from __future__ import annotations

import torch

from rlscale.config import load_config
from rlscale.workers.batch import build_train_batch
from rlscale.workers.packing import plan_packs
from rlscale.workers.policy import PolicyWorker, SamplingParams


def test_old_and_reference_logprobs_are_computed_in_token_sized_micro_batches(tiny_model):
    torch.set_num_threads(1)
    budget = 40
    # 16 samples, 8 per optimizer step (so pi_old is recomputed), KL on (so the reference runs too)
    cfg = load_config(None, [f"policy.model_name={tiny_model}", "policy.device=cpu", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
                             "loss.reference_policy_kl_penalty=0.01", "policy.max_total_sequence_length=32",
                             "policy.generation.max_new_tokens=6", f"policy.train_micro_batch_tokens={budget}"])
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
            lambda module, args, kwargs, name=name: seen[name].append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True)
    stats = worker.train(steps, tokens, 8, 2)
    lengths = [[len(p) + len(r) for p, r in zip(rollouts.prompt_ids[i:i + 8], rollouts.response_ids[i:i + 8])]
               for i in (0, 8)]
    packs_per_step = [len(plan_packs(step_lengths, budget)) for step_lengths in lengths]
    assert min(packs_per_step) > 1  # the budget really splits a step
    assert all(shape[0] == 1 and shape[1] <= budget for shape in seen["reference"] + seen["policy"])
    assert sum(shape[1] for shape in seen["reference"]) == sum(map(sum, lengths))  # each sample once, no padding
    assert len(seen["reference"]) == sum(packs_per_step)
    assert len(seen["policy"]) == 2 * sum(packs_per_step)  # pi_old for both steps, then the training passes
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
