"""Worker ranks on a Ray cluster of two nodes (two raylets on this machine): the ranks
of a node are consecutive whatever order Ray placed the bundles in, and a tensor-parallel group of
T consecutive ranks (one placement bundle) never spans nodes; torch.distributed (gloo) rendezvouses
on rank 0's node and the groups it forms are those nodes' ranks."""

from __future__ import annotations

import pytest

from rlscale.config_loading import load_config
from tests.integration.helpers import loopback_ray_cluster

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node of 3 logical CPUs each: 4 one-CPU workers do not fit on one node,
    and a node holds one bundle of 2 workers (so packing 4 single workers would put 3 on one)."""
    with loopback_ray_cluster({"num_cpus": 3, "include_dashboard": False}, {"num_cpus": 3}) as cluster:
        yield cluster


def make_group(cluster, tensor_parallel: int, strategy: str):
    from rlscale.workers.ray_group import RayWorkerGroup
    from tests.integration.ray_node_workers import NodeReporter

    overrides = ["cluster.num_nodes=2", "cluster.gpus_per_node=2", "cluster.use_gpus=false",
                 f"cluster.address={cluster.address}", "cluster.placement_timeout_s=60"]
    if tensor_parallel > 1:
        overrides.append(f"policy.generation.tensor_parallel_size={tensor_parallel}")
    cfg = load_config(None, overrides)
    return RayWorkerGroup(cfg, use_gpus=False, worker_cls=NodeReporter, strategy=strategy)


def consecutive_by_node(nodes: list[str]) -> bool:
    """Each node's entries form one run."""
    runs = [node for i, node in enumerate(nodes) if i == 0 or nodes[i - 1] != node]
    return len(runs) == len(set(runs))


def check_facts(group, facts: list[dict]) -> None:
    assert [f["rank"] for f in facts] == [f["env_rank"] for f in facts] == list(range(4))
    assert [f["node"] for f in facts] == group.node_of_rank  # the actors run where the group says
    assert all(f["rank_sum"] == 0 + 1 + 2 + 3 for f in facts)
    assert group.bundle_of_rank[0] == 0  # rank 0 (and the rendezvous) stays on bundle 0's node
    assert consecutive_by_node(group.node_of_rank), group.node_of_rank
    assert len(set(group.node_of_rank)) == 2


def test_ranks_of_a_node_are_consecutive_when_ray_interleaves_the_nodes(two_nodes):
    group = make_group(two_nodes, 1, "SPREAD")
    try:
        by_bundle = [group.node_of_rank[group.bundle_of_rank.index(b)] for b in range(4)]
        # what the test is about: numbered by bundle, the ranks would not be consecutive per node
        assert not consecutive_by_node(by_bundle), f"Ray did not interleave the bundles: {by_bundle}"
        check_facts(group, group.facts)
    finally:
        group.shutdown()


def test_a_tensor_parallel_group_never_spans_nodes(two_nodes):
    group = make_group(two_nodes, 2, "PACK")
    try:
        facts = group.facts
        check_facts(group, facts)
        for f in facts:
            assert f["group_rank"] == f["rank"] % 2
            first = f["rank"] - f["rank"] % 2
            assert [rank for rank, _ in f["members"]] == [first, first + 1]  # T consecutive ranks
            assert {node for _, node in f["members"]} == {f["node"]}  # all on this worker's node
    finally:
        group.shutdown()
