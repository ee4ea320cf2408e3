"""A worker group of Ray actors: one policy worker per GPU (or per CPU slot), packed per node.

It imports Ray to place the policy workers as Ray actors and to read Ray's errors; starting or
joining Ray, its sizing and GPU discovery are rlscale/ray_runtime.py. It places a placement group
with one bundle per worker, starts one `PolicyWorker` actor per bundle with its rank environment,
has them initialise torch.distributed (NCCL on GPU, gloo on CPU) on a port rank 0 picked free, and
turns a dead worker into a one-line error naming its rank and the cause, never a hang.
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




class WorkerFailure(UserError):
    """A worker failed (OOM, lost node, crash): the step cannot finish; resume from a checkpoint."""


class WorkerDied(WorkerFailure):
    """The worker's process is gone."""


class RayWorkerGroup:
    """Same two calls as the local group: run_all and run_rank0."""

    def __init__(self, cfg: Config, use_gpus: bool, call_timeout_s: float | None = None):
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlscale.workers.group import memory_guarded
        from rlscale.workers.policy import PolicyWorker

        start_ray(cfg)
        self.world_size = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
        bundle = {"CPU": cfg.cluster.cpus_per_worker}
        if use_gpus:
            bundle["GPU"] = 1
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=cfg.cluster.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self._pg)
            raise UserError(
                f"cluster: {self.world_size} workers of {bundle} could not be placed within "
                f"{cfg.cluster.placement_timeout_s:.0f}s; the cluster has {ray.cluster_resources()}")
        # Ray is a transport: the worker stays a plain class, whose out-of-memory errors become
        # rlscale.errors.OutOfMemory in the actor's process (its device's figures)
        actor_cls = ray.remote(memory_guarded(PolicyWorker))

        def in_bundle(rank: int):
            return PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)

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
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
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
