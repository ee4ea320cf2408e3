"""The loss variants of rlscale.grpo.loss (KL estimators, aggregation, GSPO, the sampler/trainer
correction) against hand-computed values, their keys' checks, and their wiring in the worker."""

from __future__ import annotations

import math
import types

import pytest
import torch

from rlscale.config import Config, LossConfig
from rlscale.grpo.loss import grpo_token_loss, importance_weights, kl_estimate, loss_weights, masked_sequence_mean

LOG = math.log


def close(tensor: torch.Tensor, expected) -> bool:
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype))
    return True


# ---------------------------------------------------------------- KL estimators

def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([LOG(0.5)]), torch.tensor([LOG(0.25)])  # r = log(ref / p) = -log 2
    r = -LOG(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-r)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(r * r / 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - r - 1)
    assert kl_estimate(logp, logp, "k3").item() == 0.0  # no divergence


def test_kl_clamps_are_nemo_rls():
    logp, ref = torch.tensor([0.0, 0.0]), torch.tensor([-3.0, 3.0])  # r = -3, 3
    # input clamp to [-2, 2] first
    assert kl_estimate(logp, ref, "k3", input_clamp=2.0).tolist() == pytest.approx(
        [math.exp(-2) + 2 - 1, math.exp(2) - 2 - 1])
    assert kl_estimate(logp, ref, "k1", input_clamp=2.0).tolist() == pytest.approx([2.0, -2.0])
    # output clamp to [-c, c] after: k1 may be negative, so both sides
    assert kl_estimate(logp, ref, "k1", output_clamp=1.0).tolist() == pytest.approx([1.0, -1.0])
    assert kl_estimate(logp, ref, "k3", output_clamp=1.0).tolist() == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="kl_type"):
        kl_estimate(logp, ref, "k4")


def _old_grpo_token_loss(logprobs, old_logprobs, advantages, ref_logprobs, clip_low, clip_high, kl_beta):
    """The loss as it was before the variants (a copy): the defaults must stay it, bit for bit."""
    advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return -torch.minimum(unclipped, clipped) + kl_beta * kl, kl


def test_the_defaults_are_the_old_loss_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    logp, old, ref = (torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.3 - 2 for _ in range(3))
    adv = torch.randn(4, generator=gen, dtype=torch.float64)
    logp.requires_grad_()
    new = grpo_token_loss(logp, old, adv, ref, 0.2, 0.28, 0.05)
    (grad_new,) = torch.autograd.grad(new.loss.sum(), logp)
    old_loss, old_kl = _old_grpo_token_loss(logp, old, adv, ref, 0.2, 0.28, 0.05)
    (grad_old,) = torch.autograd.grad(old_loss.sum(), logp)
    assert torch.equal(new.loss, old_loss) and torch.equal(new.kl, old_kl) and torch.equal(grad_new, grad_old)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_the_kl_type_reaches_the_loss(kl_type):
    logp, ref = torch.tensor([[LOG(0.5)]]), torch.tensor([[LOG(0.25)]])
    terms = grpo_token_loss(logp, logp, torch.tensor([0.0]), ref, kl_beta=0.1, kl_type=kl_type)
    assert terms.loss.item() == pytest.approx(0.1 * kl_estimate(logp, ref, kl_type).item())


# ---------------------------------------------------------------- aggregation

def test_loss_weights_by_hand():
    lengths = torch.tensor([2.0, 4.0])
    assert loss_weights("token-mean", lengths, 6.0, 2.0).tolist() == pytest.approx([1 / 6, 1 / 6])
    assert loss_weights("seq-mean-token-mean", lengths, 6.0, 2.0).tolist() == pytest.approx([1 / 4, 1 / 8])
    # Dr. GRPO: the constant 8 for every sequence, whatever its length
    assert loss_weights("seq-mean-token-sum-norm", lengths, 6.0, 2.0, 8.0).tolist() == pytest.approx([1 / 16, 1 / 16])
    with pytest.raises(ValueError):
        loss_weights("seq-mean-token-sum-norm", lengths, 6.0, 2.0, None)


