"""Dynamic sampling end to end (`rlscale train` in a subprocess, the tiny model): the step is
refilled with new prompts until it holds grpo.num_prompts_per_step informative groups, a resumed
run draws the same rounds as an uninterrupted one, and a run that cannot find enough stops with
one line.

The reward `digit_share_if_even` scores every problem with an odd answer 0.0, so those groups
all agree and are dropped; the others get graded rewards that differ within their group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.helpers import run_cli, train_args, train_rows

REFILL = ["rewards.function=tests.integration.rewards_for_tests:digit_share_if_even",
          "grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=1.5", "grpo.val_at_start=false",
          "grpo.val_at_end=false"]
PROMPTS, ROUND = 4, 6  # grpo.num_prompts_per_step, ceil(4 × 1.5)


def _ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> dict:
    """3 steps straight; the same 3 as 2 steps and a restart; the same 3 without dynamic sampling."""
    root = tmp_path_factory.mktemp("dynamic")
    straight = run_cli(*train_args(tiny_model, root / "straight", 3, *REFILL), cwd=root)
    first = run_cli(*train_args(tiny_model, root / "resumed", 2, *REFILL), cwd=root)
    second = run_cli(*train_args(tiny_model, root / "resumed", 3, *REFILL), cwd=root)
    plain = run_cli(*train_args(tiny_model, root / "plain", 3, *REFILL[:1], *REFILL[3:]), cwd=root)
    for result in (straight, first, second, plain):
        _ok(result)
    return {name: train_rows(root / name / "metrics.jsonl") for name in ("straight", "resumed", "plain")}


def test_each_step_is_refilled_until_it_holds_enough_informative_groups(runs):
    rows = runs["straight"]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        rounds = row["grpo/refill_rounds"]
        generated = rounds * ROUND
        # every generated group is trained on, dropped for agreeing, or surplus
        assert PROMPTS + row["grpo/dropped_groups"] + row["grpo/surplus_groups"] == generated
        assert row["grpo/zero_std_groups"] == pytest.approx(row["grpo/dropped_groups"] / generated)
        # one round fewer would not have held enough: the step stopped as soon as it could
        assert generated - ROUND - row["grpo/dropped_groups"] < PROMPTS or rounds == 1
        assert 0 <= row["grpo/surplus_groups"] < ROUND
    assert max(row["grpo/refill_rounds"] for row in rows) >= 2  # odd answers made some steps refill


def test_a_resumed_run_draws_the_same_rounds_and_trains_the_same(runs):
    straight, resumed = runs["straight"], runs["resumed"]
    assert [row["step"] for row in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        for key in ("grpo/refill_rounds", "grpo/dropped_groups", "reward/mean", "train/loss", "train/grad_norm",
                    "data/epoch"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_without_dynamic_sampling_the_agreeing_groups_are_trained_on(runs):
    plain = runs["plain"]
    assert "grpo/refill_rounds" not in plain[0]
    assert any(row["grpo/zero_std_groups"] > 0 for row in plain)
    assert [r["train/loss"] for r in plain] != [r["train/loss"] for r in runs["straight"]]


def test_a_run_that_finds_too_few_informative_groups_stops_with_one_line(tiny_model, tmp_path):
    result = run_cli(*train_args(tiny_model, tmp_path / "run", 3,
                                 "rewards.function=tests.integration.rewards_for_tests:always_zero",
                                 "grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=2",
                                 "grpo.val_at_start=false"), cwd=tmp_path)
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rlscale: error: step 1: dynamic sampling found 0 of the 4 groups"), last
    assert "in 2 generation rounds of 4 prompts (grpo.dynamic_sampling_max_gen_batches=2)" in last
    assert last.endswith("no checkpoint is saved yet"), last


def test_dry_run_refuses_a_multiplier_without_dynamic_sampling(tiny_model, tmp_path):
    result = run_cli("train", "--dry-run", f"policy.model_name={tiny_model}", "grpo.batch_multiplier=2",
                     cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "rlscale: error: config key 'grpo': grpo.batch_multiplier=2 is only read with grpo.use_dynamic_sampling=true: "
        "set both, or drop batch_multiplier")
