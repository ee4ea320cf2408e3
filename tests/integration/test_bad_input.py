"""Bad input stops `rlscale` with one line on stderr, exit code 2, no traceback, nothing half-written.

Each case starts from a valid tiny run (see conftest.TINY_RUN) and breaks exactly one thing, so
the error seen is the one under test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.integration.helpers import run_cli, train_args


def assert_one_line_error(result, *names: str) -> str:
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("rlscale: error: "), line
    for name in names:
        assert name in line, f"{name!r} not named in: {line}"
    return line


def assert_nothing_half_written(root: Path) -> None:
    leftovers = [p for p in root.rglob("*")
                 if p.name in ("summary.json", "metrics.jsonl") or p.name.startswith(("step_", "tmp_step_"))]
    assert not leftovers, leftovers


# Each case: tmp dir, tiny model dir -> (extra CLI arguments, strings the error names, what may
# exist under the run directory afterwards: None = not even the directory).
def _unknown_key(tmp, model):
    return ["grpo.max_num_stepz=3"], ["unknown config key 'grpo.max_num_stepz'"], None


def _unknown_key_in_file(tmp, model):
    (tmp / "run.yaml").write_text("grpo:\n  max_num_steps: 3\n  num_prompts_per_stepz: 4\n")
    return ["--config", str(tmp / "run.yaml")], ["'grpo.num_prompts_per_stepz'"], None


def _wrong_type(tmp, model):
    return ["grpo.max_num_steps=three"], ["'grpo.max_num_steps'", "integer", "'three'"], None


def _wrong_type_in_file(tmp, model):
    (tmp / "run.yaml").write_text("policy:\n  optimizer:\n    weight_decay: heavy\n")  # a key TINY_RUN leaves alone
    return ["--config", str(tmp / "run.yaml")], ["'policy.optimizer.weight_decay'", "'heavy'"], None


def _out_of_range(tmp, model):
    return ["grpo.num_generations_per_prompt=1"], ["'grpo.num_generations_per_prompt'"], None


def _batch_not_dividing(tmp, model):
    return ["policy.train_global_batch_size=6"], ["policy.train_global_batch_size=6", "= 16"], None


def _malformed_override(tmp, model):
    return ["grpo.max_num_steps"], ["'grpo.max_num_steps'", "key.sub=value"], None


def _malformed_yaml(tmp, model):
    (tmp / "broken.yaml").write_text("grpo:\n  max_num_steps: [3,\n  seed: 1\n")
    return ["--config", str(tmp / "broken.yaml")], ["broken.yaml", "not valid YAML"], None


def _yaml_not_a_mapping(tmp, model):
    (tmp / "list.yaml").write_text("- grpo\n- policy\n")
    return ["--config", str(tmp / "list.yaml")], ["list.yaml", "mapping"], None


def _missing_config_file(tmp, model):
    return ["--config", str(tmp / "nowhere.yaml")], ["nowhere.yaml"], None


def _unknown_dataset(tmp, model):
    return ["data.dataset_name=NoSuchSet"], ["data.dataset_name", "'NoSuchSet'"], None


def _jsonl_missing_field(tmp, model):
    rows = [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}, {"problem": "3+3"}]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (["data.dataset_name=jsonl", f"data.train_path={tmp / 'train.jsonl'}", "data.val_size=1"],
            ["train.jsonl", "line 3", "'answer'"], None)


def _jsonl_missing_file(tmp, model):
    return (["data.dataset_name=jsonl", f"data.train_path={tmp / 'absent.jsonl'}"],
            ["absent.jsonl", "does not exist"], None)


def _model_path_missing(tmp, model):
    return [f"policy.model_name={tmp / 'no_such_model'}"], ["policy.model_name", "no_such_model", "does not exist"], None


def _model_dir_without_config(tmp, model):
    (tmp / "empty_model").mkdir()
    return [f"policy.model_name={tmp / 'empty_model'}"], ["empty_model", "config.json"], None


def _model_weights_corrupt(tmp, model):
    shutil.copytree(model, tmp / "corrupt_model")
    (tmp / "corrupt_model" / "model.safetensors").write_bytes(b"\x00 not safetensors " * 10)
    return [f"policy.model_name={tmp / 'corrupt_model'}"], ["cannot load model", "corrupt_model"], None


def _checkpoint_dir_under_a_file(tmp, model):
    (tmp / "a_file").write_text("not a directory\n")
    return ([f"checkpointing.checkpoint_dir={tmp / 'a_file' / 'ckpt'}"],
            ["checkpointing.checkpoint_dir", "a_file", "not writable"], None)


def _log_dir_under_a_file(tmp, model):
    (tmp / "a_file").write_text("not a directory\n")
    return [f"logger.log_dir={tmp / 'a_file' / 'run'}"], ["logger.log_dir", "a_file", "not writable"], None


def _reward_spec_malformed(tmp, model):
    return ["rewards.function=score_it"], ["rewards.function 'score_it'", "module:function"], None


def _reward_module_missing(tmp, model):
    return ["rewards.function=no_such_reward_module:score"], ["rewards.function", "no_such_reward_module"], None


def _reward_not_callable(tmp, model):
    return (["rewards.function=tests.integration.rewards_for_tests:NOT_CALLABLE"],
            ["rewards.function", "NOT_CALLABLE", "not callable"], None)


def _resume_not_a_step_dir(tmp, model):
    return ["checkpointing.resume=maybe"], ["checkpointing.resume: 'maybe' does not exist", "expected auto, never"], \
        None


def _resume_step_missing(tmp, model):  # refused before the run directory is made or the model loaded
    return [f"checkpointing.resume={tmp / 'elsewhere' / 'step_7'}"], ["checkpointing.resume", "does not exist"], None


CASES = {fn.__name__.lstrip("_"): fn for fn in [
    _unknown_key, _unknown_key_in_file, _wrong_type, _wrong_type_in_file, _out_of_range, _batch_not_dividing,
    _malformed_override, _malformed_yaml, _yaml_not_a_mapping, _missing_config_file, _unknown_dataset,
    _jsonl_missing_field, _jsonl_missing_file, _model_path_missing, _model_dir_without_config,
    _model_weights_corrupt, _checkpoint_dir_under_a_file, _log_dir_under_a_file, _reward_spec_malformed,
    _reward_module_missing, _reward_not_callable, _resume_not_a_step_dir, _resume_step_missing,
]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line_and_writes_nothing(case, tmp_path, tiny_model):
    extra, names, may_exist = CASES[case](tmp_path, tiny_model)
    run_dir = tmp_path / "run"
    args = train_args(tiny_model, run_dir, 3)
    if "--config" in extra:  # a config file goes before the overrides, as a user would write it
        args = ["train", *extra[:2], *args[1:], *extra[2:]]
    else:
        args += extra
    result = run_cli(*args, cwd=tmp_path)
    assert_one_line_error(result, *names)
    assert_nothing_half_written(tmp_path)
    if may_exist is None:
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    else:
        assert {p.name for p in run_dir.iterdir()} <= may_exist
        if (run_dir / "checkpoints").exists():
            assert not any((run_dir / "checkpoints").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_checkpoint_dir(tmp_path, tiny_model):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        result = run_cli(*train_args(tiny_model, tmp_path / "run", 3, f"checkpointing.checkpoint_dir={locked}"),
                         cwd=tmp_path)
    finally:
        locked.chmod(0o700)
    assert_one_line_error(result, "checkpointing.checkpoint_dir", "locked")
    assert_nothing_half_written(tmp_path)


def test_dry_run_rejects_an_unknown_dataset(tmp_path):
    result = run_cli("train", "--dry-run", "data.dataset_name=NoSuchSet", cwd=tmp_path)
    assert_one_line_error(result, "data.dataset_name", "'NoSuchSet'")


@pytest.mark.parametrize("args, names", [
    (["--checkpoint", "{tmp}/checkpoints/step_9"], ["step_9", "not usable"]),
    (["--checkpoint", "{tmp}/damaged/step_2"], ["step_2", "manifest.json"]),
    (["--model", "{tmp}/no_such_model"], ["no_such_model", "does not exist"]),
    (["--model", "{model}", "--checkpoint", "{tmp}/damaged/step_2"], ["--model or --checkpoint"]),
    (["--model", "{model}", "--k", "4", "--temperature", "0"], ["--temperature"]),
], ids=["missing-checkpoint", "damaged-checkpoint", "missing-model", "model-and-checkpoint", "greedy-pass-at-k"])
def test_eval_bad_input(args, names, tmp_path, tiny_model):
    (tmp_path / "damaged" / "step_2" / "policy").mkdir(parents=True)  # no manifest: never committed
    args = [a.format(tmp=tmp_path, model=tiny_model) for a in args]
    result = run_cli("eval", *args, "--limit", "4", cwd=tmp_path)
    assert_one_line_error(result, *names)


def test_resuming_another_models_checkpoint(tmp_path, resumed_run):
    """A run directory whose checkpoints belong to a different model: one line, nothing changed."""
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    assert resumed_run["first"]["returncode"] == 0, "the training run failed"
    run = tmp_path / "run"
    shutil.copytree(resumed_run["after_first"], run)
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=48, layers=2, heads=2).save_pretrained(tmp_path / "wider")
    tokenizer.save_pretrained(tmp_path / "wider")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "config.yaml"}
    result = run_cli(*train_args(tmp_path / "wider", run, 5), cwd=tmp_path)
    assert_one_line_error(result, "step_3", "does not match the model", "size mismatch")
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "config.yaml"}
    assert after == before  # checkpoints, metrics and summary untouched