def test_dr_grpo_is_trls_formula():
    """TRL's loss_type="dr_grpo": (loss * mask).sum() / (batch * max_completion_length)."""
    gen = torch.Generator().manual_seed(1)
    per_token = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    weights = loss_weights("seq-mean-token-sum-norm", mask.sum(1), mask.sum().item(), 3.0, 8.0)
    ours = (per_token * mask * weights[:, None]).sum()
    assert ours.item() == pytest.approx(((per_token * mask).sum() / (3 * 8)).item())
    # and the two older modes are TRL's "dapo"-like token mean and its "grpo" sequence mean
    token = (per_token * mask * loss_weights("token-mean", mask.sum(1), mask.sum().item(), 3.0)[:, None]).sum()
    assert token.item() == pytest.approx(((per_token * mask).sum() / mask.sum()).item())
    seq = (per_token * mask * loss_weights("seq-mean-token-mean", mask.sum(1), 0.0, 3.0)[:, None]).sum()
    assert seq.item() == pytest.approx((((per_token * mask).sum(1) / mask.sum(1)).mean()).item())


# ---------------------------------------------------------------- GSPO

def test_gspo_ratio_is_the_sequences_and_clipped_as_a_whole():
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    logp = torch.tensor([[0.1, 0.3, 5.0], [-0.01, 0.0, 0.01]], requires_grad=True)  # 5.0 is padding
    adv = torch.tensor([1.0, 1.0])
    terms = grpo_token_loss(logp, old, adv, sequence_level=True, mask=mask, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(0.2)  # the mean of 0.1 and 0.3; the padding does not count
    assert terms.ratio[0].tolist() == pytest.approx([s0] * 3)
    assert terms.ratio[1].tolist() == pytest.approx([1.0] * 3)
    # row 0 is above 1.2 with a positive advantage: clipped, -1.2 on each token, no gradient
    assert terms.loss[0].tolist() == pytest.approx([-1.2] * 3) and terms.clipped[0].tolist() == [1.0] * 3
    agg = (terms.loss * mask * loss_weights("seq-mean-token-mean", mask.sum(1), 0, 2.0)[:, None]).sum()
    (grad,) = torch.autograd.grad(agg, logp)
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0])
    # row 1: s = 1, unclipped: d(-A s) / d logp_t = -A s / n over the 3 tokens, then / 2 sequences
    assert grad[1].tolist() == pytest.approx([-1 / 3 / 2] * 3)


def test_gspo_negative_advantage_keeps_the_larger_ratio():
    old, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    logp = torch.tensor([[0.1, 0.3, 0.0]], requires_grad=True)
    terms = grpo_token_loss(logp, old, torch.tensor([-1.0]), sequence_level=True, mask=mask)
    s = math.exp(0.2)
    assert terms.loss[0, :2].tolist() == pytest.approx([s, s]) and terms.clipped.sum() == 0
    (grad,) = torch.autograd.grad(masked_sequence_mean(terms.loss, mask).sum(), logp)
    assert grad[0].tolist() == pytest.approx([s / 2, s / 2, 0.0])


def test_gspo_on_policy_has_grpos_sequence_mean_gradient():
    """At ratio 1 (one update per rollout) GSPO's gradient is GRPO's with a per-sequence mean."""
    gen = torch.Generator().manual_seed(2)
    logp = (torch.randn(3, 4, generator=gen) - 2).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -2.0, 0.5])
    w = loss_weights("seq-mean-token-mean", mask.sum(1), 0, 3.0)[:, None] * mask
    gspo = grpo_token_loss(logp, logp.detach(), adv, sequence_level=True, mask=mask)
    grpo = grpo_token_loss(logp, logp.detach(), adv)
    (g1,) = torch.autograd.grad((gspo.loss * w).sum(), logp)
    (g2,) = torch.autograd.grad((grpo.loss * w).sum(), logp)
    torch.testing.assert_close(g1, g2)


def test_gspo_needs_the_mask():
    with pytest.raises(ValueError, match="mask"):
        grpo_token_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), sequence_level=True)


def test_an_empty_response_has_ratio_one():
    terms = grpo_token_loss(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1), sequence_level=True,
                            mask=torch.zeros(1, 2))
    assert terms.ratio.tolist() == [[1.0, 1.0]]


# ---------------------------------------------------------------- sampler/trainer correction

OLD = torch.tensor([[LOG(2), LOG(0.5)], [LOG(4), LOG(4)]])
GEN = torch.zeros(2, 2)
MASK = torch.ones(2, 2)


def test_plain_importance_weights():
    out = importance_weights(OLD, GEN, MASK)
    assert close(out.weights, [[2, 0.5], [4, 4]]) and out.kept.tolist() == [[1, 1], [1, 1]]


