import json
import os
import shutil

import pytest

from rlscale.bench import io as bench_io
from rlscale.bench.io import format_table, io_command, recommend_stripe, recommend_writers, writer_counts
from rlscale.errors import UserError


def rows(*pairs):
    return [{"writers": n, "write_GBps": gbps} for n, gbps in pairs]


def test_writer_counts():
    assert writer_counts(1) == [1]
    assert writer_counts(4) == [1, 2, 4]
    assert writer_counts(6) == [1, 2, 4, 6]


def test_recommend_writers_stops_where_gain_is_under_ten_percent():
    assert recommend_writers(rows((1, 1.0), (2, 1.9), (4, 2.0), (8, 3.0))) == 2  # 2->4 adds 5%
    assert recommend_writers(rows((1, 1.0), (2, 1.5), (4, 2.0))) == 4  # every doubling pays
    assert recommend_writers(rows((1, 1.0), (2, 1.09))) == 1
    assert recommend_writers(rows((1, 1.0), (2, 1.11))) == 2
    assert recommend_writers(rows((4, 2.0), (1, 1.0), (2, 0.8))) == 1  # order-free; slower is no gain
    assert recommend_writers(rows((1, 1.0))) == 1


def test_recommend_stripe():
    assert recommend_stripe(16, 4) == 4
    assert recommend_stripe(2, 8) == 2
    assert recommend_stripe(None, 4) == 4


def test_io_command_on_tmp_path(tmp_path):
    target = tmp_path / "fs"
    target.mkdir()
    out_json = tmp_path / "io.json"
    out = io_command(target, max_writers=2, file_size_mb=1, total_gb=0.008, json_file=out_json)
    assert [row["writers"] for row in out["results"]] == [1, 2]
    for row in out["results"]:
        assert row["write_GBps"] > 0 and row["read_GBps"] > 0 and row["seconds"] > 0
    assert out["files_per_trial"] == 8 and out["bytes_per_trial"] == 8 << 20
    assert out["recommendation"]["writers_per_rank"] in (1, 2)
    text = format_table(out)
    assert "checkpointing.writers_per_rank=" in text
    if shutil.which("lfs") is None:
        assert "lfs is absent" in text
    assert out["fs_type"] and out["date"] and out["path"] == str(target.resolve())
    assert json.loads(out_json.read_text())["results"] == out["results"]
    assert list(target.iterdir()) == []  # nothing left behind


def test_cleans_up_on_error(tmp_path, monkeypatch):
    def broken(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bench_io, "_trial", broken)
    with pytest.raises(UserError, match="No space left"):
        io_command(tmp_path, 2, 1, 0.004, None)
    assert list(tmp_path.iterdir()) == []


def test_bad_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not an existing directory"):
        io_command(tmp_path / "missing", 2, 1, 0.004, None)
    with pytest.raises(UserError):
        io_command(tmp_path, 0, 1, 0.004, None)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="not writable"):
            io_command(locked, 2, 1, 0.004, None)
