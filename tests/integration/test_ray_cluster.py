"""The same CLI on a local Ray cluster: 2 CPU workers on gloo with FSDP2, and a worker lost mid-step
(the restart resumes from the newest intact checkpoint)."""

from __future__ import annotations

import json
import time

import pytest

from tests.integration.helpers import TINY_RUN, run_cli

pytest.importorskip("ray")

RAY_RUN = [*TINY_RUN, "cluster.gpus_per_node=2", "cluster.use_gpus=false", "grpo.max_val_samples=8"]


def test_two_cpu_workers_train_and_report_metrics(tiny_model, tmp_path):
    log_dir = tmp_path / "run"
    result = run_cli("train", *RAY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=2",
                     "checkpointing.enabled=false", f"logger.log_dir={log_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.output
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["train/grad_norm"] > 0 and row["train/entropy"] > 0
        assert row["train/lr"] > 0


def test_a_killed_worker_ends_the_run_with_its_name_and_a_restart_resumes_the_newest_checkpoint(
        tiny_model, tmp_path, monkeypatch):
    marker = tmp_path / "kill-now"
    marker.write_text("")
    log_dir = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_TEST_KILL_MARKER", str(marker))
    # a worker dies in a step after step 1 has committed (saves every step, in the background)
    monkeypatch.setenv("RLSCALE_TEST_KILL_AFTER", str(log_dir / "checkpoints" / "step_1"))
    started = time.monotonic()
    result = run_cli("train", *RAY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=4",
                     "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.save_period=1",
                     "rewards.function=tests.integration.rewards_for_tests:kill_a_worker_once",
                     f"logger.log_dir={log_dir}", cwd=tmp_path, timeout=240)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert not marker.exists(), "the reward function never killed a worker"
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlscale: error:")]
    assert len(errors) == 1 and "worker rank" in errors[0] and "died" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.output
    assert elapsed < 200
    assert not (log_dir / "summary.json").exists()

    from rlscale.ckpt.layout import latest_intact

    newest = latest_intact(log_dir / "checkpoints")
    assert newest is not None and newest.name in ("step_1", "step_2", "step_3")
    monkeypatch.delenv("RLSCALE_TEST_KILL_MARKER")
    one = [arg for arg in RAY_RUN if not arg.startswith("cluster.gpus_per_node")]  # in-process this time
    again = run_cli("train", *one, f"policy.model_name={tiny_model}", "grpo.max_num_steps=4",
                    "grpo.val_at_start=false", "grpo.val_at_end=false", "checkpointing.save_period=1",
                    f"logger.log_dir={log_dir}", cwd=tmp_path)
    assert again.returncode == 0, again.output
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(newest) and summary["final_step"] == 4
    assert not list((log_dir / "checkpoints").glob("tmp_step_*"))


def test_two_sharded_workers_checkpoint_and_one_worker_resumes(tiny_model, tmp_path):
    """FSDP2 ranks save their own rows of every step (the sharded layout); a 1-worker run resumes."""
    from transformers import AutoModelForCausalLM

    from rlscale.ckpt.tools import export_policy

    log_dir = tmp_path / "run"
    first = run_cli("train", *RAY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=2",
                    "checkpointing.save_period=1", "grpo.val_at_end=false", f"logger.log_dir={log_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.output
    step_2 = log_dir / "checkpoints" / "step_2"
    manifest = json.loads((step_2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert "tensors" in manifest  # every tensor's rows by byte range
    for part in ("policy", "optim"):  # each rank wrote its own files
        assert {rel.split("-")[1] for rel in manifest["files"] if rel.startswith(f"{part}/shard-")} == {"r000", "r001"}
    AutoModelForCausalLM.from_pretrained(export_policy(step_2, tmp_path / "export"))  # HF model by export

    one = [arg for arg in RAY_RUN if not arg.startswith("cluster.gpus_per_node")]
    second = run_cli("train", *one, f"policy.model_name={tiny_model}", "grpo.max_num_steps=3",
                     "checkpointing.save_period=1", "grpo.val_at_end=false", f"logger.log_dir={log_dir}", cwd=tmp_path)
    assert second.returncode == 0, second.output
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(step_2) and summary["steps_run"] == 1
    assert json.loads((log_dir / "checkpoints" / "step_3" / "manifest.json").read_text())["world_size"] == 1


def test_rewards_scored_by_ray_actors_match_the_local_pool(tiny_model, tmp_path):
    """Same seeds, same samples: scoring in 2 Ray actors gives the rewards of the local pool."""
    runs = {}
    for name, extra in (("local", []), ("actors", ["rewards.ray_actors=2", "rewards.num_workers=1"])):
        log_dir = tmp_path / name
        result = run_cli("train", *TINY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=2",
                         "checkpointing.enabled=false", "cluster.backend=ray", "cluster.use_gpus=false",
                         "grpo.max_val_samples=8", *extra, f"logger.log_dir={log_dir}", cwd=tmp_path)
        assert result.returncode == 0, result.output
        rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(row["step"], row["reward/mean"]) for row in rows if "reward/mean" in row]
    assert len(runs["local"]) == 2
    assert runs["actors"] == runs["local"]


def test_sigterm_to_the_driver_saves_from_live_ray_workers_and_exits_143(tiny_model, tmp_path, monkeypatch):
    """The driver's handler replaces Ray's (which would exit at once); the actors never see the signal."""
    log_dir = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_FAULT", "loop.after_step:1:SIGTERM")
    result = run_cli("train", *RAY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=3",
                     "grpo.val_at_start=false", "checkpointing.save_period=100", f"logger.log_dir={log_dir}",
                     cwd=tmp_path)
    assert result.returncode == 143, result.output
    assert "rlscale: stopped by SIGTERM after step 1: " in result.stderr and "Traceback" not in result.stderr
    manifest = json.loads((log_dir / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["world_size"] == 2  # the emergency save came from both workers