def test_tis_clamps_above():
    out = importance_weights(OLD, GEN, MASK, "tis", ratio_max=3.0)
    assert close(out.weights, [[2, 0.5], [3, 3]])
    assert close(out.raw, [[2, 0.5], [4, 4]]) and out.kept.tolist() == [[1, 1], [0, 0]]


def test_icepop_zeroes_tokens_outside_the_bounds():
    out = importance_weights(OLD, GEN, MASK, "icepop", ratio_max=3.0, ratio_min=0.6)
    assert close(out.weights, [[2, 0], [0, 0]]) and out.kept.tolist() == [[1, 0], [0, 0]]


def test_seq_mask_tis_zeroes_whole_sequences_by_geometric_mean():
    # row 0: geometric mean of 2 and 0.5 = 1, kept with its raw token weights; row 1: 4, masked
    out = importance_weights(OLD, GEN, MASK, "seq-mask-tis", ratio_max=2.0, ratio_min=0.5)
    assert close(out.weights, [[2, 0.5], [0, 0]]) and out.kept.tolist() == [[1, 1], [0, 0]]
    # padding does not count in the mean: row 1 with only its first token would still be 4
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert importance_weights(OLD, GEN, mask, "seq-mask-tis", 2.0, 0.5).kept[1].tolist() == [0, 0]


def test_sequence_level_weight_is_exp_of_the_sum():
    out = importance_weights(OLD, GEN, torch.tensor([[1.0, 1.0], [1.0, 0.0]]), sequence_level=True)
    assert close(out.weights, [[1.0], [4.0]])  # 2 * 0.5; 4 (the padding left out)


def test_non_finite_weights_become_zero():
    out = importance_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-math.inf, math.nan]]))
    assert out.weights.tolist() == [[0.0, 0.0]]


def test_importance_weights_multiply_the_policy_term_not_the_kl():
    logp, ref = torch.zeros(1, 2, requires_grad=True), torch.full((1, 2), -1.0)
    w = torch.tensor([[2.0, 0.0]])
    terms = grpo_token_loss(logp, logp.detach(), torch.tensor([1.0]), ref, kl_beta=0.5, is_weights=w)
    kl = math.exp(-1) + 1 - 1
    assert terms.loss[0].tolist() == pytest.approx([-2.0 + 0.5 * kl, 0.0 + 0.5 * kl])
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    k3_grad = -(math.exp(-1) - 1)  # d/dlogp of exp(ref - logp) - (ref - logp) - 1 at logp 0
    assert grad[0].tolist() == pytest.approx([-2.0 + 0.5 * k3_grad, 0.5 * k3_grad])


def test_the_weights_carry_no_gradient():
    old = torch.zeros(1, 2, requires_grad=True)
    assert not importance_weights(old, torch.zeros(1, 2)).weights.requires_grad


# ---------------------------------------------------------------- the keys

@pytest.mark.parametrize("keys, message", [
    (dict(sequence_level_importance_ratios=True), "needs a mean per sequence"),
    (dict(sequence_level_importance_ratios=True, token_level_loss=False, sequence_ratio_clip_min=1.0),
     "sequence_ratio_clip_min=1 (GSPO's clip range) must be in (0, 1)"),
    (dict(sequence_level_importance_ratios=True, token_level_loss=False, sequence_ratio_clip_max=0.0),
     "sequence_ratio_clip_max=0 (GSPO's clip range) must be in (0, 1)"),
    (dict(sequence_level_importance_ratios=True, token_level_loss=False, ratio_clip_max=1.5),
     "sequence_ratio_clip_max=1.5"),
    (dict(sequence_ratio_clip_min=3e-4), "needs loss.sequence_level_importance_ratios=true"),
    (dict(loss_agg_mode="token-mean", token_level_loss=False), "disagree"),
    (dict(loss_agg_mode="seq-mean-token-sum-norm", token_level_loss=True), "set one of them"),
    (dict(loss_scale_factor=512.0), "only read by"),
    (dict(truncated_importance_sampling_ratio=2.0), "needs loss.use_importance_sampling_correction=true"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0), "_type"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis"), "ratio (the upper"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
          truncated_importance_sampling_type="icepop"), "ratio_min at most"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
          truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio_min=3.0),
     "ratio_min at most"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
          truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio_min=0.5), "not read by tis"),
    (dict(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=2.0,
          truncated_importance_sampling_ratio_min=0.5, truncated_importance_sampling_type="seq-mask-tis",
          sequence_level_importance_ratios=True, token_level_loss=False), "do not combine"),
    (dict(reference_policy_kl_type="k4"), "reference_policy_kl_type"),
    (dict(use_kl_in_reward=True, reference_policy_kl_penalty=0.0), "needs loss.reference_policy_kl_penalty > 0"),
])
def test_conflicting_loss_keys_are_refused(keys, message):
    with pytest.raises(ValueError) as caught:
        LossConfig(**keys)
    assert message in str(caught.value)


