"""FSDP2-sharded workers (two gloo ranks on CPU) resume a plain worker's checkpoint (whole tensors
by name), and their own checkpoint (the sharded layout: each rank's rows) loads into a plain worker
and, once exported, into transformers. The sharded layout's own tests: test_sharded_layout.py."""

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlscale.ckpt import Checkpointer, layout
from rlscale.ckpt.checkpointer import wait_for_writers
from rlscale.ckpt.tools import export_policy
from rlscale.config import CheckpointingConfig
from rlscale.workers.state_io import CheckpointableWorker, model_tensors, optimizer_flat
from tests.ckpt.conftest import DEVICE, checkpointer_for, full_state, make_group, train_steps

SETTINGS = CheckpointingConfig(writers_per_rank=2, keep_top_k=None)


class ShardedWorker(CheckpointableWorker):
    def __init__(self, model_dir: str, rank: int, world_size: int):
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rank, self.world_size, self.device, self.ckpt_settings = rank, world_size, torch.device("cpu"), SETTINGS
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-4)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)


class DistGroup:
    """Every rank calls run_all in the same order: once all have arrived, each runs its own worker,
    and every rank gets every rank's result (what a Ray group gives its controller)."""

    def __init__(self, worker, process_group=None):
        """process_group: where the calls' barrier and gather run (None: the default group)."""
        self.worker, self.world_size, self.process_group = worker, dist.get_world_size(), process_group

    def run_all(self, method, per_worker_args=None):
        dist.barrier(group=self.process_group)  # rank 0 has made the tmp dir before anyone writes into it
        args = (per_worker_args or [()] * self.world_size)[dist.get_rank()]
        results = [None] * self.world_size
        dist.all_gather_object(results, getattr(self.worker, method)(*args), group=self.process_group)
        return results


def whole_state(worker) -> dict[str, torch.Tensor]:
    """Weights and moments as whole tensors (gathering is collective: every rank calls this)."""
    moments = optimizer_flat(worker.model, worker.optimizer, worker.scheduler)[0]
    out = {}
    for name, tensor in [*model_tensors(worker.model).items(), *sorted(moments.items())]:
        out[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()
    return out


def rank_main(rank: int, world: int, port: int, model_dir: str, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        worker = ShardedWorker(model_dir, rank, world)
        group = DistGroup(worker)
        ckpt = Checkpointer(Path(root), SETTINGS, "{}\n", "test")
        ckpt.load(Path(root) / "step_1", group)  # saved by one plain worker
        loaded = whole_state(worker)
        train_steps(worker, steps=1, seed=7)
        after = whole_state(worker)
        if rank == 0:
            save_file(loaded, f"{out}/loaded_step_1.safetensors")
            save_file(after, f"{out}/expected_step_2.safetensors")
            ckpt.save(2, group, {"step": 2}, {})  # the controller's side runs on rank 0
            ckpt.wait()
        else:
            tmp = str(Path(root) / layout.tmp_dir_name(2))
            group.run_all("checkpoint_snapshot", [(tmp,)] * world)
            wait_for_writers(group)  # mirrors rank 0's commit thread, poll for poll
        assert worker._ckpt_tensors is None  # sharded: the files are made afresh every save
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(DEVICE != "cpu", reason="the sharded ranks run on CPU with gloo")
def test_sharded_ranks_resume_a_plain_save_and_write_one_a_plain_worker_loads(make_cfg, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_cfg("checkpointing.keep_top_k=null")
    plain = make_group(cfg)
    train_steps(plain.workers[0])
    saved = full_state(plain.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, plain, {"step": 1}, {})
    ckpt.wait()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, str(tiny_model_dir), str(cfg.checkpoint_dir), str(tmp_path)), nprocs=2)

    loaded = load_file(tmp_path / "loaded_step_1.safetensors")  # 1 plain worker -> 2 sharded ranks
    for name, tensor in {**saved["weights"], **saved["moments"]}.items():
        assert torch.equal(loaded[name], tensor), name

    step_2 = cfg.checkpoint_dir / "step_2"
    assert layout.verify_step_dir(step_2, checksums=True).ok
    expected = load_file(tmp_path / "expected_step_2.safetensors")  # 2 sharded ranks -> 1 plain worker
    single = make_group(cfg)
    ckpt.load(step_2, single)
    state = full_state(single.workers[0])
    for name, tensor in {**state["weights"], **state["moments"]}.items():
        assert torch.equal(expected[name], tensor), name
    assert "tensors" in layout.read_manifest(step_2)  # sharded: policy/ is no HF dir, the export is
    hf = AutoModelForCausalLM.from_pretrained(export_policy(step_2, tmp_path / "hf"))
    for name, tensor in model_tensors(hf).items():
        assert torch.equal(expected[name], tensor), name
