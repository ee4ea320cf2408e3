"""Ray start-up for a run: join a cluster or start a local Ray sized for the run, and what Ray knows
about GPUs and nodes.

Ray is imported in a function, never at import time, so a one-worker run needs no Ray. The modules
that import Ray, and why:
- rlscale/ray_runtime.py (this one): start or join Ray, size a local one, GPU and node discovery
  (a local Ray is one node: `started_locally`)
- rlscale/workers/ray_group.py: places the policy workers as Ray actors, turns Ray's errors into one line
- rlscale/rewards/ray_pool.py: scores rewards in Ray actors (`rewards.ray_actors > 0`)
- rlscale/cluster/jobs.py: `rlscale job`, a client of a remote cluster's Ray Jobs API (starts no Ray here)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rlscale.errors import UserError

if TYPE_CHECKING:
    from rlscale.config import Config


def ray_module():
    """The `ray` module, or a one-line UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError("more than one worker needs Ray: pip install 'ray[default]>=2.40'") from None
    return ray


def local_ray_cpus(cfg: Config) -> int:
    """Logical CPUs of a local Ray: every worker's and reward actor's, even on a small machine."""
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    wanted = world * cfg.cluster.cpus_per_worker + cfg.rewards.ray_actors * cfg.rewards.num_workers
    return max(os.cpu_count() or 1, wanted)


_STARTED_LOCALLY = False  # whether start_ray started a local Ray (one node, which no node joins)


def started_locally() -> bool:
    """Whether this process's Ray is a local one that start_ray started: one node, for good."""
    return _STARTED_LOCALLY and ray_module().is_initialized()


def start_ray(cfg: Config) -> None:
    """Join `cluster.address` (a running cluster, or the one a Ray job runs in), else start a local one."""
    global _STARTED_LOCALLY
    ray = ray_module()
    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    # Workers import rlscale from the same place as the driver.
    pythonpath = os.environ.get("PYTHONPATH")
    runtime_env = {"env_vars": {"PYTHONPATH": pythonpath}} if pythonpath else None
    try:
        if address:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        else:
            # "local": a fresh Ray instance of this run's own, never a cluster that `ray start` left
            # on this machine (Ray would join that one, or fail on a stale record of it)
            ray.init(address="local", num_cpus=local_ray_cpus(cfg), runtime_env=runtime_env,
                     include_dashboard=False, log_to_driver=True)
            _STARTED_LOCALLY = True
    except ConnectionError as exc:
        raise UserError(f"cluster.address {address!r}: cannot connect to Ray ({exc})") from None


def cluster_has_gpus() -> bool:
    """Whether the Ray cluster this process joined has any GPU."""
    return ray_module().cluster_resources().get("GPU", 0) > 0


def assigned_gpu_ids() -> list:
    """The GPU ids Ray assigned to this actor (inside a Ray worker process)."""
    return ray_module().get_gpu_ids()


def ray_node_alive(hostname: str) -> bool:
    """Whether a live node of this process's Ray cluster runs on `hostname` (a pod's name); True
    outside Ray (nothing to check against)."""
    import ray

    if not ray.is_initialized():
        return True
    return any(node.get("Alive") and node.get("NodeManagerHostname") == hostname for node in ray.nodes())