def test_the_good_combinations_pass():
    gspo = LossConfig(sequence_level_importance_ratios=True, token_level_loss=False,
                      sequence_ratio_clip_min=3e-4, sequence_ratio_clip_max=4e-4)
    assert gspo.sequence_clip == (3e-4, 4e-4) and gspo.aggregation == "seq-mean-token-mean" and gspo.whole_sequences
    assert LossConfig(loss_agg_mode="seq-mean-token-sum-norm").aggregation == "seq-mean-token-sum-norm"
    assert LossConfig(loss_agg_mode="seq-mean-token-mean").aggregation == "seq-mean-token-mean"
    assert LossConfig(token_level_loss=False, loss_agg_mode="seq-mean-token-mean").aggregation == "seq-mean-token-mean"
    assert LossConfig().aggregation == "token-mean" and not LossConfig().whole_sequences
    icepop = LossConfig(use_importance_sampling_correction=True, truncated_importance_sampling_type="icepop",
                        truncated_importance_sampling_ratio=5.0, truncated_importance_sampling_ratio_min=0.5)
    assert not icepop.whole_sequences


def test_importance_sampling_correction_needs_the_engine():
    with pytest.raises(ValueError, match="policy.generation.backend=hf does not return"):
        Config.model_validate({"loss": {"use_importance_sampling_correction": True},
                               "policy": {"generation": {"backend": "hf"}}})


@pytest.mark.parametrize("args, names", [
    (["loss.sequence_level_importance_ratios=true", "loss.token_level_loss=false",
      "loss.sequence_ratio_clip_max=1.5"], ["loss.sequence_ratio_clip_max=1.5", "(0, 1)"]),
    (["loss.use_importance_sampling_correction=true", "policy.generation.backend=hf"],
     ["loss.use_importance_sampling_correction", "backend=hf"]),
    (["loss_fn.truncated_importance_sampling_ratio=2.0"], ["use_importance_sampling_correction"]),
])
def test_bad_loss_keys_stop_a_dry_run_in_one_line(args, names, tmp_path):
    from tests.integration.helpers import run_cli

    result = run_cli("train", "--dry-run", *args, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlscale: error: "), result.stderr
    for name in names:
        assert name in lines[0], lines[0]


def test_nemo_rl_loss_fn_keys_map_to_the_variants():
    from rlscale.config_loading import load_config

    cfg = load_config(None, ["loss_fn.reference_policy_kl_type=k2", "loss_fn.kl_input_clamp_value=20",
                             "loss_fn.kl_output_clamp_value=10", "loss_fn.use_importance_sampling_correction=true",
                             "loss_fn.truncated_importance_sampling_ratio=5",
                             "loss_fn.truncated_importance_sampling_type=icepop",
                             "loss_fn.truncated_importance_sampling_ratio_min=0.5",
                             "loss_fn.sequence_level_importance_ratios=true", "loss_fn.token_level_loss=false"])
    loss = cfg.loss
    assert (loss.reference_policy_kl_type, loss.kl_input_clamp_value, loss.kl_output_clamp_value) == ("k2", 20, 10)
    assert loss.use_importance_sampling_correction and loss.truncated_importance_sampling_type == "icepop"
    assert (loss.truncated_importance_sampling_ratio, loss.truncated_importance_sampling_ratio_min) == (5, 0.5)
    assert loss.sequence_level_importance_ratios


# ---------------------------------------------------------------- in the worker

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


PROMPTS = [[2, 5, 6, 7], [2, 8, 9], [2, 5, 5, 5, 6], [2, 7]] * 4
RESPONSES = [[10, 11, 12], [13, 14, 15, 16, 17, 18], [19], [20, 21, 22, 23]] * 4
ADVANTAGES = [1.0, -0.5, 2.0, -1.5, 0.5, -1.0, 1.5, -2.0] * 2


def _train(tiny_dir, *overrides, steps=1, gen_logprobs=None, budget=32):
    """One GRPO step of 16 samples in `steps` optimizer steps: (stats, parameters after)."""
    from rlscale.config_loading import load_config
    from rlscale.workers.batch import build_train_batch
    from rlscale.workers.policy import PolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(None, [f"policy.model_name={tiny_dir}", "policy.device=cpu", "grpo.num_prompts_per_step=4",
                             "grpo.num_generations_per_prompt=4", f"policy.train_global_batch_size={16 // steps}",
                             "loss.reference_policy_kl_penalty=0", "policy.max_total_sequence_length=32",
                             "policy.generation.max_new_tokens=8", f"policy.train_micro_batch_tokens={budget}",
                             "policy.max_grad_norm=null", "policy.logprob_chunk_tokens=5", *overrides])
    worker = PolicyWorker(cfg)
    size = 16 // steps
    batches = [build_train_batch(PROMPTS[i:i + size], RESPONSES[i:i + size], ADVANTAGES[i:i + size], 0, 32,
                                 None if gen_logprobs is None else gen_logprobs[i:i + size])
               for i in range(0, 16, size)]
    tokens = [float(sum(map(len, RESPONSES[i:i + size]))) for i in range(0, 16, size)]
    stats = worker.train(batches, tokens, size, size)
    return stats, [p.detach().clone() for p in worker.model.parameters()], worker


def _same(a, b, same=True):
    close = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))
    assert close == same


