"""`rlscale train` stopped by SIGTERM or its deadline, then run again: the same run, bit for bit.

The signal is the process's own, sent by a fault point (RLSCALE_FAULT=loop.after_step:3:SIGTERM,
see rlscale/ckpt/faults.py) so that it lands at a known moment; the handling is the real one.
Every resumed run is compared with `straight_run`, the same 5 steps without a stop.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.helpers import run_cli, step_dirs, train_args, train_rows

EXACT_KEYS = ("reward/mean", "reward/std", "response/length_mean", "train/loss", "train/kl",
              "train/grad_norm", "train/entropy", "train/lr")


def _stop_then_resume(tiny_model, tmp_path, monkeypatch, fault: str | None, *extra: str):
    """Run 5 steps until the stop, then the same command again (without the fault or `extra`)."""
    run = tmp_path / "run"
    if fault:
        monkeypatch.setenv("RLSCALE_FAULT", fault)
    stopped = run_cli(*train_args(tiny_model, run, 5, *extra), cwd=tmp_path)
    monkeypatch.delenv("RLSCALE_FAULT", raising=False)
    rows_at_stop = train_rows(run / "metrics.jsonl")
    steps_at_stop = step_dirs(run / "checkpoints")
    resumed = run_cli(*train_args(tiny_model, run, 5), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.output
    return run, stopped, rows_at_stop, steps_at_stop


def _assert_same_as_straight(run: Path, straight_run: dict) -> None:
    straight = train_rows(Path(straight_run["run"]) / "metrics.jsonl")
    resumed = train_rows(run / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(straight, resumed):
        for key in EXACT_KEYS:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def _stop_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlscale: stopped")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.output
    return lines[0]


def test_a_worker_pods_stop_request_saves_releases_the_pod_and_resumes_bit_for_bit(
        tiny_model, tmp_path, monkeypatch, straight_run):
    """A worker pod being stopped runs its preStop hook (rlscale.cluster.render.WORKER_PRE_STOP),
    which leaves a request on the shared volume and waits; the run saves its unsaved step,
    removes the request (the hook returns) and exits 143, as for a SIGTERM."""
    import socket

    requests = tmp_path / "stop-requests"
    monkeypatch.setenv("RLSCALE_STOP_REQUESTS", str(requests))
    run, stopped, rows, steps = _stop_then_resume(tiny_model, tmp_path, monkeypatch, "loop.after_step:3:PRESTOP")
    assert stopped.returncode == 143, stopped.output
    line = _stop_line(stopped)
    assert f"stopped by the stop of pod {socket.gethostname()} after step 3" in line, line
    assert "step_3 is the newest checkpoint" in line
    assert [row["step"] for row in rows] == [1, 2, 3] and steps == ["step_2", "step_3"]
    assert [p.name for p in requests.iterdir()] == []  # acknowledged, nothing left for the next run
    _assert_same_as_straight(run, straight_run)


def test_sigterm_after_an_unsaved_step_saves_it_exits_143_and_resumes_bit_for_bit(
        tiny_model, tmp_path, monkeypatch, straight_run):
    # save_period=2: step 2 is saved, step 3 is not when the signal comes
    run, stopped, rows, steps = _stop_then_resume(tiny_model, tmp_path, monkeypatch, "loop.after_step:3:SIGTERM")
    assert stopped.returncode == 143, stopped.output
    line = _stop_line(stopped)
    assert "stopped by SIGTERM after step 3" in line and "step_3 is the newest checkpoint" in line
    assert [row["step"] for row in rows] == [1, 2, 3] and steps == ["step_2", "step_3"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / "step_3") and summary["steps_run"] == 2
    _assert_same_as_straight(run, straight_run)


def test_sigterm_mid_step_drops_the_step_when_the_last_is_saved(tiny_model, tmp_path, monkeypatch, straight_run):
    # after step 3's rollout; step 2 is saved (its commit possibly still in flight): nothing to add
    run, stopped, rows, steps = _stop_then_resume(tiny_model, tmp_path, monkeypatch, "loop.after_generate:3:SIGTERM")
    assert stopped.returncode == 143, stopped.output
    assert "stopped by SIGTERM after step 2: " in _stop_line(stopped)
    assert [row["step"] for row in rows] == [1, 2] and steps == ["step_2"]
    _assert_same_as_straight(run, straight_run)


def test_sigterm_skips_a_save_that_does_not_fit_the_grace_period(tiny_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("RLSCALE_FAULT", "loop.after_step:3:SIGTERM")
    # a synchronous save of step 2 is measured before the signal: the estimate exists
    stopped = run_cli(*train_args(tiny_model, run, 5, "checkpointing.preemption_grace_s=0.000001",
                                  "checkpointing.async_save=false"), cwd=tmp_path)
    assert stopped.returncode == 143, stopped.output
    line = _stop_line(stopped)
    assert "step_2 is the newest checkpoint; step 3 not saved" in line and "preemption_grace_s" in line
    assert step_dirs(run / "checkpoints") == ["step_2"]


def test_the_deadline_saves_and_exits_75_then_the_run_resumes_bit_for_bit(tiny_model, tmp_path, monkeypatch,
                                                                          straight_run):
    budget = "00:00:00:01"  # spent before step 1 ends: the deadline save comes right after it
    run, stopped, rows, steps = _stop_then_resume(
        tiny_model, tmp_path, monkeypatch, None, f"checkpointing.checkpoint_must_save_by={budget}")
    assert stopped.returncode == 75, stopped.output
    line = _stop_line(stopped)
    assert f"stopped by checkpointing.checkpoint_must_save_by={budget} after step 1" in line
    assert [row["step"] for row in rows] == [1] and steps == ["step_1"]
    _assert_same_as_straight(run, straight_run)


def test_a_bad_deadline_or_resume_path_is_one_line(tiny_model, tmp_path):
    bad = run_cli(*train_args(tiny_model, tmp_path / "run", 1, "checkpointing.checkpoint_must_save_by=3h"), cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.output
    assert bad.stderr.strip().splitlines() == [
        "rlscale: error: config key 'checkpointing.checkpoint_must_save_by': expected \"DD:HH:MM:SS\" "
        "(e.g. \"00:03:45:00\"), got '3h'"]
    missing = tmp_path / "elsewhere" / "step_7"
    bad = run_cli(*train_args(tiny_model, tmp_path / "run", 1, f"checkpointing.resume={missing}"), cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.output
    assert bad.stderr.strip().splitlines() == [f"rlscale: error: checkpointing.resume: '{missing}' does not exist "
                                               "(expected auto, never or the path of a checkpoint's step_N directory)"]


def test_a_run_stopped_at_its_last_step_is_not_taken_for_an_earlier_finished_run(tiny_model, tmp_path, monkeypatch):
    """An older summary.json in the same log_dir with the same final step is not this run's: a new
    run stopped during its last step still owes its final validation when restarted."""
    run = tmp_path / "run"
    first = run_cli(*train_args(tiny_model, run, 2, f"checkpointing.checkpoint_dir={tmp_path / 'ckpt_a'}"),
                    cwd=tmp_path)
    assert first.returncode == 0, first.output
    assert json.loads((run / "summary.json").read_text())["final_step"] == 2
    again = train_args(tiny_model, run, 2, f"checkpointing.checkpoint_dir={tmp_path / 'ckpt_b'}")
    monkeypatch.setenv("RLSCALE_FAULT", "loop.after_step:2:SIGTERM")
    stopped = run_cli(*again, cwd=tmp_path)
    monkeypatch.delenv("RLSCALE_FAULT")
    assert stopped.returncode == 143 and "ckpt_b/step_2 is the newest checkpoint" in _stop_line(stopped)
    assert not (run / "summary.json").exists()  # the first run's, gone when this one started work
    finished = run_cli(*again, cwd=tmp_path)
    assert finished.returncode == 0 and "finished at step" not in finished.stderr, finished.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoint_dir"] == str(tmp_path / "ckpt_b") and summary["steps_run"] == 0
    assert summary["eval"]["after"] is not None  # the final validation ran
