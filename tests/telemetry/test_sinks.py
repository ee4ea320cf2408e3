import json
import math
import sys

import pytest

from rlscale.errors import UserError
from rlscale.telemetry import StepTimer, build_sinks


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_resume_keeps_rows_up_to_the_checkpoint_and_nulls_non_finite(tmp_path):
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False)
    for step in (1, 2, 3):
        sinks.log(step, {"reward/mean": step / 4, "train/kl": math.nan})
    sinks.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/m')  # a row cut short by a crash
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False, resumed_step=2)  # resumes after step 2
    sinks.log(3, {"reward/mean": 0.9})
    sinks.close()
    assert _rows(tmp_path) == [{"step": 1, "reward/mean": 0.25, "train/kl": None},
                               {"step": 2, "reward/mean": 0.5, "train/kl": None},
                               {"step": 3, "reward/mean": 0.9}]


def test_a_resumed_step_whose_row_was_never_written_gets_its_checkpoints_metrics(tmp_path):
    """A synchronous save commits step 3 before its row is written: a crash in between leaves a
    checkpoint at step 3 and rows up to 2. The resume writes step 3's row from the manifest."""
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False)
    for step in (1, 2):
        sinks.log(step, {"reward/mean": step / 4})
    sinks.close()
    recorded = {"reward/mean": 0.75, "train/kl": math.inf}
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False, resumed_step=3, resumed_row=recorded)
    sinks.log(4, {"reward/mean": 1.0})
    sinks.close()
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3, 4]
    assert _rows(tmp_path)[2] == {"step": 3, "reward/mean": 0.75, "train/kl": None}
    # a row that is there is kept as written, never doubled
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False, resumed_step=3, resumed_row={"reward/mean": 0.0})
    sinks.close()
    assert [row["step"] for row in _rows(tmp_path)] == [1, 2, 3] and _rows(tmp_path)[2]["reward/mean"] == 0.75


def test_a_fresh_run_starts_an_empty_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False)
    sinks.log(1, {"accuracy": 0.5})
    sinks.close()
    assert _rows(tmp_path) == [{"step": 1, "accuracy": 0.5}]


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = build_sinks(tmp_path, tensorboard=True, wandb=False)
    for step, value in ((1, 0.25), (2, 0.5)):
        sinks.log(step, {"reward/mean": value})
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.5)]
    # the same run started over from scratch (it crashed before its first save): the old points go
    import time

    time.sleep(1.1)  # a new event file (they are named by the second)
    sinks = build_sinks(tmp_path, tensorboard=True, wandb=False)
    sinks.log(1, {"reward/mean": 0.75})
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("reward/mean")] == [(1, 0.75)]


def test_wandb_without_the_package_is_a_clear_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    needs = r"logger.wandb_enabled needs the 'wandb' package: pip install 'rlscale\[wandb\]'"
    with pytest.raises(UserError, match=needs):
        build_sinks(tmp_path, tensorboard=False, wandb=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_step_timer_accumulates_sections_and_resets():
    timer = StepTimer()
    with timer.section("generate"):
        pass
    with timer.section("generate"):
        pass
    out = timer.pop()
    assert set(out) == {"time/generate_s"} and out["time/generate_s"] >= 0
    assert timer.pop() == {}


def test_prometheus_endpoint_serves_step_metrics_and_checkpoint_bytes(tmp_path):
    import urllib.request

    from rlscale.telemetry.prometheus import PrometheusSink

    sink = PrometheusSink(0, address="127.0.0.1")  # port 0: the OS picks a free one
    try:
        sink.log(3, {"reward/mean": 0.625, "ckpt/bytes": 1000, "train/kl": math.nan, "ckpt/retained_GB": 0.5})
        sink.log(4, {"reward/mean": 0.75, "ckpt/bytes": 500})
        body = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    assert "rlscale_step 4.0" in body
    assert "rlscale_reward_mean 0.75" in body
    assert "rlscale_ckpt_bytes_written_total 1500.0" in body
    assert "rlscale_ckpt_retained_GB 0.5" in body
    assert "rlscale_train_kl" not in body  # non-finite values are skipped, not exported as NaN


def test_prometheus_port_in_use_is_a_user_error():
    import socket

    from rlscale.telemetry.prometheus import PrometheusSink

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(UserError, match="logger.prometheus_port"):
            PrometheusSink(busy.getsockname()[1], address="127.0.0.1")