GSPO = ["loss.sequence_level_importance_ratios=true", "loss.token_level_loss=false"]


def test_gspo_on_policy_updates_like_grpos_sequence_mean(tiny_dir):
    """One optimizer step: ratio 1, the same gradient (test_gspo_on_policy_has_grpos_sequence_mean_gradient),
    across several packs, with the fused head on (GSPO takes the unfused path)."""
    gspo, gspo_params, _ = _train(tiny_dir, *GSPO, "policy.fused_head_loss=true")
    grpo, grpo_params, _ = _train(tiny_dir, "loss.token_level_loss=false")
    assert gspo["grad_norm"] == pytest.approx(grpo["grad_norm"], rel=1e-5)
    _same(gspo_params, grpo_params)


def test_gspo_off_policy_is_not_grpo_and_does_not_depend_on_the_packing(tiny_dir):
    small, small_params, _ = _train(tiny_dir, *GSPO, "loss.sequence_ratio_clip_min=0.001",
                                    "loss.sequence_ratio_clip_max=0.001", steps=2, budget=32)
    large, large_params, _ = _train(tiny_dir, *GSPO, "loss.sequence_ratio_clip_min=0.001",
                                    "loss.sequence_ratio_clip_max=0.001", steps=2, budget=256)
    assert small["clip_fraction"] == pytest.approx(large["clip_fraction"]) and small["clip_fraction"] > 0
    _same(small_params, large_params)
    _, grpo_params, _ = _train(tiny_dir, "loss.token_level_loss=false", steps=2)
    _same(small_params, grpo_params, same=False)


def test_dr_grpo_scales_the_gradient_by_a_constant(tiny_dir):
    """seq-mean-token-sum-norm at 8 against token-mean: the same direction, |g| · tokens / (samples · 8)."""
    tokens = sum(map(len, RESPONSES))
    dr, _, _ = _train(tiny_dir, "loss.loss_agg_mode=seq-mean-token-sum-norm")
    dr16, _, _ = _train(tiny_dir, "loss.loss_agg_mode=seq-mean-token-sum-norm", "loss.loss_scale_factor=16")
    token, _, _ = _train(tiny_dir)
    assert dr["grad_norm"] == pytest.approx(token["grad_norm"] * tokens / (16 * 8), rel=1e-5)
    assert dr16["grad_norm"] == pytest.approx(dr["grad_norm"] / 2, rel=1e-5)


def _sampler_logprobs(shift: float):
    """Made-up sampler logprobs: log 0.1 - shift on every response token."""
    return [[LOG(0.1) - shift] * len(r) for r in RESPONSES]


