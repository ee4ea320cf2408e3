"""A worker group of Ray actors: one policy worker per GPU (or per CPU slot), packed per node.

It imports Ray to place the policy workers as Ray actors and to read Ray's errors; starting or
joining Ray, its sizing and GPU discovery are rlscale/ray_runtime.py. It places a placement group
with one bundle per tensor-parallel group (policy.generation.tensor_parallel_size workers, so that
a group never spans nodes; one worker per bundle without tensor parallelism), numbers the workers
by node (`ranks_by_node`: the ranks of one node are consecutive, so each group of T consecutive
ranks, rlscale.workers.distributed.tensor_parallel_groups, is on one node), starts one
`PolicyWorker` actor per worker with its rank environment, has them initialise torch.distributed
(NCCL on GPU, gloo on CPU) on a port rank 0 picked free on its node, and turns a dead worker into
a one-line error naming its rank and the cause, never a hang.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlscale.ckpt.faults import ENV as FAULT_ENV
from rlscale.config import Config
from rlscale.errors import OutOfMemory, UserError, is_out_of_memory, out_of_memory
from rlscale.ray_runtime import ray_module, start_ray


def _rendezvous_impl() -> tuple[str, int]:
    import ray

    from rlscale.workers.distributed import free_port

    return ray.util.get_node_ip_address(), free_port()


def ranks_by_node(bundle_nodes: list[str]) -> list[int]:
    """The bundle of each rank, given each bundle's node: the bundles of one node get consecutive
    ranks, rank 0's node (bundle 0's, where the rendezvous is) first, then the other nodes by id;
    on a node, bundles keep their order. Ray's placement may interleave the nodes (bundle 1 on
    another node than bundles 0 and 2): numbered by bundle, a node's ranks would not be
    consecutive and a tensor-parallel group of consecutive ranks could span nodes."""
    first = bundle_nodes[0] if bundle_nodes else None
    return sorted(range(len(bundle_nodes)), key=lambda b: (bundle_nodes[b] != first, bundle_nodes[b], b))


def _bundle_nodes(pg, count: int) -> list[str]:
    """The node id of each of the placement group's bundles (placed: after pg.ready())."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(pg)["bundles_to_node_id"]
    return [placed[b] for b in range(count)]


class WorkerFailure(UserError):
    """A worker failed (OOM, lost node, crash): the step cannot finish; resume from a checkpoint."""


class WorkerDied(WorkerFailure):
    """The worker's process is gone."""


