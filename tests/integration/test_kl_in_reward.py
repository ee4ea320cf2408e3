"""`loss.use_kl_in_reward=true` end to end (`rlscale train` in a subprocess, the tiny model): the
KL penalty leaves the loss and comes off each sample's reward before the advantages."""

from __future__ import annotations

import pytest

from tests.integration.helpers import run_cli, train_args, train_rows

BETA = 0.05


def test_the_kl_comes_off_the_reward(tiny_model, tmp_path):
    result = run_cli(*train_args(tiny_model, tmp_path / "run", 3, "loss.use_kl_in_reward=true",
                                 f"loss.reference_policy_kl_penalty={BETA}", "grpo.val_at_start=false",
                                 "grpo.val_at_end=false", "checkpointing.enabled=false"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    # step 1 samples with the reference itself: no KL at all
    assert rows[0]["reward/kl_penalty_mean"] == 0.0 and rows[0]["train/kl"] == 0.0
    for row in rows[1:]:
        assert row["train/kl"] > 0.0
        # per sample beta × its summed KL; train/kl is per response token: the mean length links them
        assert row["reward/kl_penalty_mean"] == pytest.approx(
            BETA * row["train/kl"] * row["response/length_mean"], rel=1e-4)