def test_importance_correction_statistics_are_logged(tiny_dir):
    gen = _sampler_logprobs(0.0)
    stats, _, _ = _train(tiny_dir, "loss.use_importance_sampling_correction=true",
                         "loss.truncated_importance_sampling_ratio=2.0",
                         "loss.truncated_importance_sampling_type=tis", gen_logprobs=gen)
    # pi_old: the policy before the step (one optimizer step: the update's own forward), from a fresh worker
    from rlscale.config_loading import load_config
    from rlscale.workers.batch import build_train_batch
    from rlscale.workers.policy import PolicyWorker

    batch = build_train_batch(PROMPTS, RESPONSES, ADVANTAGES, 0, 32, gen)
    before = PolicyWorker(load_config(None, [
        f"policy.model_name={tiny_dir}", "policy.device=cpu", "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "policy.max_total_sequence_length=32",
        "policy.generation.max_new_tokens=8", "loss.reference_policy_kl_penalty=0"]))
    pi_old = before.compute_logprobs(batch)[batch.response_mask > 0]
    raw = torch.exp(pi_old - LOG(0.1))
    assert stats["is_ratio_mean"] == pytest.approx(raw.mean().item(), rel=1e-5)
    assert stats["is_weight_mean"] == pytest.approx(raw.clamp(max=2.0).mean().item(), rel=1e-5)
    assert stats["is_kept_fraction"] == pytest.approx((raw <= 2.0).float().mean().item(), rel=1e-5)
    assert stats["token_mult_prob_error"] > 1


def test_seq_mask_tis_keeping_everything_is_the_plain_correction(tiny_dir):
    """seq-mask-tis (the whole-sequence path) with bounds no sequence leaves = untruncated weights
    (the token path), the fused head on; and a correction of weight exactly 1 is no correction."""
    gen = _sampler_logprobs(0.3)
    wide, wide_params, _ = _train(tiny_dir, "loss.use_importance_sampling_correction=true",
                                  "loss.truncated_importance_sampling_ratio=1e9",
                                  "loss.truncated_importance_sampling_ratio_min=1e-9",
                                  "loss.truncated_importance_sampling_type=seq-mask-tis", "policy.fused_head_loss=true",
                                  gen_logprobs=gen)
    plain, plain_params, _ = _train(tiny_dir, "loss.use_importance_sampling_correction=true",
                                    "policy.fused_head_loss=true", gen_logprobs=gen)
    assert wide["is_kept_fraction"] == 1.0 and wide["is_ratio_mean"] == pytest.approx(plain["is_ratio_mean"])
    _same(wide_params, plain_params)
    off, off_params, _ = _train(tiny_dir, gen_logprobs=gen)
    _same(off_params, plain_params, same=False)


def test_seq_mask_tis_masking_everything_trains_nothing(tiny_dir):
    gen = _sampler_logprobs(0.0)
    stats, params, _ = _train(tiny_dir, "loss.use_importance_sampling_correction=true",
                              "loss.truncated_importance_sampling_ratio=1e9",
                              "loss.truncated_importance_sampling_ratio_min=1e8",
                              "loss.truncated_importance_sampling_type=seq-mask-tis", gen_logprobs=gen)
    assert stats["is_kept_fraction"] == 0.0 and stats["is_weight_mean"] == 0.0 and stats["grad_norm"] == 0.0


def test_importance_correction_without_sampler_logprobs_stops_in_one_line(tiny_dir):
    from rlscale.errors import UserError

    with pytest.raises(UserError, match="needs the sampler's logprobs"):
        _train(tiny_dir, "loss.use_importance_sampling_correction=true")


# ---------------------------------------------------------------- against TRL, where it is installed
# (TRL is not a dependency of rlscale: these run only where `pip install trl` was done.) TRL's
# GRPOTrainer._compute_loss is called unbound on a stub trainer, its logprob pass replaced by the
# tensor below, so that both losses see the same tensors.

class _Accelerator:
    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor, reduction="sum"):  # one process: the reduction of one tensor is itself
        return tensor


