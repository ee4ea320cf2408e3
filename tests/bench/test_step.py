import importlib.util
import json

import pytest
from typer.testing import CliRunner

from rlscale.bench import step
from rlscale.cli import app


@pytest.fixture
def tiny_step(monkeypatch):
    """The bench's step shrunk to 2 prompts × 2 samples × 4 new tokens: the same code path, CI-sized."""
    monkeypatch.setattr(step, "PROMPTS", 2)
    monkeypatch.setattr(step, "GENERATIONS", 2)
    monkeypatch.setattr(step, "NEW_TOKENS", 4)


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="checks the half without TRL installed")
def test_bench_step_tiny_without_trl(tmp_path, monkeypatch):
    # The real bench is 32 prompts × 8 samples × 256 tokens; a smaller step keeps CI fast, same code path.
    monkeypatch.setattr(step, "PROMPTS", 4)
    monkeypatch.setattr(step, "GENERATIONS", 2)
    monkeypatch.setattr(step, "NEW_TOKENS", 8)
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--model", "tiny", "--steps", "2", "--json", str(out)])
    assert result.exit_code == 1, result.output  # the table and JSON, but no comparison: not a success
    data = json.loads(out.read_text())
    assert data["trl"]["status"] == "trl not installed"
    r = data["rlscale"]
    assert r["status"] == "ok" and r["steps_run"] == 2 and r["steps_timed"] == 1
    assert r["median_step_s"] > 0 and r["median_generate_s"] > 0 and r["median_train_s"] > 0
    assert data["model_dir"]["tokenizer_size"] == data["model_dir"]["model_vocab_rows"] == 512
    assert "speedup_rlscale_vs_trl" not in data
    assert "trl not installed" in result.output
    assert json.loads((tmp_path / "step.trl-steps.json").read_text())["status"] == "trl not installed"


def test_rlscale_half_runs_without_a_reference_like_trl():
    """The settings the JSON reports are the ones rlscale train gets (TRL gets beta=KL_BETA)."""
    from rlscale.config_loading import load_config

    cfg = load_config(None, step.rlscale_overrides())
    assert step.KL_BETA == 0.0 and cfg.loss.reference_policy_kl_penalty == step.KL_BETA
    assert cfg.rewards.function == step.REWARD and cfg.policy.optimizer.lr == step.LEARNING_RATE


def test_summarize_leaves_out_the_warm_up_step():
    rows = [{"step_s": 10.0, "generate_s": 8.0}, {"step_s": 2.0, "generate_s": 1.0}, {"step_s": 4.0, "generate_s": 3.0}]
    s = step.summarize(rows)
    assert s["steps_timed"] == 2 and s["median_step_s"] == 3.0 and s["median_generate_s"] == 2.0
    assert s["median_logprobs_s"] is None


def test_bench_step_profiles_one_rlscale_step(tmp_path, tiny_step):
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--model", "tiny", "--steps", "3", "--profile-step", "3",
                                      "--only", "rlscale", "--json", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())["rlscale"]
    assert r["steps_run"] == 3 and r["steps_timed"] == 1 and r["profiled_step"] == 3  # 1 warms up, 3 profiled
    names = [name for name, _ in r["sections_ms"]["rank0-train"]]
    assert names[-2:] == ["optimizer step", "end"] and "micro-batch 0 forward+backward" in names
    assert [name for name, _ in r["sections_ms"]["rank0-generate"]][1] == "engine generate"
    assert "rlscale step 3, rank0-train (ms)" in result.output


def test_bench_step_passes_set_to_the_rlscale_half(tmp_path):
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--model", "tiny", "--steps", "2", "--only", "rlscale",
                                      "--set", "policy.no_such_key=1", "--json", str(out)])
    assert result.exit_code == 1, result.output  # the half it ran failed
    data = json.loads(out.read_text())
    assert data["settings"]["rlscale_set"] == ["policy.no_such_key=1"]
    assert data["rlscale"]["status"] == "failed" and "no_such_key" in data["rlscale"]["error"]


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="checks the pairs without TRL installed")
def test_bench_step_pairs_alternate_on_one_model_and_compare_a_second_setting(tmp_path, tiny_step):
    out = tmp_path / "pairs.json"
    result = CliRunner().invoke(app, ["bench", "step", "--model", "tiny", "--steps", "2", "--pairs", "2",
                                      "--compare-set", "policy.master_weights=bf16", "--json", str(out)])
    assert result.exit_code == 1, result.output  # no TRL: no pair compares
    data = json.loads(out.read_text())
    assert len(data["pairs"]) == 2 and data["compare_set"] == ["policy.master_weights=bf16"]
    for pair in data["pairs"]:
        assert pair["rlscale"]["status"] == "ok" and pair["compare"]["status"] == "ok"
        assert pair["trl"]["status"] == "trl not installed" and pair["trl_over_rlscale"] is None
        assert pair["compare_over_rlscale"] == pytest.approx(
            pair["compare"]["median_step_s"] / pair["rlscale"]["median_step_s"])
    assert data["median_compare_over_rlscale"] is not None and data["median_trl_over_rlscale"] is None
    assert "median compare/rlscale" in result.output

