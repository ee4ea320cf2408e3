import torch

from rlscale.workers.distributed import shard_reference


def test_reference_sharding_follows_the_setting_and_stays_whole_off_gpu():
    model = torch.nn.Linear(4, 4)
    assert shard_reference(True, model, torch.device("cpu")) is True
    assert shard_reference(False, model, torch.device("cpu")) is False
    assert shard_reference(None, model, torch.device("cpu")) is False  # gloo: a whole copy, no all-gathers


def _clip_rank(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rlscale.workers.distributed import clip_grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    rows = slice(rank * 4, rank * 4 + 4)  # each rank its half; gradients are averaged over ranks
    (model(x[rows]) ** 2).sum().backward()
    norm = clip_grad_norm(list(model.parameters()), 0.05, sharded=True)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"norm": norm, "grads": grads}, f"{out}/sharded.pt")
    # both ranks reach the teardown together: a gloo group destroyed while its peer is still
    # talking to it has aborted the process ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def test_sharded_clip_matches_torch_on_the_whole_gradients(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_clip_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ((model(x[:4]) ** 2).sum() + (model(x[4:]) ** 2).sum()).div(2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    sharded = torch.load(tmp_path / "sharded.pt")
    assert norm > 0.05  # the clip binds
    torch.testing.assert_close(sharded["norm"], norm)
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharded["grads"][name], p.grad, msg=name)


def test_sharded_clip_without_gradients_is_a_zero_norm():
    from rlscale.workers.distributed import clip_grad_norm

    model = torch.nn.Linear(3, 2)  # no backward yet: no gradients, and no collective is needed
    assert float(clip_grad_norm(list(model.parameters()), 1.0, sharded=True)) == 0.0