class _TRLStub:
    """The attributes of a GRPOTrainer that _compute_loss reads (TRL 0.19 to 1.16)."""

    def __init__(self, logps, loss_type, level, beta, eps_low, eps_high, max_len):
        from collections import defaultdict

        self._logps = logps
        self.loss_type, self.importance_sampling_level, self.beta = loss_type, level, beta
        self.epsilon_low, self.epsilon_high, self.max_completion_length = eps_low, eps_high, max_len
        self.num_iterations, self.top_entropy_quantile, self.current_gradient_accumulation_steps = 2, 1.0, 1
        self.use_vllm, self.vllm_importance_sampling_correction, self.use_liger_loss = False, False, False
        # TRL 1.x's options beyond plain GRPO, all off: OPSM, entropy bonus, router loss
        self.aux_loss_enabled, self.off_policy_mask_threshold, self._entropy_bonus_enabled = False, None, False
        self.use_adaptive_entropy, self.entropy_coef, self.router_aux_loss_coef = False, 0.0, 0.0
        self.accelerator = _Accelerator()
        self.model = types.SimpleNamespace(training=True)
        self.control = types.SimpleNamespace(should_evaluate=False)
        self._metrics = defaultdict(lambda: defaultdict(list))
        self.args = types.SimpleNamespace(delta=None, epsilon=eps_low, use_bias_correction_kl=False, steps_per_generation=1)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if "compute_aux_loss" in kwargs:  # TRL 1.x also returns an auxiliary loss
            return self._logps, torch.zeros_like(self._logps), None
        return self._logps, torch.zeros_like(self._logps)

    def _get_per_token_logps(self, *args, **kwargs):
        return self._logps


