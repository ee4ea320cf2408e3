"""Bench options are checked before anything is built or written."""

import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlscale.cli import app
from rlscale.errors import UserError


@pytest.mark.parametrize("args, message", [
    (["bench", "ckpt", "--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda"),
    (["bench", "ckpt", "--ranks", "2", "--grpo-steps", "1"], "--grpo-steps runs with one rank only (leave out --ranks)"),
    (["bench", "ckpt", "--ranks", "2", "--model", "qwen9"], "--model 'qwen9': known models are qwen2-0.5b, qwen2-1.5b"),
    (["bench", "train", "--device", "tpu"], "--device 'tpu': choose auto, cpu or cuda"),
    (["bench", "scale", "--workers", "2", "--workers", "0"], "--workers 0: a run needs at least one worker"),
    (["bench", "mem", "--model", "qwen2-0.5b", "--model", "qwen9"],
     "--model 'qwen9': choose one of tiny, qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen2.5-14b"),
    (["bench", "step", "--compare-set", "policy.master_weights=bf16"], "--compare-set needs --pairs N"),
    (["bench", "step", "--pairs", "3", "--only", "trl"],
     "--pairs runs both halves unprofiled: leave out --only and --profile-step"),
    (["bench", "train", "--model", "qwen9"],
     "--model 'qwen9': choose one of tiny, qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen2.5-14b"),
    (["bench", "gen", "--lengths", "zipf"], "--lengths 'zipf': choose fixed, geometric or lognormal"),
    (["bench", "gen", "--mean-tokens", "32"],
     "--mean-tokens needs --lengths geometric or lognormal (fixed: every response --new-tokens)"),
    (["bench", "gen", "--lengths", "geometric", "--mean-tokens", "300"],
     "--mean-tokens 300: the mean response length must be 1..256 (--new-tokens, the cap)"),
    (["bench", "gen", "--lengths", "lognormal", "--new-tokens", "16", "--mean-tokens", "0.5"],
     "--mean-tokens 0.5: the mean response length must be 1..16 (--new-tokens, the cap)"),
    (["bench", "gen", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization 1.5: expected a fraction F with 0 < F <= 1"),
    (["bench", "gen", "--gpu-memory-utilization", "0"],
     "--gpu-memory-utilization 0: expected a fraction F with 0 < F <= 1"),
])
def test_bad_bench_options_are_user_errors(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError) and str(result.exception) == message
    assert list(tmp_path.iterdir()) == []  # nothing built or written first


def test_bench_mem_hands_its_options_to_mem_command_and_prints_its_table(monkeypatch):
    calls = []
    mem = types.ModuleType("rlscale.bench.mem")  # stands in for the module, whether or not it exists
    mem.mem_command = lambda models, steps, overrides, json_file: calls.append(
        (models, steps, overrides, json_file)) or {"rows": 1}
    mem.format_table = lambda result: f"table of {result}"
    monkeypatch.setitem(sys.modules, "rlscale.bench.mem", mem)
    result = CliRunner().invoke(app, ["bench", "mem"])
    assert result.exit_code == 0, result.output
    assert calls == [(["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"], 2, [], None)]
    assert result.output == "table of {'rows': 1}\n"
    result = CliRunner().invoke(app, ["bench", "mem", "--model", "tiny", "--steps", "3", "--set", "a.b=1",
                                      "--set", "c=2", "--json", "m.json"])
    assert result.exit_code == 0, result.output
    assert calls[1] == (["tiny"], 3, ["a.b=1", "c=2"], Path("m.json"))
