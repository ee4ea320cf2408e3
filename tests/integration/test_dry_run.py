"""`rlscale train --dry-run` with the seed's job line: validates, prints, loads nothing."""

from __future__ import annotations

import time

import yaml

from tests.integration.helpers import SEED_OVERRIDES, run_cli


def test_dry_run_of_the_seed_job_line(tmp_path):
    started = time.perf_counter()
    result = run_cli("train", "--dry-run", *SEED_OVERRIDES, cwd=tmp_path, entry_point=True)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.output
    assert result.stderr == ""
    config_text, _, derived = result.stdout.partition("# derived sizes")
    printed = yaml.safe_load(config_text)
    assert printed["policy"]["model_name"] == "Qwen/Qwen2.5-72B-Instruct"
    assert (printed["cluster"]["num_nodes"], printed["cluster"]["gpus_per_node"]) == (8, 8)
    assert printed["grpo"]["max_num_steps"] == 20
    assert printed["grpo"]["num_generations_per_prompt"] == 8
    assert printed["grpo"]["num_prompts_per_step"] == 32
    assert printed["policy"]["train_global_batch_size"] == 256
    assert printed["checkpointing"]["enabled"] is True
    assert printed["checkpointing"]["save_period"] == 2
    assert printed["checkpointing"]["keep_top_k"] == 2
    assert printed["checkpointing"]["metric_name"] is None
    assert printed["checkpointing"]["checkpoint_dir"] == "/lustre/run/"
    assert printed["data"]["dataset_name"] == "DeepScaler"
    assert printed["logger"]["wandb_enabled"] is False
    derived, _, plan_text = derived.partition("# memory plan: ")
    # the plan's figures, without a verdict: no GPU here and no cluster.gpu_memory_gb
    assert plan_text.startswith("Qwen/Qwen2.5-72B-Instruct, 72.71B parameters, 64 GPUs")
    assert "no verdict: no GPU here and cluster.gpu_memory_gb is not set" in plan_text
    sizes = dict(line.strip("# ").split(": ") for line in derived.strip().splitlines())
    assert sizes == {"world_size": "64", "samples_per_step": "256", "optimizer_steps_per_grpo_step": "1",
                     "samples_per_worker_per_optimizer_step": "4", "micro_batch_size": "4",
                     "micro_batches_per_optimizer_step": "1", "micro_batch_tokens": "1024"}
    # nothing was created: no run directory, no checkpoint directory, no model or data fetched
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert elapsed < 30  # no model or dataset load (those take minutes for a 72B model)


