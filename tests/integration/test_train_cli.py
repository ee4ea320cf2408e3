"""`rlscale train` end to end, in a subprocess: metrics, summary, checkpoints, resume.

`resumed_run` trains 3 GRPO steps (2 optimizer steps each, a checkpoint every 2 steps and at the
end), then is restarted with grpo.max_num_steps=5; `straight_run` trains the same 5 steps in one
go. Both are built once per session (see conftest.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.integration.helpers import REWARD, policy_weights, read_jsonl, step_dirs, train_rows

STEP_KEYS = [
    "reward/mean", "reward/std", "accuracy", "response/length_mean", "train/loss", "train/kl",
    "train/clip_fraction", "train/entropy", "train/grad_norm", "train/lr", "time/generate_s",
    "time/reward_s", "time/train_s", "throughput/tokens_per_s",
]
VOCAB = 99  # 3 special tokens + 96 characters (rlscale.models.tiny)
PEAK_LR = 2e-4  # policy.optimizer.lr default; warm-up over 5 optimizer steps, 2 per GRPO step
EXPECTED_LR = {1: PEAK_LR * (0.2 + 0.4) / 2, 2: PEAK_LR * (0.6 + 0.8) / 2, 3: PEAK_LR, 4: PEAK_LR, 5: PEAK_LR}


def _ok(result: dict) -> None:
    assert result is not None, "the run was not started (an earlier run failed)"
    assert result["returncode"] == 0, result["stderr"][-3000:]
    assert "Traceback" not in result["stdout"] + result["stderr"]


@pytest.fixture(scope="module")
def first(resumed_run) -> dict:
    _ok(resumed_run["first"])
    return resumed_run


@pytest.fixture(scope="module")
def second(first) -> dict:
    _ok(first["second"])
    return first


# ---------------------------------------------------------------- the first 3 steps


def test_first_run_prints_its_summary(first):
    summary = json.loads((Path(first["after_first"]) / "summary.json").read_text())
    assert json.loads(first["first"]["stdout"]) == summary


def test_metrics_have_one_row_per_step_with_finite_documented_values(first):
    rows = train_rows(Path(first["after_first"]) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        for key in STEP_KEYS:
            assert key in row, f"step {row['step']}: no {key}"
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["step"], key, row[key])
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["reward/std"] >= 0.0
        assert 0.0 <= row["accuracy"] <= 1.0
        assert 1.0 <= row["response/length_mean"] <= 16.0  # policy.generation.max_new_tokens
        assert row["train/kl"] >= -1e-9  # k3 is non-negative
        assert 0.0 <= row["train/clip_fraction"] <= 1.0
        assert 0.0 < row["train/entropy"] <= math.log(VOCAB) + 1e-4
        assert row["train/grad_norm"] >= 0.0
        assert row["train/lr"] == pytest.approx(EXPECTED_LR[row["step"]], rel=1e-6)
        assert min(row[k] for k in ("time/generate_s", "time/reward_s", "time/train_s")) >= 0.0
        assert row["throughput/tokens_per_s"] > 0.0
    # The graded reward differs within groups, so GRPO has advantages to follow.
    assert any(row["train/loss"] != 0.0 for row in rows)
    assert any(row["train/grad_norm"] > 0.0 for row in rows)
    assert any(row["train/kl"] > 0.0 for row in rows)  # the reference is there and the policy moved


def test_checkpoint_time_is_logged_on_save_steps_only(first):
    rows = train_rows(Path(first["after_first"]) / "metrics.jsonl")
    # save_period=2, and the last step is always saved
    assert [row["step"] for row in rows if "time/checkpoint_s" in row] == [2, 3]
    assert all(row["time/checkpoint_s"] >= 0.0 for row in rows if "time/checkpoint_s" in row)
    assert [row["step"] for row in rows if "ckpt/bytes" in row] == [2, 3]
    assert all(row["ckpt/bytes"] > 100_000 and row["ckpt/stall_s"] >= 0 for row in rows if "ckpt/bytes" in row)
    # saves persist in the background: a commit is logged by a later step (step 3's save waits
    # for step 2's commit), and the last one commits after the loop
    commits = [row for row in rows if "ckpt/committed_step" in row]
    assert [row["ckpt/committed_step"] for row in commits] == [2]
    assert all(row["ckpt/free_GB"] > 0 and row["ckpt/GBps"] > 0 and row["ckpt/persist_s"] > 0 for row in commits)


def test_summary_after_first_run(first):
    summary = json.loads((Path(first["after_first"]) / "summary.json").read_text())
    assert summary["final_step"] == 3
    assert summary["steps_run"] == 3
    assert summary["resumed_from"] is None
    assert summary["wall_s"] > 0.0
    for when in ("before", "after"):
        assert 0.0 <= summary["eval"][when]["accuracy"] <= 1.0
    assert Path(summary["checkpoint_dir"]) == Path(first["run"]) / "checkpoints"


def test_resolved_config_is_written_and_reloads(first, tiny_model):
    from rlscale.config_loading import load_config

    cfg = load_config(Path(first["after_first"]) / "config.yaml")
    assert cfg.grpo.max_num_steps == 3
    assert cfg.grpo.num_prompts_per_step == 4
    assert cfg.policy.train_global_batch_size == 8
    assert cfg.policy.model_name == str(tiny_model)
    assert cfg.rewards.function == REWARD
    assert cfg.logger.progress is False


def test_the_memory_plan_is_written_beside_the_config(first):
    """memory_plan.json holds the run's plan (what `rlscale bench mem` compares with the measured
    peaks): the same figures as a plan made again from the written config."""
    from rlscale.config_loading import load_config
    from rlscale.memory_plan import plan_for

    written = json.loads((Path(first["after_first"]) / "memory_plan.json").read_text())
    again = plan_for(load_config(Path(first["after_first"]) / "config.yaml"))
    assert written["world"] == 1 and written["fits"] is None  # no GPU here, no budget: no verdict
    assert list(written["phases"]) == [ph.name for ph in again.phases]
    for ph in again.phases:
        assert written["phases"][ph.name]["total_gb"] == pytest.approx(ph.total / 1e9)
    assert written["phases"]["update"]["components_gb"]["moments"] > 0


def test_checkpoints_are_committed_with_manifest_and_state(first):
    root = Path(first["after_first"]) / "checkpoints"
    assert step_dirs(root) == ["step_2", "step_3"]  # committed, no tmp_step_N left
    digests = set()
    for step in (2, 3):
        step_dir = root / f"step_{step}"
        manifest = json.loads((step_dir / "manifest.json").read_text())
        assert manifest["step"] == step
        for required in ("policy/model.safetensors.index.json", "policy/config.json", "trainer_state.json",
                         "config.yaml", "optim/meta.json", "rng/rank0.safetensors"):
            assert required in manifest["files"], required
        for prefix in ("policy/model-", "optim/optim-"):  # weights and moments, in safetensors shards
            assert any(rel.startswith(prefix) and rel.endswith(".safetensors") for rel in manifest["files"]), prefix
        assert manifest["checksums"].keys() == manifest["files"].keys()
        for rel, size in manifest["files"].items():
            assert (step_dir / rel).stat().st_size == size, rel
        digests.add(manifest["config_digest"])
        state = json.loads((step_dir / "trainer_state.json").read_text())
        assert state["step"] == step
        # the arithmetic stream is unlimited: position and consumed count prompts, 4 per step
        assert state["loader"] == {"seed": 42, "epoch": 0, "position": 4 * step, "consumed": 4 * step,
                                   "size": None, "shuffle": True}
    assert len(digests) == 1


def test_checkpoint_policy_loads_with_transformers(first, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = Path(first["after_first"]) / "checkpoints" / "step_3" / "policy"
    trained = AutoModelForCausalLM.from_pretrained(policy)
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert AutoTokenizer.from_pretrained(policy).get_vocab() == AutoTokenizer.from_pretrained(tiny_model).get_vocab()
    trained_weights, start_weights = trained.state_dict(), start.state_dict()
    assert trained_weights.keys() == start_weights.keys()
    assert any(not torch.equal(trained_weights[k], start_weights[k]) for k in start_weights)  # it trained


# ---------------------------------------------------------------- the restart to 5 steps


def test_restart_resumes_rather_than_restarts(second):
    summary = json.loads((Path(second["run"]) / "summary.json").read_text())
    first_summary = json.loads((Path(second["after_first"]) / "summary.json").read_text())
    assert Path(summary["resumed_from"]) == Path(second["run"]) / "checkpoints" / "step_3"
    assert summary["steps_run"] == 2
    assert summary["final_step"] == 5
    assert summary["eval"]["before"] == first_summary["eval"]["before"]  # carried over, not re-measured
    assert 0.0 <= summary["eval"]["after"]["accuracy"] <= 1.0
    state3 = json.loads((Path(second["after_first"]) / "checkpoints" / "step_3" / "trainer_state.json").read_text())
    assert summary["wall_s"] > state3["wall_s"]  # wall time accumulates across the restart


def test_restart_appends_steps_4_and_5_to_metrics(second):
    metrics = Path(second["run"]) / "metrics.jsonl"
    rows = train_rows(metrics)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert rows[:3] == train_rows(Path(second["after_first"]) / "metrics.jsonl")  # appended, not rewritten
    for row in rows[3:]:
        assert all(key in row and math.isfinite(row[key]) for key in STEP_KEYS)
        # warm-up is over: the restored scheduler continues (a fresh one would give 6e-5)
        assert row["train/lr"] == pytest.approx(PEAK_LR, rel=1e-6)
    assert [row["step"] for row in rows if "time/checkpoint_s" in row] == [2, 3, 4, 5]
    # the held-out check before training ran once, in the first run only
    assert [row["step"] for row in read_jsonl(metrics) if "val/accuracy" in row] == [0]


def test_restart_advances_the_loader_and_keeps_the_newest_two(second):
    root = Path(second["run"]) / "checkpoints"
    assert step_dirs(root) == ["step_4", "step_5"]  # checkpointing.keep_top_k=2, by recency
    state = json.loads((root / "step_5" / "trainer_state.json").read_text())
    assert state["step"] == 5
    assert state["loader"]["position"] == state["loader"]["consumed"] == 20


def test_running_a_finished_run_again_says_so_and_changes_nothing(second, tmp_path, tiny_model):
    import shutil

    from tests.integration.helpers import run_cli, train_args

    run = tmp_path / "run"
    shutil.copytree(second["run"], run)
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    again = run_cli(*train_args(tiny_model, run, 5), cwd=tmp_path)
    assert again.returncode == 0 and "Traceback" not in again.output, again.output[-3000:]
    assert f"the run in {run} finished at step 5" in again.stderr and "raise grpo.max_num_steps" in again.stderr
    assert json.loads(again.stdout) == json.loads(before["summary.json"])  # its summary, as it was
    assert {name: (run / name).read_bytes() for name in before} == before  # no second final row
    assert step_dirs(run / "checkpoints") == ["step_4", "step_5"]


def test_resumed_run_matches_a_straight_run(second, straight_run):
    """Restarting from step 3 changes nothing: same rewards, losses and final weights as one run."""
    import torch

    _ok(straight_run["result"])
    straight = train_rows(Path(straight_run["run"]) / "metrics.jsonl")
    resumed = train_rows(Path(second["run"]) / "metrics.jsonl")
    assert [row["step"] for row in straight] == [1, 2, 3, 4, 5]
    for a, b in zip(straight, resumed):
        for key in ("reward/mean", "reward/std", "response/length_mean", "train/loss", "train/kl",
                    "train/grad_norm", "train/entropy"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    # the straight run validated (greedily) at steps 2 and 4 in between, and logged to TensorBoard
    assert [row["step"] for row in straight if "val/accuracy" in row] == [2, 4]
    assert list((Path(straight_run["run"]) / "tensorboard").glob("events.out.tfevents.*"))
    assert step_dirs(Path(straight_run["run"]) / "checkpoints") == ["step_4", "step_5"]
    # a checkpoint records the held-out metrics of its own step only (what metric_name ranks):
    # step 4 was validated, step 5 (saved before the final validation) was not
    manifests = {step: json.loads((Path(straight_run["run"]) / "checkpoints" / f"step_{step}" / "manifest.json")
                                  .read_text())["metrics"] for step in (4, 5)}
    assert manifests[4]["val/accuracy"] == next(r["val/accuracy"] for r in straight if r["step"] == 4)
    assert "val/accuracy" not in manifests[5] and manifests[5]["train/loss"] == straight[-1]["train/loss"]
    assert manifests[5]["reward/mean"] == straight[-1]["reward/mean"]  # the step's samples, too
    from rlscale.config import RANKABLE_METRICS  # what the config's metric_name note knows of

    assert sorted(manifests[4]) == sorted(RANKABLE_METRICS)
    final = "checkpoints/step_5"
    a_weights = policy_weights(Path(straight_run["run"]) / final)
    b_weights = policy_weights(Path(second["run"]) / final)
    assert a_weights.keys() == b_weights.keys()
    assert all(torch.equal(a_weights[k], b_weights[k]) for k in a_weights)


# ---------------------------------------------------------------- a restart after a crash


@pytest.fixture(scope="module")
def crashed(crash_resumed_run) -> dict:
    _ok(crash_resumed_run["result"])
    return crash_resumed_run


def test_restart_skips_a_damaged_checkpoint_and_clears_half_written_saves(crashed, straight_run):
    run = Path(crashed["run"])
    summary = json.loads((run / "summary.json").read_text())
    assert Path(summary["resumed_from"]) == run / "checkpoints" / "step_2"  # step_3 fails verification
    assert summary["steps_run"] == 2 and summary["final_step"] == 4
    assert not (run / "checkpoints" / "tmp_step_4").exists()
    state = json.loads((run / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["loader"]["consumed"] == 16
    # steps 3 and 4, re-run from step 2's state, are the straight run's steps 3 and 4
    _ok(straight_run["result"])
    straight = {row["step"]: row for row in train_rows(Path(straight_run["run"]) / "metrics.jsonl")}
    rerun = [row for row in train_rows(run / "metrics.jsonl")][-2:]
    assert [row["step"] for row in rerun] == [3, 4]
    for row in rerun:
        for key in ("reward/mean", "train/loss", "train/grad_norm"):
            assert row[key] == straight[row["step"]][key], (row["step"], key)


def test_restart_from_an_older_checkpoint_leaves_one_row_per_step(crashed):
    rows = train_rows(Path(crashed["run"]) / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]


def test_a_prometheus_port_chosen_by_the_os_is_printed(straight_run):
    """logger.prometheus_port=0 serves on a free port: the run says which."""
    import re

    _ok(straight_run["result"])
    output = straight_run["result"]["stdout"] + straight_run["result"]["stderr"]
    ports = re.findall(r"Prometheus metrics on port (\d+) \(/metrics\)", output)
    assert len(ports) == 1 and 0 < int(ports[0]) < 65536, output[-2000:]