@pytest.mark.parametrize("loss_type, level, mode", [
    ("grpo", "token", "seq-mean-token-mean"), ("bnpo", "token", "token-mean"),
    ("dr_grpo", "token", "seq-mean-token-sum-norm"), ("grpo", "sequence", "seq-mean-token-mean"),
])
def test_loss_and_gradient_equal_trls(loss_type, level, mode):
    trl = pytest.importorskip("trl")
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    old = torch.randn(3, 5, generator=gen) * 0.5 - 2
    ref = torch.randn(3, 5, generator=gen) * 0.5 - 2
    adv = torch.tensor([1.0, -0.5, 2.0])
    beta, low, high, max_len = 0.04, 0.2, 0.28, 8
    ours_lp = (old + torch.randn(3, 5, generator=gen) * 0.3).requires_grad_()
    theirs_lp = ours_lp.detach().clone().requires_grad_()
    terms = grpo_token_loss(ours_lp, old, adv, ref, low, high, beta, sequence_level=level == "sequence", mask=mask)
    weights = loss_weights(mode, mask.sum(1), mask.sum().item(), 3.0, float(max_len))[:, None] * mask
    ours = (terms.loss * weights).sum()
    ours.backward()
    stub = _TRLStub(theirs_lp, loss_type, level, beta, low, high, max_len)
    inputs = {"prompt_ids": torch.ones(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
              "completion_ids": torch.ones(3, 5, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    theirs = trl.GRPOTrainer._compute_loss(stub, None, inputs)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad)


def _trls_importance_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions, where it
    is computed inline, so not callable alone): exp(old - sampling) per token, or of its sum per
    sequence in the sequence_* modes; *_truncate clamps it to [clip_min, clip_max], *_mask zeroes it
    outside. What its _compute_loss then multiplies the policy-gradient term by."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    return ratio.masked_fill((ratio < low) | (ratio > clip_max), 0.0)


@pytest.mark.parametrize("mode, kind, ratio_min, loss_type, level", [
    ("token_truncate", "tis", None, "bnpo", "token"),
    ("token_mask", "icepop", 0.8, "bnpo", "token"),
    ("token_mask", "icepop", 0.8, "grpo", "token"),
    ("sequence_truncate", "tis", None, "grpo", "sequence"),
])
def test_importance_sampling_correction_equals_trls(mode, kind, ratio_min, loss_type, level):
    """rlscale's weights (importance_weights) equal TRL's ratio, and the corrected loss and its
    gradient equal TRL's _compute_loss given that ratio (the correction multiplies the
    policy-gradient term, the KL is added after, in both)."""
    trl = pytest.importorskip("trl")
    gen = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    old = torch.randn(3, 5, generator=gen) * 0.5 - 2
    ref = torch.randn(3, 5, generator=gen) * 0.5 - 2
    sampling = old + torch.randn(3, 5, generator=gen) * 0.3  # the sampler's logprobs, off the trainer's
    adv = torch.tensor([1.0, -0.5, 2.0])
    beta, low, high, max_len, cap = 0.04, 0.2, 0.28, 8, 1.2
    sequence = level == "sequence"
    ours_is = importance_weights(old, sampling, mask, kind, cap, ratio_min, sequence_level=sequence)
    trls_is = _trls_importance_ratio(old, sampling, mask, mode, ratio_min, cap)
    if sequence:
        torch.testing.assert_close(ours_is.weights, trls_is)
    else:
        torch.testing.assert_close(ours_is.weights * mask, trls_is * mask)
    assert (ours_is.kept == 0).any()  # the bounds act on these values
    ours_lp = (old + torch.randn(3, 5, generator=gen) * 0.3).requires_grad_()
    theirs_lp = ours_lp.detach().clone().requires_grad_()
    terms = grpo_token_loss(ours_lp, old, adv, ref, low, high, beta, sequence_level=sequence, mask=mask,
                            is_weights=ours_is.weights)
    agg = "token-mean" if loss_type == "bnpo" else "seq-mean-token-mean"
    weights = loss_weights(agg, mask.sum(1), mask.sum().item(), 3.0, float(max_len))[:, None] * mask
    ours = (terms.loss * weights).sum()
    ours.backward()
    stub = _TRLStub(theirs_lp, loss_type, level, beta, low, high, max_len)
    stub.use_vllm = stub.vllm_importance_sampling_correction = True
    stub.vllm_importance_sampling_mode = mode
    inputs = {"prompt_ids": torch.ones(3, 2, dtype=torch.long), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
              "completion_ids": torch.ones(3, 5, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum(), "importance_sampling_ratio": trls_is,
              "sampling_per_token_logps": sampling}
    theirs = trl.GRPOTrainer._compute_loss(stub, None, inputs)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad)


# ---------------------------------------------------------------- KL in the reward


def test_kl_in_reward_by_hand():
    from rlscale.grpo.shaping import kl_penalized_rewards

    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    kl = torch.tensor([[2.0, 0.0], [0.1, 4.0]])
    assert torch.allclose(kl_penalized_rewards(rewards, kl, 0.05), torch.tensor([[0.9, 0.0], [0.495, 0.3]]))
    assert torch.equal(kl_penalized_rewards(rewards, kl, 0.0), rewards)
    with pytest.raises(ValueError, match="beta"):
        kl_penalized_rewards(rewards, kl, -1.0)
    assert LossConfig(use_kl_in_reward=True).kl_in_loss == 0.0 and LossConfig().kl_in_loss == 0.01


def test_sequence_kl_is_the_summed_estimate_of_the_sampling_policy_to_the_reference(tiny_dir):
    """After an update the policy has moved from the reference: each sample's sequence_kl equals
    kl_estimate (k2, with an output clamp) of its logprobs summed over its response."""
    from rlscale.workers.batch import build_train_batch

    kl = ["loss.reference_policy_kl_penalty=0.1", "loss.reference_policy_kl_type=k2",
          "loss.kl_output_clamp_value=0.5", "policy.optimizer.lr=1e-2"]
    _, _, worker = _train(tiny_dir, *kl)
    batch = build_train_batch(PROMPTS, RESPONSES, [0.0] * len(PROMPTS), 0, 32)
    pi, ref = worker.compute_logprobs(batch), worker.compute_logprobs(batch, reference=True)
    expected = (kl_estimate(pi, ref, "k2", None, 0.5) * batch.response_mask).sum(1)
    got = torch.tensor(worker.sequence_kl(batch), dtype=torch.float32)
    assert got.min() > 0  # the policy moved
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_with_kl_in_the_reward_the_loss_has_no_kl_term(tiny_dir):
    """Two optimizer steps (the second off the reference): KL in the reward trains as no KL penalty
    at all would (the advantages carry the KL instead), KL in the loss does not."""
    in_reward, in_reward_params, _ = _train(tiny_dir, "loss.reference_policy_kl_penalty=0.5",
                                            "loss.use_kl_in_reward=true", "policy.optimizer.lr=1e-2", steps=2)
    none, none_params, _ = _train(tiny_dir, "policy.optimizer.lr=1e-2", steps=2)
    _, in_loss_params, _ = _train(tiny_dir, "loss.reference_policy_kl_penalty=0.5", "policy.optimizer.lr=1e-2",
                                  steps=2)
    _same(in_reward_params, none_params)
    _same(in_reward_params, in_loss_params, same=False)
    assert in_reward["kl"] == 0.0 and in_reward["loss"] == none["loss"]
