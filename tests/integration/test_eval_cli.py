"""`rlscale eval`: accuracy and pass@k for a model directory or a committed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.helpers import REWARD, run_cli


def _eval(tmp_path, *args: str) -> dict:
    result = run_cli("eval", *args, "policy.device=cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.output
    return json.loads(result.stdout)


def test_eval_greedy_on_a_model_directory(tmp_path, tiny_model):
    out = _eval(tmp_path, "--model", str(tiny_model), "--limit", "16")
    assert out["model"] == str(tiny_model)
    assert out["k"] == 1 and out["temperature"] == 0.0 and out["num_problems"] == 16
    assert 0.0 <= out["accuracy"] <= 1.0
    assert out["pass_at_k"] == out["accuracy"]  # with one sample, pass@1 is the accuracy
    assert 1.0 <= out["response_length_mean"] <= 16.0


def test_eval_pass_at_k_with_sampling(tmp_path, tiny_model):
    out = _eval(tmp_path, "--model", str(tiny_model), "--limit", "16", "--k", "4", "--temperature", "1.0",
                f"rewards.function={REWARD}")
    assert out["k"] == 4 and out["temperature"] == 1.0 and out["num_problems"] == 16
    assert 0.0 <= out["accuracy"] <= out["pass_at_k"] <= 1.0  # some sample of k is at least as good
    assert 0.0 < out["reward_mean"] < 1.0  # the graded reward scored 64 varied samples
    assert 1.0 <= out["response_length_mean"] <= 16.0


def test_eval_of_a_checkpoint_reproduces_the_runs_final_validation(tmp_path, resumed_run):
    """Greedy eval of step_5 on the same 16 held-out problems equals the run's own eval.after."""
    assert resumed_run["second"] and resumed_run["second"]["returncode"] == 0, "the training run failed"
    run = Path(resumed_run["run"])
    out = _eval(tmp_path, "--checkpoint", str(run / "checkpoints" / "step_5"), "--limit", "16",
                f"rewards.function={REWARD}")
    after = json.loads((run / "summary.json").read_text())["eval"]["after"]
    assert out["model"] == str(run / "checkpoints" / "step_5" / "policy")
    assert out["num_problems"] == 16
    assert out["accuracy"] == after["accuracy"]
    assert out["reward_mean"] == after["reward_mean"]
    assert out["response_length_mean"] == after["response_length"]


def test_eval_of_the_builtin_model_with_the_math_reward(tmp_path):
    """The default model and reward end to end: the warm-started model gets some sums right."""
    out = _eval(tmp_path, "--limit", "32", "--k", "4", "--temperature", "1.0")
    assert out["model"] == "builtin:tiny-arith"
    assert out["k"] == 4 and out["num_problems"] == 32
    assert 0.0 < out["accuracy"] <= out["pass_at_k"] <= 1.0
    assert out["reward_mean"] == out["accuracy"]  # math-verify's reward is 0 or 1
