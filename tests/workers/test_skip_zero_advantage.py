"""Samples with a zero advantage are left out of the update (loss.skip_zero_advantage): with no KL
term the weights, loss and gradient norm are those of training on every sample, and a step with
nothing to train still moves the weights by AdamW's momentum, as zero gradients would."""

import math

import pytest
import torch

from rlscale.config_loading import load_config
from rlscale.controller import train_on_rollouts
from rlscale.workers.batch import Rollouts
from rlscale.workers.group import LocalWorkerGroup
from rlscale.workers.policy import PolicyWorker

OVERRIDES = ["policy.train_micro_batch_tokens=32", "policy.max_total_sequence_length=32", "policy.cpu_threads=1",
             "loss.reference_policy_kl_penalty=0", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
             "policy.train_global_batch_size=8"]
TEXTS = [("12+7=", "19<eos>"), ("305+96=", "401<eos>"), ("8+8=", "16<eos>"), ("41+120=", "161<eos>"),
         ("7+5=", "12<eos>"), ("99+1=", "100<eos>"), ("3+4=", "7<eos>"), ("60+60=", "120<eos>")]
MIXED = [1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0]  # two groups of the four agree


def rollouts(tokenizer) -> Rollouts:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return Rollouts(prompt_ids=[encode(p) for p, _ in TEXTS], response_ids=[encode(r) for _, r in TEXTS],
                    texts=[r for _, r in TEXTS], truncated=[False] * len(TEXTS))


def weights(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in worker.model.named_parameters()}


def two_steps(skip: bool, kl: float = 0.0) -> tuple[list[dict], list[dict]]:
    """A mixed step, then one where every group agrees; metrics and weights after each."""
    torch.manual_seed(0)
    cfg = load_config(None, [*OVERRIDES[:3], f"loss.reference_policy_kl_penalty={kl}", *OVERRIDES[4:],
                             f"loss.skip_zero_advantage={str(skip).lower()}"])
    group = LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size, distributed_group=False))
    worker = group.workers[0]
    data = rollouts(worker.tokenizer)
    metrics, after = [], []
    for step, advantages in ((1, MIXED), (2, [0.0] * len(TEXTS))):
        metrics.append(train_on_rollouts(cfg, group, data, advantages, step, worker.tokenizer.pad_token_id))
        after.append(weights(worker))
    return metrics, after


@pytest.fixture(scope="module")
def trained_on_all():
    return two_steps(skip=False)


def test_skipping_changes_no_weight_loss_or_gradient_norm(trained_on_all):
    (full_1, full_2), full_weights = trained_on_all
    (skip_1, skip_2), skip_weights = two_steps(skip=True)
    assert (full_1["train/skipped_fraction"], skip_1["train/skipped_fraction"]) == (0.0, 0.5)
    assert skip_2["train/skipped_fraction"] == 1.0
    # the loss's normaliser still counts the skipped samples' tokens: same loss, same gradient
    assert skip_1["train/loss"] == pytest.approx(full_1["train/loss"], rel=1e-5, abs=1e-7)
    assert skip_1["train/grad_norm"] == pytest.approx(full_1["train/grad_norm"], rel=1e-5)
    assert skip_1["train/clip_fraction"] == full_1["train/clip_fraction"] == 0.0
    assert full_2["train/grad_norm"] == skip_2["train/grad_norm"] == 0.0
    # entropy: over the trained tokens; a step that trains nothing has none
    assert math.isfinite(skip_1["train/entropy"]) and skip_1["train/entropy"] > 0
    assert math.isnan(skip_2["train/entropy"]) and math.isfinite(full_2["train/entropy"])
    for step in range(2):
        for name, value in full_weights[step].items():
            # Adam's first step is ~lr * sign(g): float noise in a near-zero gradient may flip one
            torch.testing.assert_close(skip_weights[step][name], value, atol=5e-4, rtol=0, msg=name)
    moved = sum(bool((skip_weights[1][n] != skip_weights[0][n]).any()) for n in skip_weights[0])
    assert moved == len(skip_weights[0]), "the all-skipped step applies AdamW's momentum to every weight"


def test_with_a_kl_penalty_every_sample_is_trained():
    (first, second), _ = two_steps(skip=True, kl=0.05)
    assert first["train/skipped_fraction"] == second["train/skipped_fraction"] == 0.0
    assert math.isfinite(second["train/entropy"]) and second["train/grad_norm"] > 0  # the KL's gradient


def test_an_optimizer_step_that_trains_nothing_leaves_the_steps_entropy_finite():
    """Several optimizer steps per GRPO step, the second with every sample skipped: the entropy is
    the mean over the step's trained tokens (those of the first), not NaN."""
    from rlscale.workers.batch import build_train_batch

    def fresh_worker():
        torch.manual_seed(0)
        return PolicyWorker(load_config(None, OVERRIDES), distributed_group=False)

    def trained(worker, optimizer_steps: int) -> dict:
        data = rollouts(worker.tokenizer)
        pad = worker.tokenizer.pad_token_id
        first = build_train_batch(data.prompt_ids[:4], data.response_ids[:4], MIXED[:2] + [0.3, -0.3], pad, 32)
        tokens = float(sum(map(len, data.response_ids[:4])))
        if optimizer_steps == 1:
            return worker.train([first], [tokens], 4, 4, [tokens])
        nothing = build_train_batch([], [], [], pad, 32, None)
        return worker.train([first, nothing], [tokens, tokens], 4, 4, [tokens, 0.0])

    alone, with_empty = trained(fresh_worker(), 1), trained(fresh_worker(), 2)
    assert math.isfinite(with_empty["entropy"]) and with_empty["entropy"] == pytest.approx(alone["entropy"], rel=1e-6)
    # the other metrics stay the mean of the optimizer steps' means (the empty step's loss is 0)
    assert with_empty["loss"] == pytest.approx(alone["loss"] / 2, rel=1e-5, abs=1e-8)
