import json
import math

import pytest

from rlscale.errors import UserError
from rlscale.telemetry import StepTimer, build_sinks


def test_jsonl_appends_across_sink_instances_and_nulls_non_finite(tmp_path):
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False)
    sinks.log(1, {"reward/mean": 0.5, "train/kl": math.nan})
    sinks.close()
    sinks = build_sinks(tmp_path, tensorboard=False, wandb=False)  # a resumed run appends
    sinks.log(2, {"reward/mean": 0.75})
    sinks.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.5, "train/kl": None}, {"step": 2, "reward/mean": 0.75}]


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


def test_wandb_request_is_a_clear_user_error(tmp_path):
    with pytest.raises(UserError, match="logger.wandb_enabled"):
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
