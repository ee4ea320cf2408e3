"""Two FSDP2 ranks (gloo, CPU) take the same optimizer step as one worker on the whole batch,
with several packed micro-batches per step (gradients reduce-scattered once, at the last)."""

import json
import os
import socket

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from rlscale.config import load_config
from rlscale.workers.batch import build_train_batch
from rlscale.workers.policy import PolicyWorker

OVERRIDES = ["policy.train_micro_batch_tokens=32", "policy.max_total_sequence_length=32", "policy.cpu_threads=1",
             "loss.reference_policy_kl_penalty=0"]
TEXTS = [("12+7=", "19<eos>"), ("305+96=", "401<eos>"), ("8+8=", "16<eos>"), ("41+120=", "161<eos>"),
         ("7+5=", "12<eos>"), ("99+1=", "100<eos>"), ("3+4=", "7<eos>"), ("60+60=", "120<eos>")]
ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75]


def one_step(worker: PolicyWorker, rows: list[int]) -> dict:
    tok = worker.tokenizer
    prompts = [tok.encode(TEXTS[i][0], add_special_tokens=False) for i in rows]
    responses = [tok.encode(TEXTS[i][1], add_special_tokens=False) for i in rows]
    every = [tok.encode(r, add_special_tokens=False) for _, r in TEXTS]
    batch = build_train_batch(prompts, responses, [ADVANTAGES[i] for i in rows], tok.pad_token_id, 32)
    return worker.train([batch], [float(sum(map(len, every)))], len(TEXTS), 2)


def whole_weights(worker) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in worker.model.named_parameters()}


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    worker = PolicyWorker(load_config(None, OVERRIDES), rank, world)
    stats = one_step(worker, list(range(rank, len(TEXTS), world)))
    weights = whole_weights(worker)
    if rank == 0:
        save_file(weights, f"{out}/sharded.safetensors")
        with open(f"{out}/sharded.json", "w") as f:
            json.dump(stats, f)
    torch.distributed.destroy_process_group()


def test_two_sharded_ranks_match_one_worker_over_several_micro_batches(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    torch.set_num_threads(1)
    single = PolicyWorker(load_config(None, OVERRIDES))
    stats = one_step(single, list(range(len(TEXTS))))
    sharded_stats = json.loads((tmp_path / "sharded.json").read_text())
    assert abs(sharded_stats["grad_norm"] - stats["grad_norm"]) < 1e-5 * max(1.0, stats["grad_norm"])
    sharded = load_file(tmp_path / "sharded.safetensors")
    for name, value in whole_weights(single).items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=1e-5, msg=name)
