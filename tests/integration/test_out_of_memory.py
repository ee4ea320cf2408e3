"""`rlscale train` out of memory: one line, exit 2, the traceback in <log_dir>/error.log, the
committed checkpoints intact, and the run resumes from the newest of them.

The error is a real torch.OutOfMemoryError raised inside the policy worker as a given call
starts (RLSCALE_FAULT=worker.train:3:OOM, see rlscale/ckpt/faults.py and
rlscale.workers.group.call_worker); the handling from there on is the real one.
"""

from __future__ import annotations

import re

import json

import pytest

from tests.integration.helpers import TINY_RUN, run_cli, step_dirs, train_args, train_rows
from tests.integration.test_preemption import _assert_same_as_straight

PLAN_FIGURE = re.compile(r"; the memory plan expected \d+\.\d GiB for this phase; ")  # its update phase


def _error_line(result) -> str:
    """The run's one error line: the last line on stderr, the only one of its kind, no traceback."""
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("rlscale: error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == errors[0]
    return errors[0]


def test_out_of_memory_in_the_update_is_one_line_and_the_run_resumes_from_its_last_checkpoint(
        tiny_model, tmp_path, monkeypatch, straight_run):
    run = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_FAULT", "worker.train:3:OOM")  # step 3's update; step 2 is saved (async)
    failed = run_cli(*train_args(tiny_model, run, 5), cwd=tmp_path)
    monkeypatch.delenv("RLSCALE_FAULT")
    line = _error_line(failed)
    assert line.startswith("rlscale: error: out of memory in update (step 3): "), line
    assert " GiB allocated of " in line and " GiB on cpu; " in line and PLAN_FIGURE.search(line)
    assert "policy.activation_checkpointing=true" in line and "policy.train_micro_batch_tokens" in line
    log = run / "error.log"
    assert line.endswith(f"; traceback in {log}")
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "torch.OutOfMemoryError: injected" in logged
    assert line.removeprefix("rlscale: error: ") in logged and logged.startswith("===== 20")  # the time

    # the save of step 2 was in flight or done: committed, nothing half-written left; no summary
    assert step_dirs(run / "checkpoints") == ["step_2"]
    assert not (run / "summary.json").exists()
    assert [row["step"] for row in train_rows(run / "metrics.jsonl")] == [1, 2]
    verified = run_cli("ckpt", "verify", str(run / "checkpoints" / "step_2"), cwd=tmp_path)
    assert verified.returncode == 0, verified.output

    resumed = run_cli(*train_args(tiny_model, run, 5), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / "step_2") and summary["final_step"] == 5
    _assert_same_as_straight(run, straight_run)  # the resumed steps are those of an uninterrupted run
    assert log.read_text() == logged  # appended to only when an error happens


def test_out_of_memory_in_the_first_validation_names_validation(tiny_model, tmp_path, monkeypatch):
    """The workers see a generation; the controller knows it is the held-out one. The host's
    MemoryError is reported as such."""
    run = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_FAULT", "worker.generate:1:MEMORY")  # grpo.val_at_start=true
    failed = run_cli(*train_args(tiny_model, run, 2, "checkpointing.enabled=false"), cwd=tmp_path)
    line = _error_line(failed)
    assert line.startswith("rlscale: error: out of memory in validation (step 0): "), line
    assert " GiB on host; " in line and "the host ran out of memory" in line
    assert "MemoryError: injected host out of memory" in (run / "error.log").read_text()


def test_out_of_memory_in_a_ray_worker_crosses_ray_as_one_line(tiny_model, tmp_path, monkeypatch):
    """Through a Ray actor (one CPU worker): the error is made in the actor's process and arrives
    intact. It hits step 2's checkpoint snapshot: the half-made save is removed, step 1 stays."""
    pytest.importorskip("ray")
    run = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_FAULT", "worker.checkpoint_snapshot:2:OOM")
    failed = run_cli("train", *TINY_RUN, f"policy.model_name={tiny_model}", "grpo.max_num_steps=3",
                     "cluster.backend=ray", "cluster.use_gpus=false", "grpo.val_at_start=false",
                     "grpo.val_at_end=false", "checkpointing.save_period=1", f"logger.log_dir={run}",
                     cwd=tmp_path, timeout=240)
    line = _error_line(failed)
    assert line.startswith("rlscale: error: out of memory in checkpoint snapshot (step 2): "), line
    assert " GiB on cpu; " in line and "checkpointing.staging_budget_gb" in line
    assert "torch.OutOfMemoryError: injected out of memory at worker.checkpoint_snapshot" in \
        (run / "error.log").read_text()
    assert step_dirs(run / "checkpoints") == ["step_1"]
    verified = run_cli("ckpt", "verify", str(run / "checkpoints" / "step_1"), cwd=tmp_path)
    assert verified.returncode == 0, verified.output
