"""A light stand-in for PolicyWorker in Ray worker-group tests (tests/integration/test_ray_node_order.py):
constructed as a policy worker is (cfg, rank, world_size), it joins torch.distributed with the
environment the group gave it, forms the tensor-parallel groups as the policy worker does, and
reports its node and its group's members. Its own module: Ray's worker processes import it."""

from __future__ import annotations

import os


class NodeReporter:
    def __init__(self, cfg, rank: int, world_size: int):
        import ray
        import torch
        import torch.distributed as dist

        from rlscale.workers import distributed

        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.node = ray.get_runtime_context().get_node_id()
        distributed.init_process_group(rank, world_size, torch.device("cpu"), 120.0)
        size = cfg.policy.generation.tensor_parallel_size
        self.group, self.group_rank = distributed.tensor_parallel_groups(size)
        # who is in my group, as torch.distributed sees it: (global rank, node) of each member
        self.members = [(rank, self.node)]
        if self.group is not None:
            self.members = [None] * size
            dist.all_gather_object(self.members, (rank, self.node), group=self.group)
        world = torch.tensor([rank], dtype=torch.long)
        dist.all_reduce(world)  # the whole world rendezvoused (on rank 0's node)
        self.rank_sum = int(world.item())

    def ready(self) -> dict:
        return {"rank": self.rank, "env_rank": int(os.environ["RANK"]), "node": self.node,
                "group_rank": self.group_rank, "members": self.members, "rank_sum": self.rank_sum}


class FailsToStart:
    """A worker whose constructor fails on the last rank, as a policy worker does whose
    torch.distributed cannot find its socket interface (NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME=ens5
    on a node without it)."""

    def __init__(self, cfg, rank: int, world_size: int):
        if rank == world_size - 1:
            raise ValueError("Unable to find address for: ens5")

    def ready(self) -> dict:
        return {}
