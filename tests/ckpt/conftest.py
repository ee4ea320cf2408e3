"""Tiny policy workers for checkpoint tests: a 2-layer Qwen2 built from a config, never downloaded.

RLSCALE_TEST_DEVICE=cuda runs them on a GPU (pinned staging, device copies, chunked reads).
"""

import contextlib
import os

import pytest
import torch

from rlscale.ckpt import Checkpointer
from rlscale.config_loading import load_config
from rlscale.models.tiny import build_char_tokenizer, build_tiny_model
from rlscale.workers.group import LocalWorkerGroup
from rlscale.workers.policy import PolicyWorker


DEVICE = os.environ.get("RLSCALE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny matmuls on a busy 2-core box: a second OpenMP thread makes each one ~1000x slower
    (the pool waits for a descheduled thread), and pytest -n already uses the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def make_cfg(tiny_model_dir, tmp_path):
    def make(*overrides):
        return load_config(None, [f"policy.model_name={tiny_model_dir}", f"policy.device={DEVICE}",
                                  "loss.reference_policy_kl_penalty=0", f"logger.log_dir={tmp_path / 'run'}",
                                  f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.writers_per_rank=2",
                                  *overrides])
    return make


def make_group(cfg, world_size=1):
    """In-process replicas: rank-aware saving and loading without a process group."""
    return LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size, distributed_group=False), world_size)


def checkpointer_for(cfg):
    """The run's Checkpointer, prepared, as the controller makes it."""
    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing, cfg.to_yaml(), cfg.digest())
    ckpt.prepare()
    return ckpt


def train_steps(worker, steps=2, seed=0):
    """A few AdamW steps on random tokens, so moments, scheduler and RNG all move."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 50, (2, 12), generator=gen).to(worker.device)
        worker.optimizer.zero_grad()
        computing = getattr(worker, "computing", contextlib.nullcontext)
        with computing():  # fp32 master weights at one worker: on the bf16 compute copy
            worker.model(input_ids=ids).logits.float().pow(2).mean().backward()
        worker.optimizer.step()
        worker.scheduler.step()
    torch.rand(3)  # move the global RNG too


def full_state(worker):
    """Everything a resume must restore, as plain comparable values."""
    import random

    from rlscale.workers.state_io import model_tensors, optimizer_flat

    moments, meta = optimizer_flat(worker.model, worker.optimizer, worker.scheduler)
    return {"weights": {k: v.clone() for k, v in model_tensors(worker.model).items()},
            "moments": {k: v.clone() for k, v in moments.items()}, "meta": meta,
            "torch_rng": torch.get_rng_state().clone(), "py_rng": random.getstate()}


def assert_same_state(a, b):
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), key
    assert a["moments"].keys() == b["moments"].keys() and a["moments"]
    for key in a["moments"]:
        assert torch.equal(a["moments"][key], b["moments"][key]), key
    assert a["meta"] == b["meta"]
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["py_rng"] == b["py_rng"]


def entries(root) -> list[str]:
    """What a checkpoint dir holds, less the lock file of the run that holds it (rlscale/ckpt/claim.py)."""
    from rlscale.ckpt.claim import LOCK_NAME

    return sorted(p.name for p in root.iterdir() if p.name != LOCK_NAME)
