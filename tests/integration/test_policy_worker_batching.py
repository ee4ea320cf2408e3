"""The policy worker's passes (pi_old, reference, training) run in packed micro-batches sized by tokens."""

from __future__ import annotations

import pytest
import torch

from rlscale.config_loading import load_config
from rlscale.rollout.sampling import SamplingParams
from rlscale.workers.batch import build_train_batch
from rlscale.workers.packing import plan_packs
from rlscale.workers.policy import PolicyWorker


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


def _worker(tiny_model, budget: int, token_level: bool = True) -> PolicyWorker:
    cfg = load_config(None, [f"policy.model_name={tiny_model}", "policy.device=cpu", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=8",
                             "loss.reference_policy_kl_penalty=0", "policy.max_total_sequence_length=32",
                             "policy.generation.max_new_tokens=8", f"policy.train_micro_batch_tokens={budget}",
                             f"loss.token_level_loss={str(token_level).lower()}", "policy.max_grad_norm=null"])
    return PolicyWorker(cfg)


@pytest.mark.parametrize("token_level", [True, False])
def test_the_loss_means_the_same_whatever_the_token_budget(tiny_model, token_level):
    """One pack or many: every response token weighs 1/global tokens (or 1/length/samples)."""
    torch.set_num_threads(1)
    prompts = [[2, 5, 6, 7], [2, 8, 9], [2, 5, 5, 5, 6], [2, 7]] * 2
    responses = [[10, 11, 12], [13, 14, 15, 16, 17, 18], [19], [20, 21, 22, 23]] * 2
    advantages = [1.0, -0.5, 2.0, -1.5, 0.5, -1.0, 1.5, -2.0]
    batch = build_train_batch(prompts, responses, advantages, pad_id=0, max_length=32)
    total = float(sum(map(len, responses)))
    results = []
    for budget in (32, 256):
        worker = _worker(tiny_model, budget, token_level)
        stats = worker.train([batch], [total], 8, 8)
        results.append((stats, [p.detach().clone() for p in worker.model.parameters()]))
    # on-policy (ratio 1) the reported loss is -mean advantage over tokens (in both modes: the
    # metric is a token mean; the modes differ in the gradient's weights)
    expected = -sum(a * len(r) for a, r in zip(advantages, responses)) / total
    (small, small_params), (large, large_params) = results
    assert len(plan_packs([len(p) + len(r) for p, r in zip(prompts, responses)], 32)) > 1
    assert small["loss"] == pytest.approx(expected, abs=1e-6) and large["loss"] == pytest.approx(expected, abs=1e-6)
    assert small["grad_norm"] == pytest.approx(large["grad_norm"], rel=1e-5)
    for a, b in zip(small_params, large_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_head_loss_updates_exactly_like_the_loss_on_returned_logprobs(tiny_model):
    """policy.fused_head_loss moves the loss's gradient into the head's forward: same update."""
    torch.set_num_threads(1)
    prompts = [[2, 5, 6, 7], [2, 8, 9], [2, 5, 5, 5, 6], [2, 7]] * 4
    responses = [[10, 11, 12], [13, 14, 15, 16, 17, 18], [19], [20, 21, 22, 23]] * 4
    advantages = [1.0, -0.5, 2.0, -1.5, 0.5, -1.0, 1.5, -2.0] * 2
    # two optimizer steps (pi_old recomputed, so the second step's ratios move off 1), KL on
    steps = [build_train_batch(prompts[i:i + 8], responses[i:i + 8], advantages[i:i + 8], pad_id=0, max_length=32)
             for i in (0, 8)]
    tokens = [float(sum(map(len, responses[i:i + 8]))) for i in (0, 8)]
    results = []
    for fused in (False, True):
        cfg = load_config(None, [f"policy.model_name={tiny_model}", "policy.device=cpu",
                                 "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                                 "policy.train_global_batch_size=8", "loss.reference_policy_kl_penalty=0.05",
                                 "policy.max_total_sequence_length=32", "policy.train_micro_batch_tokens=32",
                                 "policy.logprob_chunk_tokens=5", f"policy.fused_head_loss={str(fused).lower()}"])
        worker = PolicyWorker(cfg)
        stats = worker.train(steps, tokens, 8, 8)
        results.append((stats, [p.detach().clone() for p in worker.model.parameters()]))
    (plain, plain_params), (fused, fused_params) = results
    assert plain["kl"] > 0 and plain["loss"] != 0
    assert fused == pytest.approx(plain, rel=1e-6, abs=1e-9)
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class _DeviceIndex(torch.Tensor):
    """An index that, like a CUDA tensor, cannot index a host tensor (this machine has no GPU)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and not isinstance(args[0], _DeviceIndex):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, _DeviceIndex) for i in index):
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("fused", [True, False])
def test_the_update_indexes_the_host_batch_with_host_indices(tiny_model, monkeypatch, fused):
    """A pack moved to the GPU has its rows/cols there; the batch's advantages, lengths and sampler
    logprobs stay on the host and must be indexed with the pack's host copy."""
    from rlscale.workers import packing

    torch.set_num_threads(1)
    to_device = packing.PackedMicroBatch.to

    def to(self, device):
        moved = to_device(self, device)
        moved.rows, moved.cols = moved.rows.as_subclass(_DeviceIndex), moved.cols.as_subclass(_DeviceIndex)
        return moved

    monkeypatch.setattr(packing.PackedMicroBatch, "to", to)
    cfg = load_config(None, [f"policy.model_name={tiny_model}", "policy.device=cpu", "grpo.num_prompts_per_step=2",
                             "grpo.num_generations_per_prompt=2", "policy.train_global_batch_size=4",
                             "policy.max_total_sequence_length=32", "loss.token_level_loss=false",
                             f"policy.fused_head_loss={str(fused).lower()}"])
    batch = build_train_batch([[2, 5, 6], [2, 8], [2, 5, 5], [2, 7]], [[10, 11], [12, 13, 14], [15], [16, 17]],
                              [1.0, -1.0, 0.5, -0.5], pad_id=0, max_length=32,
                              gen_logprobs=[[-1.0, -2.0], [-1.0, -1.5, -2.0], [-0.5], [-1.0, -1.0]])
    stats = PolicyWorker(cfg).train([batch], [8.0], 4, 4)
    assert stats["token_mult_prob_error"] > 1 and stats["loss"] != 0
