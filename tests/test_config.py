"""The config tree: dotted overrides, validation messages, derived sizes, the key reference."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from rlscale.config import Config, derive_sizes, iter_reference
from rlscale.config_loading import load_config, parse_override, read_yaml_mapping
from rlscale.errors import UserError, validation_message
from tests.integration.helpers import SEED_OVERRIDES

# 256 samples per step, 128 per optimizer step, independent of the defaults
TWO_STEPS = ["grpo.num_prompts_per_step=32", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=128"]


def _get(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# ---------------------------------------------------------------- override typing


@pytest.mark.parametrize("override, expected", [
    ("grpo.max_num_steps=20", 20),
    ("grpo.seed=-3", -3),
    ("policy.optimizer.lr=1e-6", 1e-6),  # YAML 1.1 reads 1e-6 as text; the float field converts it
    ("policy.optimizer.lr=3.0e-6", 3e-6),
    ("policy.optimizer.lr=0.5", 0.5),
    ("rewards.timeout_s=2", 2.0),
    ("policy.max_grad_norm=null", None),
    ("policy.max_grad_norm=1e-3", 1e-3),
    ("checkpointing.enabled=True", True),
    ("checkpointing.enabled=false", False),
    ("logger.progress=no", False),
    ("checkpointing.metric_name=null", None),
    ("checkpointing.metric_name=val/accuracy", "val/accuracy"),
    ("checkpointing.keep_top_k=null", None),
    ('policy.generation.stop_strings=[</answer>, "\\n\\n"]', ["</answer>", "\n\n"]),  # YAML escapes
    ("policy.optimizer.betas=[0.9, 0.95]", (0.9, 0.95)),
    ("policy.model_name=Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-72B-Instruct"),
    ("checkpointing.checkpoint_dir=/lustre/run/", "/lustre/run/"),
    ("rewards.function=my_rewards:score", "my_rewards:score"),
    # string keys keep the text as typed, whatever YAML would make of it
    ("data.prompt_template={problem}", "{problem}"),
    ("data.prompt_template=Q: {problem} A:", "Q: {problem} A:"),
    ("data.hf_subset=2023", "2023"),
    ("data.prompt_key=1", "1"),
    ("data.arithmetic.operations=-", "-"),
    ("data.arithmetic.operations=+-*", "+-*"),
    ("data.hf_subset=null", None),  # an optional string can still be unset
    ("+grpo.max_num_steps=7", 7),  # Hydra's "+" prefix is accepted
])
def test_override_values_are_typed(override, expected):
    # the hub dataset, so that its keys (hf_subset, prompt_key) are ones the dataset uses
    cfg = load_config(None, ["data.dataset_name=gsm8k", override])
    value = _get(cfg, override.lstrip("+").partition("=")[0])
    assert value == expected
    assert type(value) is type(expected)


def test_later_overrides_win_and_the_file_is_the_base(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("grpo:\n  max_num_steps: 7\n  seed: 5\npolicy:\n  optimizer:\n    lr: 1.0e-5\n")
    cfg = load_config(path, ["grpo.max_num_steps=9", "grpo.max_num_steps=11"])
    assert cfg.grpo.max_num_steps == 11
    assert cfg.grpo.seed == 5
    assert cfg.policy.optimizer.lr == 1e-5
    assert cfg.policy.optimizer.betas == (0.9, 0.999)  # untouched keys keep their defaults


def test_empty_file_means_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml").to_dict() == Config().to_dict()


def test_parse_override_splits_at_the_first_equals_sign():
    assert parse_override("data.prompt_template={problem}=") == ("data.prompt_template", "{problem}=")
    assert parse_override("grpo.max_num_steps=20") == ("grpo.max_num_steps", 20)
    assert parse_override("logger.log_dir=") == ("logger.log_dir", "")


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("overrides, message", [
    (["grpo.max_num_stepz=3"], "unknown config key 'grpo.max_num_stepz'"),
    (["grpoo.max_num_steps=3"], "unknown config key 'grpoo'"),
    (["policy.optimizer.learning_rate=1e-5"], "unknown config key 'policy.optimizer.learning_rate'"),
    (["grpo.max_num_steps=three"],
     "config key 'grpo.max_num_steps': input should be a valid integer, unable to parse string as an "
     "integer (got 'three')"),
    (["grpo.max_num_steps=0"], "config key 'grpo.max_num_steps': input should be greater than or equal to 1 (got 0)"),
    (["policy.dtype=float8"], "config key 'policy.dtype'"),
    (["grpo.max_num_steps"], "override 'grpo.max_num_steps' is not of the form key.sub=value"),
    (["grpo..seed=1"], "override 'grpo..seed=1' is not of the form key.sub=value"),
    (["grpo.max_num_steps=3", "grpo.max_num_steps.x=1"], "override 'grpo.max_num_steps.x': 'max_num_steps' is a value"),
    (["logger.wandb.mode=sometimes"],
     "config key 'logger.wandb.mode': input should be 'online', 'offline' or 'disabled' "
     "(got 'sometimes')"),
    (["logger.mlflow.experimnt=x"], "unknown config key 'logger.mlflow.experimnt'"),
    (["grpo.seed=99999999999999999999999"],
     "config key 'grpo.seed': input should be less than or equal to 4611686018427387904 (got 99999999999999999999999)"),
    (["policy.optimizer.lr=.inf"], "config key 'policy.optimizer.lr': input should be a finite number (got inf)"),
    (["policy.optimizer.betas=[0.9,5]"], "config key 'policy.optimizer.betas.1': input should be less than 1 (got 5)"),
    (["logger.log_dir="], "config key 'logger.log_dir': string should have at least 1 character (got '')"),
    (["checkpointing.enabled=false", "checkpointing.resume=/ckpt/step_8"],
     "config: checkpointing.resume=/ckpt/step_8 needs checkpointing.enabled=true"),
    (TWO_STEPS + ["policy.train_global_batch_size=100"],
     "config: policy.train_global_batch_size=100 must divide grpo.num_prompts_per_step × grpo.num_generations_per_prompt = 256"),
    (["policy.generation.tensor_parallel_size=0"],
     "config key 'policy.generation.tensor_parallel_size': input should be greater than or equal to 1 (got 0)"),
    (["cluster.gpus_per_node=4", "policy.train_global_batch_size=8", "policy.generation.tensor_parallel_size=3"],
     "config: policy.generation.tensor_parallel_size=3 must divide cluster.gpus_per_node=4 (a group of 3 consecutive "
     "ranks generates together on one node, never across nodes)"),
    (["policy.generation.tensor_parallel_size=2"],  # one GPU
     "config: policy.generation.tensor_parallel_size=2 must divide cluster.gpus_per_node=1"),
    ([*SEED_OVERRIDES, "policy.generation.tensor_parallel_size=16"],  # 8 nodes of 8: a group would span two
     "config: policy.generation.tensor_parallel_size=16 must divide cluster.gpus_per_node=8"),
    (["cluster.gpus_per_node=2", "policy.generation.tensor_parallel_size=2", "policy.generation.backend=hf"],
     "config: policy.generation.tensor_parallel_size=2 needs policy.generation.backend=engine (backend=hf: "
     "transformers generate holds the whole model on each GPU)"),
    (["cluster.gpus_per_node=2", "policy.generation.vllm_cfg.tensor_parallel_size=2",
      "policy.generation.tensor_parallel_size=1"],
     "config key 'policy.generation': policy.generation.vllm_cfg.tensor_parallel_size=2 and "
     "policy.generation.tensor_parallel_size=1 disagree (they are one setting: give one)"),
    (["policy.generation.vllm_cfg.enforce_eagr=true"],  # NeMo-RL's vLLM keys are accepted (tests/test_nemo_recipes.py)
     "unknown config key 'policy.generation.vllm_cfg.enforce_eagr'"),
    (["policy.generation.vllm_cfg.gpu_memory_utilization=0.6", "policy.generation.gpu_memory_utilization=0.5"],
     "config key 'policy.generation': policy.generation.vllm_cfg.gpu_memory_utilization=0.6 and "
     "policy.generation.gpu_memory_utilization=0.5 disagree (they are one setting: give one)"),
    (["policy.generation.gpu_memory_utilization=1.5"],
     "config key 'policy.generation.gpu_memory_utilization': input should be less than or equal to 1"),
    (["policy.generation.vllm_cfg.tensor_parallel_size=two"],
     "config key 'policy.generation.tensor_parallel_size': input should be a valid integer"),
])
def test_errors_name_the_key(overrides, message):
    with pytest.raises(UserError) as caught:
        load_config(None, overrides)
    text = str(caught.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_tensor_parallel_size_and_its_nemo_rl_name(tmp_path):
    assert load_config(None, []).policy.generation.tensor_parallel_size == 1
    on_8 = [*SEED_OVERRIDES]  # 8 nodes of 8 GPUs
    assert load_config(None, [*on_8, "policy.generation.tensor_parallel_size=8"]).policy.generation \
        .tensor_parallel_size == 8
    assert load_config(None, [*on_8, "policy.generation.vllm_cfg.tensor_parallel_size=4"]).policy.generation \
        .tensor_parallel_size == 4
    both = [*on_8, "policy.generation.vllm_cfg.tensor_parallel_size=8", "policy.generation.tensor_parallel_size=8"]
    assert load_config(None, both).policy.generation.tensor_parallel_size == 8  # the same value twice
    # a NeMo-RL config's section, as its YAML writes it; the resolved config names rlscale's key only
    path = tmp_path / "nemo.yaml"
    path.write_text("cluster:\n  gpus_per_node: 8\npolicy:\n  train_global_batch_size: 8\n  generation:\n"
                    "    vllm_cfg:\n      tensor_parallel_size: 2\n")
    cfg = load_config(path)
    assert cfg.policy.generation.tensor_parallel_size == 2
    assert "vllm_cfg" not in cfg.to_dict()["policy"]["generation"]
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml") == cfg
    path.write_text("policy:\n  generation:\n    vllm_cfg: null\n")
    assert load_config(path).policy.generation.tensor_parallel_size == 1


def test_gpu_memory_utilization_and_its_nemo_rl_name():
    assert load_config(None, []).policy.generation.gpu_memory_utilization is None
    assert load_config(None, ["policy.generation.gpu_memory_utilization=0.6"]).policy.generation \
        .gpu_memory_utilization == 0.6
    cfg = load_config(None, ["policy.generation.vllm_cfg.gpu_memory_utilization=0.6",
                             "policy.generation.vllm_cfg.tensor_parallel_size=1"])
    assert cfg.policy.generation.gpu_memory_utilization == 0.6
    assert "vllm_cfg" not in cfg.to_dict()["policy"]["generation"]


def _model_dir(tmp_path, **changes):
    """A local model directory with a Qwen2 config.json (no weights: the checks read only the shape)."""
    config = {"model_type": "qwen2", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
              "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 1000, **changes}
    path = tmp_path / "-".join(f"{k}{v}" for k, v in changes.items())
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("changes, size, message", [
    ({"num_attention_heads": 12, "num_key_value_heads": 12}, 8,
     "policy.generation.tensor_parallel_size=8 must divide the attention heads of {model} (num_attention_heads=12)"),
    ({"num_key_value_heads": 3, "num_attention_heads": 12}, 2,
     "policy.generation.tensor_parallel_size=2 and the KV heads of {model} (num_key_value_heads=3) must divide one "
     "another (each rank holds kv heads / T of them, or one of them replicated)"),
    ({"intermediate_size": 2820}, 8,
     "policy.generation.tensor_parallel_size=8 must divide the intermediate size of {model} (intermediate_size=2820)"),
    ({"model_type": "gpt_neox"}, 2,
     "policy.generation.tensor_parallel_size=2 needs the rollout engine, which does not run {model} (model type "
     "'gpt_neox'; it would fall back to transformers generate)"),
])
def test_tensor_parallel_size_must_split_the_model(tmp_path, changes, size, message):
    """The shape's checks: where the memory plan reads config.json (a dry run, a run's start)."""
    from rlscale import memory_plan

    model = _model_dir(tmp_path, **changes)
    cfg = load_config(None, [f"policy.model_name={model}", "cluster.gpus_per_node=8",
                             "policy.train_global_batch_size=8", f"policy.generation.tensor_parallel_size={size}",
                             "cluster.gpu_memory_gb=80"])
    with pytest.raises(UserError) as caught:
        memory_plan.plan_for(cfg)
    assert str(caught.value) == message.format(model=model)
    # 8 kv heads over 8 ranks, or 4 over 8 (each rank keeps one, replicated): both split
    for kv in (8, 4):
        fine = load_config(None, [f"policy.model_name={_model_dir(tmp_path, num_key_value_heads=kv)}",
                                  "cluster.gpus_per_node=8", "policy.train_global_batch_size=8",
                                  "policy.generation.tensor_parallel_size=8", "cluster.gpu_memory_gb=80"])
        assert memory_plan.plan_for(fine).tensor_parallel_size == 8


def test_the_removed_decode_span_bucket_is_refused_in_one_line_naming_it(tmp_path):
    removed = ("config key 'policy.generation': policy.generation.decode_span_bucket was removed: the compiled "
               "decode graph replaced it (flex attention reads only each sequence's live cache blocks); drop the key")
    with pytest.raises(UserError) as caught:
        load_config(None, ["policy.generation.decode_span_bucket=64"])
    assert str(caught.value) == removed
    path = tmp_path / "spans.yaml"
    path.write_text("policy:\n  generation:\n    decode_span_bucket: 64\n")
    with pytest.raises(UserError) as caught:
        load_config(path)
    assert str(caught.value) == removed
    # its old default, in every older run's resolved config.yaml, is what the engine does now
    path.write_text("policy:\n  generation:\n    decode_span_bucket: null\n")
    assert "decode_span_bucket" not in load_config(path).to_dict()["policy"]["generation"]


def test_stop_token_ids_from_an_override_and_a_nemo_rl_recipe(tmp_path):
    assert load_config(None, []).policy.generation.stop_token_ids is None
    assert load_config(None, ["policy.generation.stop_token_ids=[151645,151643]"]).policy.generation \
        .stop_token_ids == [151645, 151643]
    # as NeMo-RL's recipes write it; the resolved config round-trips it
    path = tmp_path / "recipe.yaml"
    path.write_text("policy:\n  generation:\n    temperature: 1.0\n    stop_token_ids: [128001, 128008, 128009]\n")
    cfg = load_config(path)
    assert cfg.policy.generation.stop_token_ids == [128001, 128008, 128009]
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml") == cfg
    path.write_text("policy:\n  generation:\n    stop_token_ids: null\n")
    assert load_config(path).policy.generation.stop_token_ids is None
    with pytest.raises(UserError, match="policy.generation.stop_token_ids"):
        load_config(None, ["policy.generation.stop_token_ids=[-1]"])


def test_bad_files_are_user_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("grpo: [1,\n")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(UserError, match=r"config file '.*bad.yaml' is not valid YAML at line 2"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(UserError, match=r"config file '.*list.yaml' must hold a mapping of sections"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(UserError, match=r"cannot read config file '.*absent.yaml': No such file or directory"):
        load_config(tmp_path / "absent.yaml")
    (tmp_path / "twice.yaml").write_text("grpo:\n  seed: 1\npolicy:\n  dtype: auto\ngrpo:\n  max_num_steps: 3\n")
    with pytest.raises(UserError, match=r"config file '.*twice.yaml': key 'grpo' appears twice in one mapping \(line 5\)"):
        load_config(tmp_path / "twice.yaml")
    (tmp_path / "merge.yaml").write_text("base: &b {seed: 1}\ngrpo:\n  <<: *b\n  seed: 2\n")  # a merge may override
    assert read_yaml_mapping(tmp_path / "merge.yaml", "file")["grpo"] == {"seed": 2}
    (tmp_path / "utf16.yaml").write_bytes(b"\xff\xfeg\x00")
    with pytest.raises(UserError, match=r"config file '.*utf16.yaml' is not UTF-8 text \(byte 0\)"):
        load_config(tmp_path / "utf16.yaml")


# ---------------------------------------------------------------- derived sizes


def test_derived_sizes_of_the_seed_job():
    sizes = derive_sizes(load_config(None, SEED_OVERRIDES))
    assert sizes.as_dict() == {
        "world_size": 64, "samples_per_step": 256, "optimizer_steps_per_grpo_step": 1,
        "samples_per_worker_per_optimizer_step": 4, "micro_batch_size": 4, "micro_batches_per_optimizer_step": 1,
        "micro_batch_tokens": 4 * 256,
    }


def test_derived_sizes_with_two_optimizer_steps():
    cfg = load_config(None, TWO_STEPS)
    assert derive_sizes(cfg).as_dict() == {
        "world_size": 1, "samples_per_step": 256, "optimizer_steps_per_grpo_step": 2,
        "samples_per_worker_per_optimizer_step": 128, "micro_batch_size": 32, "micro_batches_per_optimizer_step": 4,
        "micro_batch_tokens": 32 * 256,
    }
    assert derive_sizes(load_config(None, TWO_STEPS + ["policy.train_micro_batch_tokens=4096"])).micro_batch_tokens \
        == 4096


@pytest.mark.parametrize("per_worker, micro", [(1, 1), (4, 4), (7, 7), (32, 32), (48, 24), (64, 32), (96, 32),
                                               (37, 1), (40, 20), (128, 32)])
def test_micro_batch_auto_is_the_largest_divisor_up_to_32(per_worker, micro):
    cfg = load_config(None, [f"grpo.num_prompts_per_step={per_worker}", "grpo.num_generations_per_prompt=2",
                             f"policy.train_global_batch_size={per_worker}"])
    sizes = derive_sizes(cfg)
    assert sizes.samples_per_worker_per_optimizer_step == per_worker
    assert sizes.micro_batch_size == micro
    assert sizes.micro_batches_per_optimizer_step == per_worker // micro
    assert sizes.optimizer_steps_per_grpo_step == 2


def test_explicit_micro_batch_is_kept_and_checked():
    cfg = load_config(None, TWO_STEPS + ["policy.train_micro_batch_size=8"])
    assert derive_sizes(cfg).micro_batch_size == 8
    assert derive_sizes(cfg).micro_batches_per_optimizer_step == 16
    with pytest.raises(UserError, match=r"policy.train_micro_batch_size=48 must divide the per-worker batch .* = 128"):
        load_config(None, TWO_STEPS + ["policy.train_micro_batch_size=48"])


@pytest.mark.parametrize("overrides, match", [
    (TWO_STEPS + ["cluster.gpus_per_node=3"],
     r"policy.train_global_batch_size=128 must be a multiple of the worker count .* = 3"),
    (["policy.max_total_sequence_length=256", "policy.generation.max_new_tokens=256"],
     r"policy.generation.max_new_tokens=256 leaves no room"),
    (["checkpointing.metric_name=val/accuracy", "checkpointing.keep_top_k=null"],
     r"checkpointing.metric_name needs checkpointing.keep_top_k"),
    (["policy.max_total_sequence_length=512", "policy.train_micro_batch_tokens=500"],
     r"policy.train_micro_batch_tokens=500 must hold the longest sample, policy.max_total_sequence_length=512"),
])
def test_impossible_combinations(overrides, match):
    with pytest.raises(UserError, match=match):
        load_config(None, overrides)


# ---------------------------------------------------------------- reference and round trip


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_reference_lists_every_leaf_key_with_its_default():
    reference = list(iter_reference())
    keys = [key for key, _, _ in reference]
    assert len(keys) == len(set(keys))
    defaults = _leaves(Config().to_dict())
    assert set(keys) == set(defaults)
    for key, default, description in reference:
        shown = list(default) if isinstance(default, tuple) else default
        assert shown == defaults[key], key
        assert description, f"{key} has no description"
    assert ("grpo.num_generations_per_prompt", 8) in [(k, d) for k, d, _ in reference]
    assert ("loss.reference_policy_kl_penalty", 0.01) in [(k, d) for k, d, _ in reference]


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, SEED_OVERRIDES + ['policy.generation.stop_strings=["\\n"]', "data.prompt_template={problem}"])
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert again.digest() == cfg.digest()
    assert load_config(None, ["grpo.seed=1"]).digest() != Config().digest()
    assert yaml.safe_load(cfg.to_yaml())["grpo"]["num_prompts_per_step"] == 32


@pytest.mark.parametrize("given, expected", [("true", "auto"), ("false", "never"), ("True", "auto"), ("auto", "auto"),
                                             ("never", "never"), ("/runs/a/checkpoints/step_40", "/runs/a/checkpoints/step_40")])
def test_resume_modes_and_old_booleans(given, expected):
    assert load_config(None, [f"checkpointing.resume={given}"]).checkpointing.resume == expected


def test_resume_booleans_in_a_yaml_file_still_work(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("checkpointing:\n  resume: false\n")
    assert load_config(path).checkpointing.resume == "never"


@pytest.mark.parametrize("value, seconds", [("00:03:45:00", 13500.0), ("1:00:00:30", 86430.0)])
def test_deadline_is_a_dd_hh_mm_ss_budget(value, seconds):
    assert load_config(None, [f"checkpointing.checkpoint_must_save_by={value}"]).checkpointing.must_save_by_s() == seconds


@pytest.mark.parametrize("text, match", [
    ("checkpointing:\n  checkpoint_must_save_by: 4h\n", r"checkpoint_must_save_by': expected \"DD:HH:MM:SS\""),
    ("checkpointing:\n  checkpoint_must_save_by: 00:24:00:00\n", "hours must be < 24"),
    ("checkpointing:\n  checkpoint_must_save_by: 00:00:00:00\n", "leaves no time"),
    # unquoted, YAML 1.1 reads 1:03:30:00 as a base-60 number: ask for quotes
    ("checkpointing:\n  checkpoint_must_save_by: 1:03:30:00\n", "expected a quoted"),
    ("checkpointing:\n  preemption_grace_s: 0\n", "preemption_grace_s"),
])
def test_bad_deadline_and_grace_are_one_line_errors_naming_the_key(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=match) as info:
        load_config(path)
    assert "\n" not in str(info.value) and "checkpointing." in str(info.value)


class Pick(BaseModel):
    level: Literal["INFO", "DEBUG"]


def test_pydantic_messages_keep_their_case_after_the_first_letter():
    # a choice of upper-case values must be shown as it is spelled
    with pytest.raises(ValidationError) as caught:
        Pick(level="info")
    assert validation_message(caught.value, "config") == \
        "config key 'level': input should be 'INFO' or 'DEBUG' (got 'info')"


def test_a_held_out_ranking_metric_without_validated_saves_gets_a_note():
    from rlscale.config import config_notes

    assert config_notes(load_config(None, [])) == []
    assert config_notes(load_config(None, ["checkpointing.metric_name=val/accuracy", "checkpointing.save_period=50",
                                           "grpo.val_period=25"])) == []
    (note,) = config_notes(load_config(None, ["checkpointing.metric_name=val/accuracy"]))  # 20 vs 50
    assert "save_period=20 and grpo.val_period=50 are validated" in note
    (note,) = config_notes(load_config(None, ["checkpointing.metric_name=val/accuracy", "grpo.val_period=0"]))
    assert "validates no saved step" in note
    assert config_notes(load_config(None, ["checkpointing.metric_name=reward/mean"])) == []  # every save has it
    (note,) = config_notes(load_config(None, ["checkpointing.metric_name=val/acc"]))  # a typo
    assert "val/acc is not a metric a checkpoint records" in note and "val/accuracy" in note


def test_a_huge_key_or_value_is_shortened_in_the_error():
    for override in ("grpo." + "k" * 3000 + "=1", "grpo.max_num_steps=" + "x" * 3000):
        with pytest.raises(UserError) as caught:
            load_config(None, [override])
        text = str(caught.value)
        assert len(text) < 300, text
        assert "(3005 characters)" in text if "k" * 10 in text else "(3002 characters)" in text