class RayWorkerGroup:
    """Same two calls as the local group: run_all and run_rank0."""

    def __init__(self, cfg: Config, use_gpus: bool, call_timeout_s: float | None = None, *,
                 worker_cls: type | None = None, strategy: str = "PACK"):
        """worker_cls: the actors' class (default PolicyWorker), constructed as (cfg, rank, world_size);
        strategy: Ray's placement strategy of the bundles (tests spread them to interleave nodes)."""
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlscale.workers.group import memory_guarded

        if worker_cls is None:
            from rlscale.workers.policy import PolicyWorker as worker_cls

        start_ray(cfg)
        self.world_size = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
        tp = cfg.policy.generation.tensor_parallel_size  # divides cluster.gpus_per_node (rlscale.config.check_tensor_parallel)
        # one bundle per tensor-parallel group: Ray places a bundle on one node
        per_worker = {"CPU": cfg.cluster.cpus_per_worker, **({"GPU": 1} if use_gpus else {})}
        bundle = {key: value * tp for key, value in per_worker.items()}
        groups = self.world_size // tp
        self._pg = placement_group([dict(bundle) for _ in range(groups)], strategy=strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=cfg.cluster.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self._pg)
            what = f"{self.world_size} workers of {per_worker}" + (
                f" in {groups} groups of {tp} on one node each" if tp > 1 else "")
            raise UserError(
                f"cluster: {what} could not be placed within "
                f"{cfg.cluster.placement_timeout_s:.0f}s; the cluster has {ray.cluster_resources()}")
        # ranks by node: rank r is worker r % tp of bundle order[r // tp]
        bundle_nodes = _bundle_nodes(self._pg, groups)
        order = ranks_by_node(bundle_nodes)
        self.bundle_of_rank = [order[rank // tp] for rank in range(self.world_size)]
        self.node_of_rank = [bundle_nodes[b] for b in self.bundle_of_rank]
        # Ray is a transport: the worker stays a plain class, whose out-of-memory errors become
        # rlscale.errors.OutOfMemory in the actor's process (its device's figures)
        actor_cls = ray.remote(memory_guarded(worker_cls))

        def in_bundle(rank: int):
            return PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=self.bundle_of_rank[rank])

        # Rank 0's node hosts the rendezvous; a port the OS hands out there cannot collide
        # with another run's.
        rendezvous = ray.remote(_rendezvous_impl).options(num_cpus=0, scheduling_strategy=in_bundle(0))
        address, port = ray.get(rendezvous.remote())
        env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "WORLD_SIZE": str(self.world_size),
               # developer profiling (telemetry/torch_profile.py) reaches workers on any node
               **{k: v for k, v in os.environ.items() if k.startswith("RLSCALE_PROFILE_")},
               # fault injection in the workers (tests; rlscale/ckpt/faults.py)
               **{k: v for k, v in os.environ.items() if k == FAULT_ENV}}
        if use_gpus:  # every GPU stays visible to every worker: NCCL's P2P/NVLink paths need it
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        self.actors = [
            actor_cls.options(
                num_cpus=per_worker["CPU"], num_gpus=per_worker.get("GPU", 0), max_restarts=0,
                scheduling_strategy=in_bundle(rank),
                runtime_env={"env_vars": {**env, "RANK": str(rank)}},
            ).remote(cfg, rank, self.world_size)
            for rank in range(self.world_size)
        ]
        self.call_timeout_s = call_timeout_s
        self.facts = self._get([actor.ready.remote() for actor in self.actors], "ready")

    def _get(self, refs: list, method: str | None = None) -> list[Any]:
        """ray.get, but a failed worker fails the call at once with its rank and cause."""
        ray = ray_module()
        pending = list(refs)
        started = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                failure = _failure(ray, ref, refs.index(ref), method)
                if failure is None:
                    continue
                if pending and not isinstance(failure, WorkerDied):
                    # A dead rank's peers fail in their collectives too, sometimes before Ray
                    # reports the death: name the rank that died, not a bystander.
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=5.0)
                    deaths = [f for f in (_failure(ray, r, refs.index(r), method) for r in late)
                              if isinstance(f, WorkerDied)]
                    failure = deaths[0] if deaths else failure
                raise failure
            if self.call_timeout_s and time.monotonic() - started > self.call_timeout_s:
                raise WorkerFailure(f"workers did not answer within {self.call_timeout_s:.0f}s")
        return ray.get(refs)

    def run_all(self, method: str, per_worker_args: list[tuple] | None = None, **kwargs) -> list[Any]:
        args = per_worker_args or [()] * self.world_size
        if len(args) != self.world_size:
            raise ValueError(f"{method}: {len(args)} argument sets for {self.world_size} workers")
        return self._get([getattr(actor, method).remote(*a, **kwargs) for actor, a in zip(self.actors, args)],
                         method)

    def run_rank0(self, method: str, *args, **kwargs) -> Any:
        return self._get([getattr(self.actors[0], method).remote(*args, **kwargs)], method)[0]

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every worker to exit, then force-kill those still there (hung in a collective after a
        peer died). A forced kill reaches a live worker as SIGTERM, which Ray reports as a worker
        traceback in the driver's stderr: workers that can exit cleanly do so first."""
        ray = ray_module()
        exits = [actor.__ray_terminate__.remote() for actor in self.actors]
        ray.wait(exits, num_returns=len(exits), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        ray.util.remove_placement_group(self._pg)


def _failure(ray, ref, rank: int, method: str | None = None) -> Exception | None:
    """The error a finished call ended with, as the one-line error the user will see; None if it succeeded."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        ray.get(ref)
    except RayActorError as exc:
        return WorkerDied(f"worker rank {rank} died: {_cause(exc)}")
    except RayTaskError as exc:
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        oom = out_of_memory_cause(cause, rank, getattr(exc, "traceback_str", ""), method)
        if oom is not None:
            return oom
        if isinstance(cause, UserError):
            return UserError(str(cause))
        return WorkerFailure(f"worker rank {rank} failed: {_cause(cause)}")
    return None


def out_of_memory_cause(cause: BaseException, rank: int, remote_traceback: str = "",
                        method: str | None = None) -> OutOfMemory | None:
    """The OutOfMemory a worker's call failed with (a RayTaskError's cause, or the task error
    itself when Ray made it a RayTaskError(OutOfMemory)), as the worker made it; an out-of-memory
    error that reached Ray unconverted becomes one here, named by rank, with the figures its
    message gives. None: the call failed otherwise."""
    from ray.exceptions import RayTaskError

    if isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    if isinstance(cause, OutOfMemory):  # the worker names its rank when it has peers
        return OutOfMemory(**cause.fields())  # a plain one (not Ray's dual class), same fields
    if is_out_of_memory(cause):
        found = out_of_memory(cause, method, rank=rank, here=False)
        found.traceback_text = remote_traceback or found.traceback_text
        return found
    return None


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # Ray's messages start with boilerplate; keep the line that says why.
    for line in text:
        lowered = line.lower()
        if any(word in lowered for word in ("memory", "oom", "killed", "node", "exit", "died", "signal")):
            return line.strip()[:300]
    return (text[0] if text else type(exc).__name__)[:300]
