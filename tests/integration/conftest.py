"""Fixtures of the integration tests: a tiny model built here (nothing is downloaded) and
training runs made once per test session.

Under `pytest -n 2` every xdist worker has its own session; the expensive artefacts (the tiny
model, the training runs) are still made once, in the directory the workers share, under a file
lock: the first worker to ask builds, the other waits and reuses.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.integration.helpers import run_cli, train_args

# ---------------------------------------------------------------- made once per session


def _shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # xdist workers get <session>/popen-gwN; the session directory is what they share.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(tmp_path_factory, name: str, build) -> dict:
    """Run build(directory) -> JSON-able dict once per test session, across xdist workers."""
    root = _shared_root(tmp_path_factory)
    directory, record = root / name, root / f"{name}.json"
    with _exclusive(root / f"{name}.lock"):
        if not record.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            record.write_text(json.dumps(build(directory)))
    return json.loads(record.read_text())


def _build_tiny_model(directory: Path) -> dict:
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, seed=0)
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    return {"path": str(directory / "model")}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 2-layer, hidden-32 Qwen2 with the character tokenizer, as an HF directory."""
    return Path(build_once(tmp_path_factory, "tiny_model", _build_tiny_model)["path"])


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, tiny_model) -> dict:
    """3 GRPO steps, a copy of the run directory as it stood then, then a restart to 5 steps."""

    def build(directory: Path) -> dict:
        run = directory / "run"
        first = run_cli(*train_args(tiny_model, run, 3), cwd=directory)
        if run.exists():  # checkpoint retention deletes step_2 and step_3 during the restart
            shutil.copytree(run, directory / "after_first")
        second = run_cli(*train_args(tiny_model, run, 5), cwd=directory) if first.returncode == 0 else None
        return {"dir": str(directory), "run": str(run), "after_first": str(directory / "after_first"),
                "first": asdict(first), "second": asdict(second) if second else None}

    return build_once(tmp_path_factory, "resumed_run", build)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory, tiny_model) -> dict:
    """The same 5 steps as `resumed_run` without a restart, plus greedy validation every 2 steps
    (which must not disturb training), TensorBoard and a Prometheus endpoint on a free port."""

    def build(directory: Path) -> dict:
        run = directory / "run"
        result = run_cli(*train_args(tiny_model, run, 5, "grpo.val_period=2", "logger.tensorboard_enabled=true",
                                     "logger.prometheus_port=0"), cwd=directory)
        return {"dir": str(directory), "run": str(run), "result": asdict(result)}

    return build_once(tmp_path_factory, "straight_run", build)


@pytest.fixture(scope="session")
def crash_resumed_run(tmp_path_factory, tiny_model, resumed_run) -> dict:
    """The first 3-step run of `resumed_run` as if it had crashed while saving step 3: step_3
    damaged, a stale tmp_step_4 left behind. Restarted with grpo.max_num_steps=4."""

    def build(directory: Path) -> dict:
        run = directory / "run"
        shutil.copytree(resumed_run["after_first"], run)
        weights = sorted((run / "checkpoints" / "step_3" / "policy").glob("model-*.safetensors"))[0]
        weights.write_bytes(weights.read_bytes()[:1000])  # shorter than its manifest says
        (run / "checkpoints" / "tmp_step_4").mkdir()
        (run / "checkpoints" / "tmp_step_4" / "half_written.bin").write_bytes(b"x" * 10)
        result = run_cli(*train_args(tiny_model, run, 4), cwd=directory)
        return {"dir": str(directory), "run": str(run), "result": asdict(result)}

    return build_once(tmp_path_factory, "crash_resumed_run", build)
