"""Bench options are checked before anything is built or written."""

import pytest
from typer.testing import CliRunner

from rlscale.cli import app
from rlscale.errors import UserError


@pytest.mark.parametrize("args, message", [
    (["bench", "ckpt", "--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda"),
    (["bench", "train", "--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda"),
    (["bench", "scale", "--workers", "2", "--workers", "0"], "--workers 0: a run needs at least one worker"),
])
def test_bad_bench_options_are_user_errors(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError) and str(result.exception) == message
    assert list(tmp_path.iterdir()) == []  # nothing built or written first
