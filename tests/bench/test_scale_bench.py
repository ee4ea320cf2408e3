"""`rlscale bench scale` on CPU: a real `rlscale train` run through Ray, with one step profiled."""

import json

from typer.testing import CliRunner

from rlscale.cli import app
from rlscale.errors import UserError


def test_profiled_step_reports_sections_and_stays_out_of_the_medians(tmp_path):
    out = tmp_path / "scale.json"
    result = CliRunner().invoke(app, [
        "bench", "scale", "--model", "tiny", "--workers", "1", "--prompts-per-worker", "2", "--generations", "2",
        "--new-tokens", "4", "--steps", "3", "--profile-step", "3", "--json", str(out),
        "--set", "policy.cpu_threads=1"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out.read_text())["runs"]
    assert run["steps_timed"] == 1  # step 1 warms up, step 3 was profiled
    sections = {call: [name for name, _ in parts] for call, parts in run["sections_ms"].items()}
    assert sections["rank0-generate"] == ["gather and sync weights", "engine generate", "end"]
    train = sections["rank0-train"]
    assert train[:2] == ["pack micro-batches", "old and reference logprobs"]
    assert train[-2:] == ["optimizer step", "end"]
    assert "micro-batch 0 forward+backward" in train
    assert all(ms >= 0 for parts in run["sections_ms"].values() for _, ms in parts)
    assert "rank0-train (ms): pack micro-batches" in result.output


def test_profile_step_needs_a_timed_step_left():
    result = CliRunner().invoke(app, ["bench", "scale", "--model", "tiny", "--steps", "2", "--profile-step", "2"])
    assert isinstance(result.exception, UserError)
    assert str(result.exception) == ("--profile-step 2 with --steps 2: the runs need at least 3 steps "
                                     "(step 1 warms up and the profiled step is not timed)")


def test_speedup_is_against_the_one_worker_run_or_none():
    from rlscale.bench.scale import add_speedups, format_table

    runs = [{"workers": 2, "tokens_per_s": 70.0, "median_step_s": 1.0, "generate_s": 0.5, "train_s": 0.5},
            {"workers": 1, "tokens_per_s": 40.0, "median_step_s": 1.0, "generate_s": 0.5, "train_s": 0.5}]
    add_speedups(runs)
    assert [r["speedup_vs_1"] for r in runs] == [1.75, 1.0]
    alone = [dict(runs[0])]
    add_speedups(alone)
    assert alone[0]["speedup_vs_1"] is None
    table = format_table({"model": "m", "device": "d", "prompts_per_worker": 1, "generations_per_prompt": 2,
                          "max_new_tokens": 3, "runs": alone})
    assert table.splitlines()[-1].endswith("     -")
