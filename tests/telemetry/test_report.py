"""`rlscale report`: rendered from a real 4-step run (made by the CLI in a subprocess, a checkpoint
every step), plus the cases with data missing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from rlscale.errors import UserError  # noqa: E402
from rlscale.telemetry.report import _fmt, report_command  # noqa: E402
from tests.integration.helpers import run_cli, train_args  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = {"reward_accuracy.png", "time_split.png", "throughput.png", "checkpoint_timeline.png",
             "checkpoint_disk.png"}


@pytest.fixture(scope="module")
def report_run(tmp_path_factory) -> Path:
    """A 4-step tiny run saving a checkpoint every step (keep_top_k=2: retention deletes some)."""
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    root = tmp_path_factory.mktemp("report_run")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, seed=0).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    run = root / "run"
    result = run_cli(*train_args(root / "model", run, 4, "checkpointing.save_period=1"), cwd=root)
    assert result.returncode == 0, result.output
    return run


def _images(html: str) -> set[str]:
    return set(re.findall(r'<img src="([^"]+)"', html))


def _assert_valid_pngs(directory: Path, names: set[str]) -> None:
    for name in names:
        data = (directory / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, f"{name} is only {len(data)} bytes"


def test_report_of_a_real_run(report_run, tmp_path):
    out = tmp_path / "copy" / "report"
    shutil.copytree(report_run, out.parent)
    index = report_command(out.parent, None)
    assert index == out / "index.html"
    html = index.read_text()
    pngs = {p.name for p in out.glob("*.png")}
    assert pngs == ALL_PLOTS  # every plot had its data
    assert _images(html) == pngs
    _assert_valid_pngs(out, pngs)
    summary = json.loads((out.parent / "summary.json").read_text())
    assert summary["final_step"] == 4
    for value in (summary["final_step"], summary["steps_run"], summary["wall_s"]):
        assert f"<td>{_fmt(value)}</td>" in html
    for name in ("accuracy", "reward_mean"):
        assert f"<th>{name}</th><td>{_fmt(summary['eval']['before'][name])}</td>" \
               f"<td>{_fmt(summary['eval']['after'][name])}</td>" in html
    assert "<title>" in html and "Held-out evaluation" in html


def test_report_into_another_directory_and_checkpoint_dir_from_config(report_run, tmp_path):
    """The checkpoint dir is where config.yaml says, not necessarily under the run dir."""
    run = tmp_path / "run"
    shutil.copytree(report_run, run)
    moved = tmp_path / "elsewhere"
    (run / "checkpoints").rename(moved)
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(re.sub(r"(?m)^(  checkpoint_dir:).*$", rf"\1 {moved}", config))
    index = report_command(run, tmp_path / "out")
    assert index == tmp_path / "out" / "index.html"
    assert "checkpoint_disk.png" in _images(index.read_text())
    assert str(moved) in index.read_text()


def test_missing_data_skips_plots_with_a_sentence(report_run, tmp_path):
    """A crashed run: no summary, no checkpoints, no validation rows, a torn last line."""
    run = tmp_path / "crashed"
    run.mkdir()
    rows = [json.loads(line) for line in (report_run / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in r.items() if not k.startswith(("ckpt/", "val/", "final/"))}
            for r in rows if "reward/mean" in r][:2]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"step": 3, "rew')
    html = report_command(run, None).read_text()
    assert _images(html) == {"reward_accuracy.png", "time_split.png", "throughput.png"}
    _assert_valid_pngs(run / "report", _images(html))
    assert "No summary.json" in html and "Metrics reach step 2" in html
    assert "No checkpoint was saved" in html and "No checkpoints were written or retained" in html
    assert "No held-out validation was logged" in html


def test_empty_metrics_renders_only_sentences(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    html = report_command(tmp_path, None).read_text()
    assert _images(html) == set() and not list((tmp_path / "report").glob("*.png"))
    assert "No training steps were logged" in html


@pytest.mark.parametrize("make", ["missing_dir", "no_metrics", "a_file"])
def test_bad_run_dir_is_one_line_user_error(tmp_path, make):
    target = tmp_path / "run"
    if make == "no_metrics":
        target.mkdir()
    elif make == "a_file":
        target.write_text("not a directory")
    with pytest.raises(UserError) as error:
        report_command(target, None)
    message = str(error.value)
    assert "\n" not in message and str(target) in message


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _write_rows(run: Path, rows: list[dict]) -> None:
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _caption(html: str, image: str) -> str:
    return re.search(rf'<img src="{image}" alt="([^"]*)"', html).group(1)


def test_a_save_logged_on_a_row_of_its_own_is_plotted(report_run, tmp_path):
    """A run stopped by a signal logs its last save on a separate row for that step (no reward);
    the report merges it into the step's row instead of missing the save."""
    run = tmp_path / "stopped"
    shutil.copytree(report_run, run)
    rows = [r for r in _rows(run) if "reward/mean" in r]
    last = rows[-1]
    save_keys = {k: v for k, v in last.items() if k.startswith("ckpt/")}
    assert "ckpt/bytes" in save_keys
    stripped = [{k: v for k, v in r.items() if not k.startswith("ckpt/")} for r in rows]
    _write_rows(run, stripped + [{"step": last["step"], **save_keys}])
    html = report_command(run, None).read_text()
    assert "checkpoint_timeline.png" in _images(html)  # was "No checkpoint was saved"


def test_a_retried_step_replaces_the_earlier_attempt(tmp_path):
    """A step logged twice (a crash, then a resume before it): the later attempt's row counts, and
    a save row of the first attempt does not leak into it."""
    from rlscale.telemetry.report import _train_rows

    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2, "ckpt/bytes": 10},
            {"step": 2, "ckpt/committed_step": 2, "ckpt/persist_s": 1.0},
            {"step": 2, "reward/mean": 0.25}, {"step": 2, "ckpt/stall_s": 0.5}]
    merged = _train_rows(rows)
    assert [r["step"] for r in merged] == [1, 2]
    assert merged[1] == {"step": 2, "reward/mean": 0.25, "ckpt/stall_s": 0.5}


def test_a_commit_not_logged_is_checked_on_disk(report_run, tmp_path):
    """kill -9 after a save committed but before its commit was logged: the report says the step is
    committed (its dir is there); with the dir gone, that it is not in the checkpoint dir."""
    from rlscale.ckpt.layout import committed_steps

    run = tmp_path / "killed"
    shutil.copytree(report_run, run)
    newest, newest_dir = committed_steps(run / "checkpoints")[-1]
    rows = [r for r in _rows(run) if r.get("ckpt/committed_step") != newest]
    _write_rows(run, rows)
    caption = _caption(report_command(run, None).read_text(), "checkpoint_timeline.png")
    assert f"Committed, but its persist time was not logged: step {newest}." in caption
    assert "Not committed" not in caption
    shutil.rmtree(newest_dir)
    caption = _caption(report_command(run, None).read_text(), "checkpoint_timeline.png")
    assert f"Not committed in {run / 'checkpoints'}: step {newest} " in caption
    shutil.rmtree(run / "checkpoints")  # a run directory copied without its checkpoints
    caption = _caption(report_command(run, None).read_text(), "checkpoint_timeline.png")
    assert f"{run / 'checkpoints'} is not here to say whether it committed" in caption
    assert "Not committed" not in caption
