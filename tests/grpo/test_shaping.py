"""DAPO's overlong soft penalty and overlong filtering (rlscale/grpo/shaping.py): hand-computed
values, edge cases, the config keys (NeMo-RL's names), and one update where a truncated sample
gets no gradient."""

from __future__ import annotations

import pytest
import torch

from rlscale.config_loading import load_config
from rlscale.errors import UserError
from rlscale.grpo import group_advantages
from rlscale.grpo.shaping import in_loss, overlong_penalty

# ---------------------------------------------------------------- the penalty


def test_overlong_penalty_by_hand():
    # max 20, buffer 5: free up to 15 tokens, then -1/5 per token down to -1 at 20, and on beyond
    lengths = torch.tensor([0, 10, 15, 16, 18, 20, 22])
    assert torch.allclose(overlong_penalty(lengths, 20, 5, 1.0),
                          torch.tensor([0.0, 0.0, 0.0, -0.2, -0.6, -1.0, -1.4]))
    assert torch.allclose(overlong_penalty(lengths, 20, 5, 0.5),
                          torch.tensor([0.0, 0.0, 0.0, -0.1, -0.3, -0.5, -0.7]))
    assert torch.equal(overlong_penalty(lengths, 20, 5, 0.0), torch.zeros(7))  # -0.0 == 0.0
    # DAPO's published setting: 20480 tokens, a 4096-token buffer
    assert overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096, 1.0).tolist() == [0.0, -0.5, -1.0]
    # any shape in, the same shape out
    assert overlong_penalty(torch.tensor([[15, 20], [17, 3]]), 20, 5, 1.0).shape == (2, 2)


def test_overlong_penalty_rejects_a_bad_buffer_or_penalty():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([3]), 20, 0, 1.0)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([3]), 20, 5, -1.0)


def test_the_penalty_enters_the_baseline():
    # one group: rewards 1, 0, 1; the second response is 20 tokens long (-1) -> shaped 1, -1, 1
    rewards, lengths = torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[10, 20, 12]])
    shaped = rewards + overlong_penalty(lengths, 20, 5, 1.0)
    assert torch.equal(shaped, torch.tensor([[1.0, -1.0, 1.0]]))
    # group mean 1/3 (no std scaling): 2/3, -4/3, 2/3
    assert torch.allclose(group_advantages(shaped, leave_one_out=False, normalize=False),
                          torch.tensor([[2 / 3, -4 / 3, 2 / 3]]))
    # leave-one-out: baselines 0, 1, 0 -> 1, -2, 1
    assert torch.allclose(group_advantages(shaped, normalize=False), torch.tensor([[1.0, -2.0, 1.0]]))


def test_all_agree_groups_with_the_penalty():
    # every sample right and as long: the same penalty, still no signal
    same = torch.ones(1, 4) + overlong_penalty(torch.full((1, 4), 18), 20, 5, 1.0)
    assert torch.equal(group_advantages(same), torch.zeros(1, 4))
    # every sample right, lengths differ: the penalty alone ranks them (shorter is better)
    shaped = torch.ones(1, 4) + overlong_penalty(torch.tensor([[10, 16, 18, 20]]), 20, 5, 1.0)
    advantages = group_advantages(shaped, leave_one_out=False, normalize=False)
    assert torch.allclose(advantages, torch.tensor([[0.45, 0.25, -0.15, -0.55]]))  # shaped 1, 0.8, 0.4, 0: mean 0.55


def test_one_sample_groups_are_their_own_baseline():
    shaped = torch.tensor([[1.0], [0.0]]) + overlong_penalty(torch.tensor([[20], [16]]), 20, 5, 1.0)
    assert torch.allclose(shaped, torch.tensor([[0.0], [-0.2]]))
    assert torch.equal(group_advantages(shaped), torch.zeros(2, 1))


# ---------------------------------------------------------------- filtering


def test_in_loss():
    truncated = [False, True, False, True]
    assert in_loss(truncated, False) == [True] * 4
    assert in_loss(truncated, True) == [True, False, True, False]
    assert in_loss([True] * 3, True) == [False] * 3  # all truncated: nothing in the loss
    assert in_loss([True], True) == [False] and in_loss([], True) == []


