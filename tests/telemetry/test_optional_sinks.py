"""Weights & Biases (offline) and MLflow (file store) sinks, read back from what they wrote."""

import json
import struct
import sys
import time

import pytest

from rlscale.config import Config
from rlscale.config_loading import load_config
from rlscale.errors import UserError
from rlscale.telemetry import build_sinks

STEPS = [{"reward/mean": 0.25, "loss": 1.5, "time/step_s": float("nan")},
         {"reward/mean": 0.5, "loss": 1.25, "time/step_s": 2.0},
         {"reward/mean": 0.75, "loss": float("inf"), "time/step_s": 3.0}]


def _config(log_dir, *overrides):
    return load_config(None, [f"logger.log_dir={log_dir}", *overrides])


def _log(sinks, steps, first=1):
    for step, metrics in enumerate(steps, start=first):
        sinks.log(step, metrics)
    sinks.close()


# --- Weights & Biases ---------------------------------------------------------------------------

@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def _wandb_records(path):
    """The records of a .wandb file (W&B's LevelDB-style log: 32 KiB blocks of CRC'd chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            return  # a chunk still being written
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST extend
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir, patience_s=60.0):
    """(run record, [history rows]) of the one offline run written under run_dir.

    W&B's service process writes the file; `finish()` can return before the last records are on
    disk (seen on a loaded machine), so this waits for the exit record that closes a run."""
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + patience_s
    while True:
        run, rows, ended = None, [], False
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            ended = ended or kind == "exit"
        if ended or time.monotonic() > deadline:
            return run, rows
        time.sleep(0.2)


def test_wandb_offline_run_holds_the_logged_values_and_resumes_the_same_run(tmp_path, wandb_offline):
    log_dir = tmp_path / "grpo-tiny"
    log_dir.mkdir()
    cfg = _config(log_dir, "logger.wandb_enabled=true", "logger.wandb.project=rlscale-test")
    _log(build_sinks(log_dir, tensorboard=False, wandb=True, config=cfg), STEPS)

    (first_dir,) = (log_dir / "wandb").glob("offline-run-*")
    run_id = (log_dir / "wandb_run_id").read_text().strip()
    assert first_dir.name.endswith(run_id)
    run, rows = _wandb_run(first_dir)
    assert (run.run_id, run.project, run.display_name) == (run_id, "rlscale-test", "grpo-tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["grpo"]["max_num_steps"] == cfg.grpo.max_num_steps
    assert config["logger"]["wandb"]["project"] == "rlscale-test"
    # non-finite values are left out, never sent as NaN/inf
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]
    assert logged == [{"reward/mean": 0.25, "loss": 1.5},
                      {"reward/mean": 0.5, "loss": 1.25, "time/step_s": 2.0},
                      {"reward/mean": 0.75, "time/step_s": 3.0}]
    assert [row["_step"] for row in rows] == [1, 2, 3]

    # resumed: same run id, continuing after step 3. W&B names an offline run's folder by its id
    # and start time in whole seconds: start the second run in a later second than the first.
    time.sleep(1.01 - time.time() % 1)
    _log(build_sinks(log_dir, tensorboard=False, wandb=True, resumed_step=3, config=cfg),
         [{"reward/mean": 1.0}], first=4)
    assert (log_dir / "wandb_run_id").read_text().strip() == run_id
    (second_dir,) = set((log_dir / "wandb").glob("offline-run-*")) - {first_dir}
    run, rows = _wandb_run(second_dir)
    assert run.run_id == run_id
    assert [(row["_step"], row["reward/mean"]) for row in rows] == [(4, 1.0)]


def test_wandb_mode_defaults_to_offline_without_an_api_key(monkeypatch):
    from rlscale.telemetry.wandb_sink import resolve_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "not-a-real-key")
    assert resolve_mode(None) == "online"
    assert resolve_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode(None) == "offline"


def test_wandb_sink_never_writes_the_api_key(tmp_path, wandb_offline, monkeypatch):
    secret = "SENTINEL0wandb0key0" + "7" * 21  # 40 characters, like a real key
    monkeypatch.setenv("WANDB_API_KEY", secret)
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    cfg = _config(log_dir, "logger.wandb_enabled=true")
    _log(build_sinks(log_dir, tensorboard=False, wandb=True, config=cfg), STEPS[:1])
    (run_dir,) = (log_dir / "wandb").glob("offline-run-*")
    run, rows = _wandb_run(run_dir)  # the run fully written (so there is something to search)
    assert run is not None and len(rows) == 1
    for path in log_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


# --- MLflow -------------------------------------------------------------------------------------

def test_mlflow_file_store_holds_params_and_metrics_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    log_dir = tmp_path / "grpo-tiny"
    log_dir.mkdir()
    long_text = "{problem}" + "x" * 700
    cfg = _config(log_dir, "logger.mlflow_enabled=true", f"data.prompt_template={long_text}")
    sinks = build_sinks(log_dir, tensorboard=False, wandb=False, config=cfg)  # mlflow from the config
    tracking_uri = (log_dir / "mlruns").resolve().as_uri()  # the default: a file store in the run dir
    _log(sinks, STEPS)

    run_id = (log_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "grpo-tiny"
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlscale"
    assert run.data.params["grpo.max_num_steps"] == str(cfg.grpo.max_num_steps)
    assert run.data.params["logger.mlflow_enabled"] == "true"
    assert run.data.params["data.prompt_template"] == long_text[:500]
    assert all(len(v) <= 500 for v in run.data.params.values())

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    assert history("reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert history("loss") == [(1, 1.5), (2, 1.25)]  # inf left out
    assert history("time/step_s") == [(2, 2.0), (3, 3.0)]  # nan left out

    # resumed after step 3 with a changed config: same run, new steps appended
    cfg = _config(log_dir, "logger.mlflow_enabled=true", "grpo.max_num_steps=9")
    _log(build_sinks(log_dir, tensorboard=False, wandb=False, resumed_step=3, config=cfg),
         [{"reward/mean": 1.0}], first=4)
    assert (log_dir / "mlflow_run_id").read_text().strip() == run_id
    assert history("reward/mean") == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_settings_and_keys(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from rlscale.telemetry.mlflow_sink import flatten, sanitize_key

    assert sanitize_key("reward/mean") == "reward/mean"
    assert sanitize_key("acc@1 (val)") == "acc_1 _val_"
    assert flatten({"a": {"b": 1, "c": None, "d": [1, 2]}, "e": "s"}) == {
        "a.b": "1", "a.c": "null", "a.d": "[1, 2]", "e": "s"}

    log_dir = tmp_path / "run"
    log_dir.mkdir()
    store = (tmp_path / "elsewhere").as_uri()
    cfg = _config(log_dir, f"logger.mlflow.tracking_uri={store}", "logger.mlflow.experiment=exp1")
    _log(build_sinks(log_dir, tensorboard=False, wandb=False, mlflow=True, config=cfg),
         [{"acc@1": 0.5}])
    client = MlflowClient(store)
    run = client.get_run((log_dir / "mlflow_run_id").read_text().strip())
    assert client.get_experiment(run.info.experiment_id).name == "exp1"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "acc_1")] == [0.5]
    assert not (log_dir / "mlruns").exists()


# --- shared -------------------------------------------------------------------------------------

def test_config_sections_reject_unknown_keys_and_describe_every_field():
    with pytest.raises(UserError, match="logger.wandb.projekt"):
        load_config(None, ["logger.wandb.projekt=x"])
    with pytest.raises(UserError, match="logger.mlflow.mode"):
        load_config(None, ["logger.mlflow.mode=x"])
    with pytest.raises(UserError, match="logger.wandb.mode"):
        load_config(None, ["logger.wandb.mode=sometimes"])
    logger = Config().logger
    for section in (logger, logger.wandb, logger.mlflow):
        for name, field in type(section).model_fields.items():
            assert field.description, name
    assert (logger.wandb_enabled, logger.mlflow_enabled) == (False, False)
    assert (logger.wandb.project, logger.wandb.name, logger.wandb.mode) == ("rlscale", None, None)
    assert (logger.mlflow.tracking_uri, logger.mlflow.experiment) == (None, "rlscale")


@pytest.mark.parametrize("flag, extra", [("wandb", "rlscale[wandb]"), ("mlflow", "rlscale[mlflow]")])
def test_missing_package_is_a_one_line_user_error(tmp_path, monkeypatch, flag, extra):
    monkeypatch.setitem(sys.modules, flag, None)  # makes `import <flag>` raise ImportError
    with pytest.raises(UserError) as caught:
        build_sinks(tmp_path, tensorboard=False, wandb=flag == "wandb", mlflow=flag == "mlflow",
                    config=_config(tmp_path))
    text = str(caught.value)
    assert text.startswith(f"logger.{flag}_enabled needs the '{flag}' package") and extra in text, text
    assert "\n" not in text
    assert not (tmp_path / "metrics.jsonl").exists()
