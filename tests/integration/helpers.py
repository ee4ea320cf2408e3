"""Helpers of the integration tests: the tiny run's settings and the `rlscale` command run in a
subprocess, the way a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
REWARD = "tests.integration.rewards_for_tests:digit_share"

# The seed's job line: a 64-GPU run's overrides (the config and --dry-run tests use it).
SEED_OVERRIDES = [
    "policy.model_name=Qwen/Qwen2.5-72B-Instruct", "cluster.num_nodes=8", "cluster.gpus_per_node=8",
    "grpo.max_num_steps=20", "grpo.num_generations_per_prompt=8", "grpo.num_prompts_per_step=32",
    "policy.train_global_batch_size=256", "checkpointing.enabled=True", "checkpointing.save_period=2",
    "checkpointing.keep_top_k=2", "checkpointing.metric_name=null", "checkpointing.checkpoint_dir=/lustre/run/",
    "data.dataset_name=DeepScaler", "logger.wandb_enabled=False",
]

# 4 prompts × 4 samples = 16 per step, 8 per optimizer step: 2 optimizer steps per GRPO step.
# On the CPU even where a GPU exists: the resume tests compare runs bit for bit.
TINY_RUN = [
    "policy.device=cpu",
    # pinned rather than defaulted, so that tuning the defaults does not move the expected values
    "policy.optimizer.lr=2e-4",
    "policy.scheduler.warmup_steps=5",
    "policy.generation.max_new_tokens=16",
    "loss.reference_policy_kl_penalty=0.01",
    "checkpointing.keep_top_k=2",
    "grpo.seed=42",
    "grpo.val_period=0",
    "grpo.val_at_start=true",
    "grpo.val_at_end=true",
    "grpo.val_temperature=0",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=4",
    "policy.train_global_batch_size=8",
    "checkpointing.save_period=2",
    "grpo.max_val_samples=16",
    "logger.progress=false",
    f"rewards.function={REWARD}",
]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def cli_env(home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        # One intra-op thread: two runs share CI's 2 cores, and OpenMP threads that spin on a
        # busy core make a tiny model ~10x slower.
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
        # Nothing may be downloaded: a hub id must fail at once, not retry a network.
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]),
        NO_COLOR="1", COLUMNS="200",
    )
    if home is not None:
        env["HF_HOME"] = str(home)
    return env


def run_cli(*args: str, cwd: Path, entry_point: bool = False, timeout: float = 300) -> CliResult:
    """`python -m rlscale.cli ARGS` (or the installed `rlscale` script) in a subprocess."""
    if entry_point:
        script = Path(sys.executable).parent / "rlscale"
        assert script.is_file(), f"the `rlscale` console script is not installed next to {sys.executable}"
        command = [str(script), *args]
    else:
        command = [sys.executable, "-m", "rlscale.cli", *args]
    done = subprocess.run(command, cwd=cwd, env=cli_env(cwd / ".hf_home"), capture_output=True, text=True,
                          timeout=timeout)
    return CliResult(done.returncode, done.stdout, done.stderr)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rows(metrics_path: Path) -> list[dict]:
    """The per-step training rows of metrics.jsonl (validation rows carry no reward/mean)."""
    return [row for row in read_jsonl(metrics_path) if "reward/mean" in row]


STEP_DIR = re.compile(r"^(tmp_)?step_\d+$")


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if STEP_DIR.match(p.name)) if Path(root).is_dir() else []


def train_args(model: Path, log_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", *TINY_RUN, f"policy.model_name={model}", f"grpo.max_num_steps={steps}",
            f"logger.log_dir={log_dir}", *extra]


def policy_weights(step_dir: Path) -> dict:
    """A checkpoint's policy weights, from every safetensors shard in its policy/ directory."""
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted((Path(step_dir) / "policy").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


@contextmanager
def loopback_ray_cluster(head_node_args: dict, second_node_args: dict):
    """A Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head and a second
    raylet), this process its driver, the repository importable in its workers."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=head_node_args)
    try:
        cluster.add_node(**second_node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}})
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