def test_filtering_keeps_the_truncated_rewards_in_the_baseline():
    # rewards 1, 0, 0, 1, the third truncated: the advantages are those of all four samples;
    # filtering only takes the third out of the loss
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    advantages = group_advantages(rewards, normalize=False)[0]
    assert torch.allclose(advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))  # baselines 1/3, 2/3, 2/3, 1/3
    kept = in_loss([False, False, True, False], True)
    assert [a for a, k in zip(advantages.tolist(), kept) if k] == pytest.approx([2 / 3, -2 / 3, 2 / 3])


# ---------------------------------------------------------------- the keys


def one_line(overrides: list[str]) -> str:
    with pytest.raises(UserError) as caught:
        load_config(None, overrides)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_defaults_and_the_resolved_lengths():
    from rlscale.config import overlong_lengths

    cfg = load_config(None, [])
    assert cfg.grpo.overlong_filtering is False and cfg.grpo.reward_shaping.enabled is False
    assert overlong_lengths(cfg) == (16, 3)  # max_new_tokens, a fifth of it
    cfg = load_config(None, ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.max_response_length=40",
                             "grpo.reward_shaping.overlong_buffer_length=8"])
    assert overlong_lengths(cfg) == (40, 8)


def test_bad_settings_are_one_line():
    assert "grpo.reward_shaping.overlong_buffer_length=16 is not shorter than max_response_length=16" in \
        one_line(["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=16"])
    assert "needs grpo.reward_shaping.overlong_buffer_penalty" in \
        one_line(["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_penalty=null"])
    assert "grpo.overlong_filtering=true takes truncated samples out of the token-mean loss only" in \
        one_line(["grpo.overlong_filtering=true", "loss.token_level_loss=false"])
    assert "grpo.reward_shaping.overlong_buffer_penalty" in \
        one_line(["grpo.reward_shaping.overlong_buffer_penalty=-1"])
    # off, the shaping keys are not checked against the lengths (a NeMo-RL recipe's 64 and 4096)
    load_config(None, ["grpo.reward_shaping.overlong_buffer_length=64"])


def test_a_penalty_no_response_can_reach_is_said():
    from rlscale.config import config_notes

    cfg = load_config(None, ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.max_response_length=100"])
    assert any("no response is penalised" in note for note in config_notes(cfg))
    assert not any("penalised" in note for note in config_notes(load_config(None, ["grpo.reward_shaping.enabled=true"])))


def test_nemo_rl_keys_map_to_the_settings(tmp_path):
    recipe = tmp_path / "dapo.yaml"
    recipe.write_text("policy:\n  generation:\n    max_new_tokens: 24\n"
                      "grpo:\n  overlong_filtering: true\n  reward_shaping:\n    enabled: true\n"
                      "    overlong_buffer_length: 4\n    overlong_buffer_penalty: 0.5\n"
                      "    max_response_length: ${policy.generation.max_new_tokens}\n"
                      "    stop_properly_penalty_coef: null\n")
    cfg = load_config(recipe)
    shaping = cfg.grpo.reward_shaping
    assert cfg.grpo.overlong_filtering is True
    assert (shaping.enabled, shaping.overlong_buffer_length, shaping.overlong_buffer_penalty,
            shaping.max_response_length) == (True, 4, 0.5, 24)
    assert "config key 'grpo.reward_shaping.stop_properly_penalty_coef' (on the command line)" in \
        one_line(["grpo.reward_shaping.stop_properly_penalty_coef=0.5"])


def test_the_dapo_preset_passes_the_dry_run(tmp_path):
    from pathlib import Path

    import yaml

    from tests.integration.helpers import run_cli

    preset = Path(__file__).parents[2] / "examples" / "dapo.yaml"
    cfg = load_config(preset)
    assert (cfg.loss.ratio_clip_min, cfg.loss.ratio_clip_max, cfg.loss.reference_policy_kl_penalty) == (0.2, 0.28, 0)
    assert cfg.loss.token_level_loss and cfg.grpo.reward_shaping.enabled and not cfg.grpo.use_leave_one_out_baseline
    result = run_cli("train", "--dry-run", "--config", str(preset), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.output and "penalised" not in result.output
    printed = yaml.safe_load(result.stdout.partition("# derived sizes")[0])
    assert printed["grpo"]["reward_shaping"]["enabled"] is True and printed["loss"]["ratio_clip_max"] == 0.28


# ---------------------------------------------------------------- one update


TEXTS = [("12+7=", "19<eos>"), ("305+96=", "401<eos>"), ("8+8=", "16<eos>"), ("41+120=", "1611111")]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
CUT = [False, False, False, True]  # the last ran into max_new_tokens


def update(filtering: bool, samples: list[tuple[str, str]], advantages: list[float], truncated: list[bool],
           kl: float = 0.0):
    """One train_on_rollouts with the built-in tiny model: its metrics and the weights after."""
    from rlscale.controller import train_on_rollouts
    from rlscale.workers.batch import Rollouts
    from rlscale.workers.group import LocalWorkerGroup
    from rlscale.workers.policy import PolicyWorker

    torch.manual_seed(0)
    cfg = load_config(None, ["policy.train_micro_batch_tokens=32", "policy.max_total_sequence_length=32",
                             "policy.cpu_threads=1", f"loss.reference_policy_kl_penalty={kl}",
                             "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=4", f"grpo.overlong_filtering={str(filtering).lower()}"])
    group = LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size, distributed_group=False))
    worker = group.workers[0]
    encode = lambda text: worker.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    data = Rollouts(prompt_ids=[encode(p) for p, _ in samples], response_ids=[encode(r) for _, r in samples],
                    texts=[r for _, r in samples], truncated=truncated)
    metrics = train_on_rollouts(cfg, group, data, advantages, 1, worker.tokenizer.pad_token_id)
    return metrics, {name: p.detach().clone() for name, p in worker.model.named_parameters()}


