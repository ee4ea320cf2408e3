"""NeMo-RL recipes and the seed's job line: `defaults:` chains, `${...}`, NeMo-RL's key names and
value forms, the Megatron optimizer's settings surviving, ignored keys listed once, typos refused.

The recipes under tests/recipes/ are this project's own, in the layout of NeMo-RL's public
grpo_math_1B -> grpo_math_1B_megatron -> grpo_math_70B_megatron chain.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from rlscale.config_loading import load_config, load_config_and_notes
from rlscale.errors import UserError
from tests.integration.helpers import run_cli

RECIPES = Path(__file__).parent / "recipes"
BASE = RECIPES / "grpo_math_small.yaml"
MEGATRON = RECIPES / "grpo_math_small_megatron.yaml"
LARGE = RECIPES / "grpo_math_large_megatron.yaml"

# ../shared/SEED.md part 5, every override as a shell passes it (quotes removed), <run> named
SEED_LINE = [
    "policy.model_name=Qwen/Qwen2.5-72B-Instruct", "policy.megatron_cfg.converter_type=Qwen2ForCausalLM",
    "logger.wandb_enabled=False", "cluster.num_nodes=8", "cluster.gpus_per_node=8",
    "logger.wandb.name=nemo-rl-grpo-test1", "grpo.max_num_steps=20", "grpo.num_generations_per_prompt=8",
    "grpo.num_prompts_per_step=32", "policy.train_global_batch_size=256", "checkpointing.enabled=True",
    "checkpointing.save_period=2", "checkpointing.keep_top_k=2", "checkpointing.metric_name=null",
    "checkpointing.checkpoint_dir=/lustre/seed-run/", "data.dataset_name=DeepScaler",
]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def one_line_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as caught:
        load_config(*args, **kwargs)
    text = str(caught.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------- the training settings survive


def test_the_70b_shaped_recipe_keeps_its_megatron_optimizer_and_generation_tp():
    cfg = load_config(LARGE)
    opt, sched = cfg.policy.optimizer, cfg.policy.scheduler
    assert opt.lr == 3e-7  # megatron_cfg.optimizer's, not rlscale's default 2e-4
    assert cfg.policy.master_weights == "fp32"  # params_dtype: float32
    assert opt.weight_decay == 0.01
    assert (sched.min_lr, sched.warmup_steps, sched.warmup_start_lr) == (3e-8, 13, 3e-8)
    assert (sched.decay_style, sched.decay_steps) == ("constant", 1000)
    assert cfg.policy.generation.tensor_parallel_size == 8  # vllm_cfg's; Megatron's TP 4 is not it
    assert cfg.policy.generation.gpu_memory_utilization == 0.6
    assert cfg.policy.dtype == "bfloat16"  # policy.precision
    assert (cfg.cluster.num_nodes, cfg.cluster.gpus_per_node) == (8, 8)
    # through the whole chain: betas and eps from the base file's megatron_cfg, the loss from the
    # middle file, the step shape from the last, the seed from the base
    assert opt.betas == (0.9, 0.98) and opt.eps == 1e-8
    assert (cfg.loss.reference_policy_kl_penalty, cfg.loss.ratio_clip_max) == (0.01, 0.2)
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (64, 32)
    assert (cfg.grpo.val_period, cfg.grpo.seed) == (10, 7)
    assert cfg.checkpointing.enabled is False and cfg.checkpointing.checkpoint_dir == "results/grpo_small_megatron"
    assert cfg.checkpointing.metric_name == "val/accuracy"  # "val:accuracy"
    assert cfg.policy.max_grad_norm == 1.0  # megatron's clip_grad: ${policy.max_grad_norm}
    # ${policy.max_total_sequence_length} everywhere follows the last file's 4096
    assert cfg.policy.max_total_sequence_length == 4096
    assert cfg.policy.train_micro_batch_tokens == 4096  # ${mul:4096, 1} of sequence_packing
    assert cfg.policy.generation.max_new_tokens == 4096 - 512  # room for the prompt, said in a note
    assert cfg.policy.generation.backend == "engine"  # "vllm"
    assert cfg.policy.tokenizer_name is None  # ${policy.model_name}: the model's own


def test_the_base_recipe_maps_the_fsdp_optimizer_and_its_scheduler_list():
    cfg = load_config(BASE)
    opt, sched = cfg.policy.optimizer, cfg.policy.scheduler
    assert (opt.lr, opt.weight_decay, opt.betas, opt.eps) == (2e-6, 0.05, (0.9, 0.95), 1e-7)
    assert sched.warmup_steps == 25 and math.isclose(sched.warmup_start_lr, 0.2 * 2e-6)  # LinearLR
    assert sched.decay_style == "constant"
    assert cfg.policy.master_weights == "auto"  # megatron_cfg is off: its params_dtype is not the recipe's
    assert (cfg.loss.reference_policy_kl_penalty, cfg.loss.ratio_clip_max) == (0.02, 0.28)  # loss_fn
    assert cfg.policy.max_grad_norm == 0.5
    assert cfg.policy.train_micro_batch_tokens == 1024 * 2
    assert cfg.rewards.num_workers == 4  # env.math.num_workers
    assert cfg.logger.mlflow.experiment == "grpo-tests"  # mlflow.experiment_name
    assert cfg.data.dataset_name == "OpenMathInstruct-2"
    assert cfg.policy.generation.stop_strings == []  # null


def test_an_override_moves_every_value_that_refers_to_it():
    """Overrides land before ${...} is resolved, as in NeMo-RL."""
    cfg = load_config(LARGE, ["policy.max_total_sequence_length=2048", "policy.train_micro_batch_size=2",
                              "policy.train_global_batch_size=512"])
    assert cfg.policy.train_micro_batch_tokens == 2048 * 2
    assert cfg.policy.generation.max_new_tokens == 2048 - 256
    cfg = load_config(LARGE, ["policy.megatron_cfg.optimizer.lr=1e-6", "policy.megatron_cfg.enabled=true"])
    assert cfg.policy.optimizer.lr == 1e-6
    # rlscale's own key on the command line beats the recipe's NeMo-RL key
    assert load_config(LARGE, ["policy.optimizer.lr=5e-7"]).policy.optimizer.lr == 5e-7
    assert load_config(LARGE, ["policy.master_weights=bf16_stochastic"]).policy.master_weights == "bf16_stochastic"


def test_metric_name_value_forms(tmp_path):
    for given, wanted in [("val:accuracy", "val/accuracy"), ("val_reward", "val/accuracy"),
                          ("train:loss", "train/loss"), ("val/reward_mean", "val/reward_mean")]:
        path = write(tmp_path / "r.yaml", f"checkpointing:\n  metric_name: {given!r}\n")
        assert load_config(path).checkpointing.metric_name == wanted, given


def test_relative_interpolation_resolvers_and_a_list_of_defaults(tmp_path):
    write(tmp_path / "parts" / "one.yaml", "grpo:\n  max_num_steps: 11\n  seed: 5\n")
    write(tmp_path / "parts" / "two.yaml", "defaults: three.yaml\ngrpo:\n  max_num_steps: 22\n")
    write(tmp_path / "parts" / "three.yaml", "grpo:\n  val_period: 3\n")  # relative to two.yaml's folder
    recipe = write(tmp_path / "recipe.yaml", (
        "defaults:\n  - parts/one.yaml\n  - parts/two.yaml\n"
        "loss_fn:\n  ratio_clip_min: 0.15\n  ratio_clip_max: ${.ratio_clip_min}\n"
        "policy:\n  train_micro_batch_size: 2\n  train_global_batch_size: 8\n"
        "  generation:\n    max_new_tokens: ${mul:${..train_micro_batch_size}, 50}\n"))
    cfg = load_config(recipe, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    assert cfg.loss.ratio_clip_max == 0.15
    assert cfg.policy.generation.max_new_tokens == 100
    assert cfg.grpo.max_num_steps == 22  # the later default wins
    assert (cfg.grpo.seed, cfg.grpo.val_period) == (5, 3)


# ---------------------------------------------------------------- ignored keys: listed once, --strict


def test_ignored_keys_are_listed_once_each_with_what_rlscale_does_instead():
    loaded = load_config_and_notes(LARGE, SEED_LINE)
    keys = [key for key, _ in loaded.ignored]
    assert len(keys) == len(set(keys)) > 50
    reasons = dict(loaded.ignored)
    assert "generation TP comes from policy.generation.vllm_cfg.tensor_parallel_size" in \
        reasons["policy.megatron_cfg.tensor_model_parallel_size"]
    assert "no conversion" in reasons["policy.megatron_cfg.converter_type"]
    assert "policy.generation.vllm_cfg.enforce_eager" in reasons  # a vLLM tuning key
    # mapped keys are not also listed as ignored
    for mapped in ("policy.megatron_cfg.optimizer.lr", "policy.megatron_cfg.optimizer.params_dtype",
                   "policy.megatron_cfg.scheduler.lr_warmup_iters", "policy.generation.vllm_cfg.tensor_parallel_size",
                   "loss_fn.ratio_clip_min", "env.math.num_workers"):
        assert mapped not in reasons, mapped
    lines = loaded.ignored_lines()
    assert lines[0] == f"note: {len(keys)} NeMo-RL key(s) that rlscale does not act on:"
    assert len(lines) == len(keys) + 1


def test_strict_refuses_ignored_keys_in_one_line():
    text = one_line_error(None, SEED_LINE, strict=True)
    assert text.startswith("--strict: rlscale does not act on 1 NeMo-RL key(s): policy.megatron_cfg.converter_type")
    load_config(None, [line for line in SEED_LINE if "megatron_cfg" not in line], strict=True)  # nothing ignored


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("text, message", [
    ("policy:\n  megatron_cfg:\n    tensor_model_paralel_size: 2\n",
     "unknown config key 'policy.megatron_cfg.tensor_model_paralel_size' (in config file '{path}')"),
    ("policy:\n  megatron_cfg:\n    optimizer:\n      lr_warmup: 3\n",
     "unknown config key 'policy.megatron_cfg.optimizer.lr_warmup' (in config file '{path}')"),
    ("grpo:\n  max_num_stepz: 2\n", "unknown config key 'grpo.max_num_stepz' (in config file '{path}')"),
    ("loss_fn:\n  ratio_clip_mid: 0.1\n", "unknown config key 'loss_fn.ratio_clip_mid' (in config file '{path}')"),
    ("loss_fn:\n  use_on_policy_kl_approximation: true\n",
     "config key 'loss_fn.use_on_policy_kl_approximation' (in config file '{path}'): "
     "loss_fn.use_on_policy_kl_approximation=true: rlscale does not do this"),
    ("grpo:\n  async_grpo:\n    enabled: true\n", "config key 'grpo.async_grpo.enabled' (in config file '{path}')"),
    ("policy:\n  megatron_cfg:\n    optimizer:\n      optimizer: sgd\n",
     "config key 'policy.megatron_cfg.optimizer.optimizer' (in config file '{path}'): "
     "policy.megatron_cfg.optimizer.optimizer='sgd': rlscale's optimizer is AdamW"),
    ("policy:\n  megatron_cfg:\n    scheduler:\n      lr_decay_style: WSD\n",
     "config key 'policy.megatron_cfg.scheduler.lr_decay_style' (in config file '{path}')"),
    ("policy:\n  optimizer:\n    lr: 1.0e-5\n",  # two optimizers in files: the Megatron one and rlscale's
     "config: policy.optimizer.lr=1e-05 and policy.megatron_cfg.optimizer.lr=3e-07 disagree"),
    ("policy:\n  max_total_sequence_length: ${policy.nope}\n",
     "config key 'policy.max_total_sequence_length' (in config file '{path}'): cannot resolve its ${{...}}: "
     "Interpolation key 'policy.nope' not found"),
])
def test_a_bad_key_in_a_recipe_is_named_with_its_file(tmp_path, text, message):
    path = write(tmp_path / "child.yaml", f"defaults: {LARGE}\n{text}")
    assert one_line_error(path).startswith(message.format(path=path)), text


def test_bad_defaults_are_one_line(tmp_path):
    missing = write(tmp_path / "a.yaml", "defaults: nowhere.yaml\n")
    assert one_line_error(missing) == (f"config file {str(missing)!r}: defaults names 'nowhere.yaml', which is not "
                                       f"a file (looked in {str(tmp_path)!r})")
    write(tmp_path / "b.yaml", "defaults: c.yaml\n")
    loop = write(tmp_path / "c.yaml", "defaults: b.yaml\n")
    assert "includes" in one_line_error(loop) and "twice" in one_line_error(loop)
    assert one_line_error(write(tmp_path / "d.yaml", "defaults: [1, 2]\n")).startswith(
        f"config file {str(tmp_path / 'd.yaml')!r}: defaults must name a file or a list of files")


def test_a_typo_on_the_command_line_inside_a_nemo_section_is_named():
    assert one_line_error(None, ["policy.generation.vllm_cfg.enforce_eagr=true"]).startswith(
        "unknown config key 'policy.generation.vllm_cfg.enforce_eagr' (on the command line)")
    assert load_config(None, ["policy.generation.vllm_cfg.enforce_eager=true"]).policy.generation.backend == "engine"


# ---------------------------------------------------------------- the learning-rate schedule


def test_lr_schedule_warmup_from_a_start_and_decays():
    from rlscale.config import SchedulerConfig
    from rlscale.workers.policy import lr_factor, warmup_factor

    default = SchedulerConfig()
    assert [lr_factor(s, default, 1e-3, 100) for s in range(8)] == [warmup_factor(s, 5) for s in range(8)]
    megatron = SchedulerConfig(warmup_steps=13, warmup_start_lr=3e-8)
    lr = 3e-7
    assert math.isclose(lr_factor(0, megatron, lr, 20) * lr, 3e-8)
    assert math.isclose(lr_factor(13, megatron, lr, 20), 1.0) and lr_factor(19, megatron, lr, 20) == 1.0
    cosine = SchedulerConfig(warmup_steps=0, decay_style="cosine", decay_steps=10, min_lr=1e-4)
    assert lr_factor(0, cosine, 1e-3, 99) == 1.0
    assert math.isclose(lr_factor(5, cosine, 1e-3, 99) * 1e-3, (1e-3 + 1e-4) / 2)
    assert math.isclose(lr_factor(10, cosine, 1e-3, 99) * 1e-3, 1e-4) and lr_factor(50, cosine, 1e-3, 99) == 0.1
    linear = SchedulerConfig(warmup_steps=2, decay_style="linear", min_lr=0.0)  # to the run's last step
    assert math.isclose(lr_factor(6, linear, 1.0, 10), 0.5) and lr_factor(10, linear, 1.0, 10) == 0.0
    with pytest.raises(UserError, match="warmup_start_lr=0.1 is above policy.optimizer.lr=0.001"):
        load_config(None, ["policy.optimizer.lr=1e-3", "policy.scheduler.warmup_start_lr=0.1"])


# ---------------------------------------------------------------- the CLI: the seed's line


def _dry_run(tmp_path, *args):
    result = run_cli("train", "--dry-run", *args, cwd=tmp_path)
    assert "Traceback" not in result.output
    return result


def test_the_seed_line_verbatim_passes_the_dry_run_without_a_recipe(tmp_path):
    result = _dry_run(tmp_path, *SEED_LINE)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [
        "note: 1 NeMo-RL key(s) that rlscale does not act on:",
        "  policy.megatron_cfg.converter_type: rlscale loads the Hugging Face checkpoint as it is (the architecture "
        "from its config.json): no conversion"]
    printed = yaml.safe_load(result.stdout.partition("# derived sizes")[0])
    assert printed["logger"]["wandb"]["name"] == "nemo-rl-grpo-test1"
    assert printed["checkpointing"]["checkpoint_dir"] == "/lustre/seed-run/"
    assert "megatron_cfg" not in printed["policy"]
    assert "no verdict: no GPU here and cluster.gpu_memory_gb is not set" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".hf_home") == []


def test_the_seed_line_with_the_70b_shaped_recipe_plans_at_the_recipes_tp(tmp_path):
    result = _dry_run(tmp_path, "--config", str(LARGE), *SEED_LINE)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout.partition("# derived sizes")[0])
    assert printed["policy"]["optimizer"]["lr"] == 3e-7
    assert printed["policy"]["master_weights"] == "fp32"
    assert printed["policy"]["generation"]["tensor_parallel_size"] == 8
    assert printed["grpo"]["num_prompts_per_step"] == 32  # the line beats the recipe's 64
    assert "#   rollout engine tensor-parallel over 8 GPUs" in result.stdout
    assert "no verdict: no GPU here and cluster.gpu_memory_gb is not set" in result.stdout
    notes = result.stderr.splitlines()
    assert sum(line.startswith("note: ") and "NeMo-RL key(s)" in line for line in notes) == 1
    listed = [line.split(":")[0].strip() for line in notes if line.startswith("  ")]
    assert len(listed) == len(set(listed)) and "policy.megatron_cfg.converter_type" in listed
    # with a budget the plan gives its verdict at the recipe's generation TP (8), fp32 master weights
    result = _dry_run(tmp_path, "--config", str(LARGE), *SEED_LINE, "cluster.gpu_memory_gb=180")
    assert result.returncode == 0, result.stderr
    assert "#   rollout engine tensor-parallel over 8 GPUs" in result.stdout
    assert "master weights fp32" in result.stdout
    assert "budget 180.0 GB, 172.6 usable after 2 GB + 3% reserved: fits" in result.stdout


def test_strict_and_a_bad_recipe_stop_in_one_line(tmp_path):
    result = _dry_run(tmp_path, "--strict", "--config", str(LARGE), *SEED_LINE)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("rlscale: error: --strict: rlscale does not act on ")
    bad = write(tmp_path / "bad.yaml", f"defaults: {LARGE}\npolicy:\n  dtensor_cfg:\n    cpu_offlaod: true\n")
    result = _dry_run(tmp_path, "--config", str(bad))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlscale: error: unknown config key 'policy.dtensor_cfg.cpu_offlaod' (in config file '{bad}'): neither an "
        "rlscale key nor one of NeMo-RL's GRPO recipe keys"]
