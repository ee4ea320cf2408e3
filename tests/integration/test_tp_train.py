"""`rlscale train` with tensor-parallel generation: 2 CPU workers (Ray actors, gloo) generating as
one group of T=2, their engine weights synced one FSDP unit at a time, validate the built-in model
before training exactly as T=1 does (greedy, the same held-out problems)."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.helpers import read_jsonl, run_cli

pytest.importorskip("ray")

# the built-in warm-started model (4 heads, 4 layers) and its math reward: some sums come out right
RUN = ["policy.device=cpu", "cluster.gpus_per_node=2", "cluster.use_gpus=false", "grpo.max_num_steps=1",
       "grpo.val_at_start=true", "grpo.val_at_end=false", "grpo.val_temperature=0", "grpo.max_val_samples=64",
       "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=8",
       "loss.reference_policy_kl_penalty=0", "checkpointing.enabled=false", "logger.progress=false",
       "rewards.num_workers=1"]
VAL = ("val/accuracy", "val/reward_mean", "val/response_length")


def held_out_before_training(tmp_path, name: str, *extra: str) -> dict:
    log_dir = tmp_path / name
    result = run_cli("train", *RUN, *extra, f"logger.log_dir={log_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert "Traceback" not in result.output
    resolved = yaml.safe_load((log_dir / "config.yaml").read_text())["policy"]
    assert resolved["generation"]["tensor_parallel_size"] == (2 if "tensor_parallel" in name else 1)
    rows = read_jsonl(log_dir / "metrics.jsonl")
    before = [row for row in rows if row["step"] == 0 and "val/accuracy" in row]
    assert len(before) == 1, rows
    assert any("train/loss" in row for row in rows if row["step"] == 1)  # and the step trained
    return {key: before[0][key] for key in VAL}


def test_tensor_parallel_generation_validates_as_one_worker_per_batch_does(tmp_path):
    one = held_out_before_training(tmp_path, "one_worker_per_batch")
    two = held_out_before_training(tmp_path, "tensor_parallel", "policy.generation.tensor_parallel_size=2",
                                   "policy.keep_gathered=false")
    assert one["val/accuracy"] > 0  # the comparison is between models that answer something
    assert two == one