def test_a_truncated_sample_gets_no_gradient_and_leaves_the_normaliser():
    """Under overlong filtering, what a truncated sample holds (its tokens, its advantage) changes
    nothing, and the update equals one without it."""
    filtered, weights = update(True, TEXTS, ADVANTAGES, CUT)
    assert filtered["grpo/overlong_filtered_fraction"] == 0.25
    assert filtered["train/skipped_fraction"] == 0.25
    # another truncated response, with another advantage: the same update, to the bit
    other, other_weights = update(True, TEXTS[:3] + [("41+120=", "9999999")], ADVANTAGES[:3] + [5.0], CUT)
    assert other["train/loss"] == filtered["train/loss"] and other["train/grad_norm"] == filtered["train/grad_norm"]
    for name, value in weights.items():
        assert torch.equal(other_weights[name], value), name
    # the same as training on the three others alone: the normaliser holds their tokens only
    alone, alone_weights = update(False, TEXTS[:3], ADVANTAGES[:3], CUT[:3])
    assert alone["grpo/overlong_filtered_fraction"] == 0.0
    assert filtered["train/loss"] == pytest.approx(alone["train/loss"], rel=1e-5, abs=1e-7)
    assert filtered["train/grad_norm"] == pytest.approx(alone["train/grad_norm"], rel=1e-5)
    for name, value in alone_weights.items():
        torch.testing.assert_close(weights[name], value, atol=5e-4, rtol=0, msg=name)
    # without filtering the truncated sample trains
    unfiltered, _ = update(False, TEXTS, ADVANTAGES, CUT)
    assert unfiltered["grpo/overlong_filtered_fraction"] == 0.0 and unfiltered["train/skipped_fraction"] == 0.0
    assert unfiltered["train/grad_norm"] != pytest.approx(filtered["train/grad_norm"], rel=1e-3)


def test_with_a_kl_penalty_a_filtered_sample_still_gets_no_gradient():
    # a KL term trains every sample, zero advantages too, but not a filtered one (NeMo-RL's mask
    # covers the KL as well)
    filtered, weights = update(True, TEXTS, [1.0, -1.0, 0.0, 0.0], CUT, kl=0.05)
    assert filtered["train/skipped_fraction"] == 0.25
    _, other_weights = update(True, TEXTS[:3] + [("41+120=", "9999999")], [1.0, -1.0, 0.0, 3.0], CUT, kl=0.05)
    for name, value in weights.items():
        assert torch.equal(other_weights[name], value), name