def test_dry_run_imports_no_model_or_data_library(tmp_path):
    """The dry run never touches torch, transformers or datasets: it cannot load a model or data."""
    import subprocess
    import sys

    from tests.integration.helpers import cli_env

    code = (
        "import sys\n"
        f"sys.argv = ['rlscale', 'train', '--dry-run', *{SEED_OVERRIDES!r}]\n"
        "from rlscale.cli import app\n"
        "app(standalone_mode=False)\n"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'math_verify', 'pyarrow') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('no heavy imports', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "no heavy imports"
    assert "world_size: 64" in done.stdout


def test_dry_run_of_the_seed_job_on_b200s_is_refused_by_the_memory_plan(tmp_path):
    """With a budget (cluster.gpu_memory_gb) the plan gives a verdict: the seed's 72B cannot fit
    while every GPU holds the rollout engine's whole copy; the table is printed, then one line
    naming the tensor-parallel size that fits."""
    result = run_cli("train", "--dry-run", *SEED_OVERRIDES, "cluster.gpu_memory_gb=180", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        "rlscale: error: memory plan: the update phase needs 218.1 GB per GPU, more than the 172.6 GB usable "
        "of 180.0 GB: it fits with policy.generation.tensor_parallel_size=2, peak 148.6 GB"]
    assert "#   peak: update 218.1 GB; budget 180.0 GB" in result.stdout


# NeMo-RL's 70B recipe: sequences of 4096, 3584 of them generated (tests/test_memory_plan.py's SEED_72B)
RECIPE_72B = [*SEED_OVERRIDES, "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=3584",
              "cluster.gpu_memory_gb=180"]


def test_dry_run_of_the_reference_job_at_tensor_parallel_size_8_fits(tmp_path):
    result = run_cli("train", "--dry-run", *RECIPE_72B, "policy.generation.vllm_cfg.tensor_parallel_size=8",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    config_text, _, plan_text = result.stdout.partition("# derived sizes")
    printed = yaml.safe_load(config_text)
    assert printed["policy"]["generation"]["tensor_parallel_size"] == 8  # NeMo-RL's name, rlscale's key
    assert printed["policy"]["keep_gathered"] is False  # the plan's pick: the sync one unit at a time
    assert "#   rollout engine tensor-parallel over 8 GPUs: each holds 1/8 of its weights" in plan_text
    totals = next(line for line in plan_text.splitlines() if line.startswith("#   total"))
    assert totals.split()[2:] == ["55.2", "41.6", "62.3", "134.7", "44.1"]
    assert "#   peak: update 134.7 GB; budget 180.0 GB, 172.6 usable after 2 GB + 3% reserved: fits" in plan_text


def test_dry_run_refuses_a_tensor_parallel_size_the_model_or_the_nodes_cannot_take(tmp_path):
    """One line each, naming the key and its value: checked at the dry run from config.json's shape
    (the built-in shapes for hub ids: no weights, no download)."""
    cases = [
        (["policy.model_name=Qwen/Qwen2.5-7B-Instruct", "policy.generation.tensor_parallel_size=8"],
         "rlscale: error: policy.generation.tensor_parallel_size=8 must divide the attention heads of "
         "Qwen/Qwen2.5-7B-Instruct (num_attention_heads=28)"),
        (["policy.generation.tensor_parallel_size=16"],
         "rlscale: error: config: policy.generation.tensor_parallel_size=16 must divide cluster.gpus_per_node=8 "
         "(a group of 16 consecutive ranks generates together on one node, never across nodes)"),
        (["policy.generation.tensor_parallel_size=8", "policy.generation.backend=hf"],
         "rlscale: error: config: policy.generation.tensor_parallel_size=8 needs policy.generation.backend=engine "
         "(backend=hf: transformers generate holds the whole model on each GPU)"),
        (["policy.generation.tensor_parallel_size=8", "policy.generation.vllm_cfg.tensor_parallel_size=4"],
         "rlscale: error: config key 'policy.generation': policy.generation.vllm_cfg.tensor_parallel_size=4 and "
         "policy.generation.tensor_parallel_size=8 disagree (they are one setting: give one)"),
    ]
    for extra, line in cases:
        result = run_cli("train", "--dry-run", *SEED_OVERRIDES, *extra, cwd=tmp_path)
        assert result.returncode != 0 and "Traceback" not in result.output, extra
        assert result.stderr.strip().splitlines() == [line], extra
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_dry_run_refuses_a_gpu_memory_utilization_that_holds_no_sequence(tmp_path):
    """The rollout engine's KV budget (the fraction of the GPU less the rest of the generation phase)
    must hold one sequence: the table is printed, then one line naming the key."""
    result = run_cli("train", "--dry-run", "policy.model_name=Qwen/Qwen2.5-1.5B-Instruct", "cluster.gpu_memory_gb=141",
                     "policy.generation.vllm_cfg.gpu_memory_utilization=0.1", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "rlscale: error: memory plan: policy.generation.gpu_memory_utilization=0.1 leaves the rollout engine's KV "
        "cache 0 bytes per GPU (0.1 × 141.0 GB less the ")
    assert "or more, a shorter policy.max_total_sequence_length or a larger " \
           "policy.generation.tensor_parallel_size (now 1)" in lines[0]
    assert "#   KV budget (policy.generation.gpu_memory_utilization=0.1): " in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []
