"""A worker group of Ray actors: one policy worker per GPU (or per CPU slot), cluster.gpus_per_node
workers on each of cluster.num_nodes nodes.

It imports Ray to place the policy workers as Ray actors and to read Ray's errors; starting or
joining Ray, its sizing and GPU discovery are rlscale/ray_runtime.py. It places a placement group
with one bundle per node (`placement_layout`: cluster.gpus_per_node workers' resources each,
STRICT_SPREAD over cluster.num_nodes nodes, so the run has that many nodes or fails in one line
after cluster.placement_timeout_s, naming the nodes it found and what is missing), numbers the
workers by node (`ranks_by_node`: the ranks of one node are consecutive, rank 0's node first, so
each tensor-parallel group of T consecutive ranks, T dividing gpus_per_node,
rlscale.workers.distributed.tensor_parallel_groups, is on one node), starts one `PolicyWorker`
actor per worker with its rank environment, has them initialise torch.distributed (NCCL on GPU,
gloo on CPU) on a port rank 0 picked free on its node, and turns a dead worker into a one-line
error naming its rank, its node (ip and id) and the root cause (the exception its creation task
raised, or the node's loss), never a hang or Ray's wrapper.
"""

from __future__ import annotations

import os
import re
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


def placement_layout(cfg: Config, per_worker: dict, strategy: str | None = None) -> tuple[list[dict], str, int]:
    """(bundles, strategy, workers per bundle) of the run's placement group.

    Default: one bundle per node, cluster.gpus_per_node workers' resources each, STRICT_SPREAD (each
    bundle on its own node) over cluster.num_nodes nodes, STRICT_PACK for one node: the run gets
    exactly the nodes it asks for, so many workers on each, and a tensor-parallel group (T
    consecutive ranks, T dividing gpus_per_node) cannot span nodes. `strategy` given (tests of
    the rank order): one bundle per tensor-parallel group under that strategy, as Ray pleases."""
    tp = cfg.policy.generation.tensor_parallel_size  # divides cluster.gpus_per_node (rlscale.config.check_tensor_parallel)
    if strategy is None:
        per_bundle, count = cfg.cluster.gpus_per_node, cfg.cluster.num_nodes
        strategy = "STRICT_SPREAD" if count > 1 else "STRICT_PACK"
    else:
        per_bundle, count = tp, cfg.cluster.num_nodes * cfg.cluster.gpus_per_node // tp
    bundle = {key: value * per_bundle for key, value in per_worker.items()}
    return [dict(bundle) for _ in range(count)], strategy, per_bundle


def alive_nodes(ray) -> list[dict]:
    """Ray's records of the cluster's live nodes."""
    return [node for node in ray.nodes() if node.get("Alive")]


def node_name(node_id: str, nodes: list[dict] | None = None) -> str:
    """'node 10.0.0.5 (id 1a2b3c4d)': a node by its ip and the start of its Ray id."""
    ip = next((n.get("NodeManagerAddress") for n in nodes or () if n.get("NodeID") == node_id), None)
    return f"node {ip or '?'} (id {node_id[:8]})"


def placement_shortfall(cfg: Config, bundle: dict, nodes: list[dict], waited_s: float | None) -> str:
    """The one line of a placement that did not happen: what the run needs per node, which live
    nodes could hold it (by their total resources) and how many are missing."""
    count = cfg.cluster.num_nodes
    fits = [n for n in nodes if all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundle.items())]
    names = ", ".join(f"{n.get('NodeManagerAddress')} (id {n.get('NodeID', '')[:8]})" for n in fits) or "none"
    need = (f"cluster.num_nodes={count} × cluster.gpus_per_node={cfg.cluster.gpus_per_node}: "
            f"{count} node(s) with {bundle} each")
    if len(fits) < count:
        why = (f"{len(fits)} of the cluster's {len(nodes)} live node(s) can hold that ({names}); "
               f"{count - len(fits)} node(s) of {bundle} missing")
    else:
        why = f"{len(fits)} live node(s) can hold that ({names}) but other work holds their resources"
    when = f" within {waited_s:.0f}s (cluster.placement_timeout_s)" if waited_s is not None else ""
    return f"cluster: the workers could not be placed{when}: the run needs {need}; {why}"


class RayWorkerGroup:
    """Same two calls as the local group: run_all and run_rank0."""

    def __init__(self, cfg: Config, use_gpus: bool, call_timeout_s: float | None = None, *,
                 worker_cls: type | None = None, strategy: str | None = None):
        """worker_cls: the actors' class (default PolicyWorker), constructed as (cfg, rank, world_size);
        strategy: tests only, one bundle per tensor-parallel group under this Ray strategy
        (`placement_layout`; SPREAD interleaves the nodes)."""
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlscale.ray_runtime import started_locally
        from rlscale.workers.group import memory_guarded

        if worker_cls is None:
            from rlscale.workers.policy import PolicyWorker as worker_cls

        start_ray(cfg)
        self.world_size = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
        per_worker = {"CPU": cfg.cluster.cpus_per_worker, **({"GPU": 1} if use_gpus else {})}
        bundles, strategy, per_bundle = placement_layout(cfg, per_worker, strategy)
        if started_locally() and cfg.cluster.num_nodes > len(alive_nodes(ray)):
            # a Ray this run started is this machine alone: no node will ever join it
            raise UserError(placement_shortfall(cfg, bundles[0], alive_nodes(ray), None)
                            + "; a local Ray is one node: join a cluster with cluster.address (or RAY_ADDRESS)")
        self._pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=cfg.cluster.placement_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self._pg)
            raise UserError(placement_shortfall(cfg, bundles[0], alive_nodes(ray), cfg.cluster.placement_timeout_s))
        # ranks by node: rank r is worker r % per_bundle of bundle order[r // per_bundle]
        bundle_nodes = _bundle_nodes(self._pg, len(bundles))
        order = ranks_by_node(bundle_nodes)
        self.bundle_of_rank = [order[rank // per_bundle] for rank in range(self.world_size)]
        self.node_of_rank = [bundle_nodes[b] for b in self.bundle_of_rank]
        self._nodes = alive_nodes(ray)  # ips of the nodes, for the lines that name them
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
        try:
            self.facts = self._get([actor.ready.remote() for actor in self.actors], "ready")
        except BaseException:
            self.shutdown(grace_s=0.0)  # the placement group and the live actors go with the failed start
            raise

    def where(self, rank: int) -> str:
        """'worker rank 3 on node 10.0.0.5 (id 1a2b3c4d)'."""
        node = self.node_of_rank[rank] if rank < len(self.node_of_rank) else None
        return f"worker rank {rank}" + (f" on {node_name(node, self._nodes)}" if node else "")

    def placement_line(self) -> str:
        """'workers: ranks 0-1 on node 10.0.0.5 (id 1a2b3c4d), ranks 2-3 on node ...' (said at start)."""
        runs: list[list] = []
        for rank, node in enumerate(self.node_of_rank):
            if runs and runs[-1][0] == node:
                runs[-1][2] = rank
            else:
                runs.append([node, rank, rank])
        return "workers: " + ", ".join(
            (f"rank {first}" if first == last else f"ranks {first}-{last}") + f" on {node_name(node, self._nodes)}"
            for node, first, last in runs)

    def _get(self, refs: list, method: str | None = None) -> list[Any]:
        """ray.get, but a failed worker fails the call at once with its rank, node and cause."""
        ray = ray_module()
        pending = list(refs)
        started = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                failure = self._failure(ray, ref, refs.index(ref), method)
                if failure is None:
                    continue
                if pending and not isinstance(failure, WorkerDied):
                    # A dead rank's peers fail in their collectives too, sometimes before Ray
                    # reports the death: name the rank that died, not a bystander.
                    late, _ = ray.wait(pending, num_returns=len(pending), timeout=5.0)
                    deaths = [f for f in (self._failure(ray, r, refs.index(r), method) for r in late)
                              if isinstance(f, WorkerDied)]
                    failure = deaths[0] if deaths else failure
                raise failure
            if self.call_timeout_s and time.monotonic() - started > self.call_timeout_s:
                raise WorkerFailure(f"workers did not answer within {self.call_timeout_s:.0f}s")
        return ray.get(refs)

    def _failure(self, ray, ref, rank: int, method: str | None = None) -> Exception | None:
        """The error a finished call ended with, as the one line the user will see (rank, node,
        root cause); None if it succeeded."""
        from ray.exceptions import RayActorError

        try:
            ray.get(ref)
        except RayActorError as exc:
            node = self.node_of_rank[rank] if rank < len(self.node_of_rank) else None
            return WorkerDied(f"{self.where(rank)} died: {death_cause(ray, exc, node)}")
        except Exception as exc:  # noqa: BLE001 - a task error, turned into its line below
            return _failure_of(exc, self.where(rank), rank, method)
        return None

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


def _failure_of(exc: BaseException, where: str, rank: int, method: str | None = None) -> Exception:
    """A worker call's task error (a RayTaskError) as its one-line error."""
    from ray.exceptions import RayTaskError

    if not isinstance(exc, RayTaskError):
        return WorkerFailure(f"{where} failed: {root_cause(exc)}")
    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    oom = out_of_memory_cause(cause, rank, getattr(exc, "traceback_str", ""), method)
    if oom is not None:
        return oom
    if isinstance(cause, UserError):
        return UserError(str(cause))
    return WorkerFailure(f"{where} failed: {root_cause(cause)}")


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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*): (.+)$")


def root_cause(exc: BaseException, limit: int = 300) -> str:
    """The line of a worker's error that says why, without Ray's wrapper.

    - an actor whose creation task (its constructor) raised: Ray's ActorDiedError keeps only the
      text of the task error (header, remote traceback, then 'module.Type: message' last); the
      last line, as 'Type: message' ("ValueError: Unable to find address for: ens5")
    - an actor that died otherwise (ActorDiedErrorContext: tab-indented fields, then Ray's reason):
      the reason ("The actor is dead because its worker process has died. ...")
    - a RayTaskError of a call: its cause ('Type: message'); anything else: its first line."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    text = exc.error_msg if isinstance(exc, RayActorError) and getattr(exc, "error_msg", None) else str(exc)
    lines = [line.rstrip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if "creation task" in lines[0] or isinstance(exc, RayTaskError):
        found = _EXCEPTION_LINE.match(lines[-1].strip())
        line = f"{found.group(1)}: {found.group(2)}" if found else lines[-1].strip()
    elif isinstance(exc, RayActorError):
        reason = [line.strip() for line in lines[1:] if not line.startswith("\t")]
        line = " ".join(reason) or lines[0].strip()
    elif len(lines) == 1 and not isinstance(exc, UserError):
        line = f"{type(exc).__name__}: {lines[0]}"
    else:
        line = lines[0].strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"


def node_gone(ray, node_id: str | None, wait_s: float = 0.0) -> dict | None:
    """Ray's record of `node_id` once the cluster counts it dead (polled up to wait_s); None while alive."""
    deadline = time.monotonic() + wait_s
    while node_id:
        record = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
        if record is not None and not record.get("Alive"):
            return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
    return None


NODE_DEATH_WAIT_S = 20.0  # how long a worker that became unreachable waits for Ray to say whether its node died


def death_cause(ray, exc: BaseException, node_id: str | None) -> str:
    """Why an actor died: its node's loss (when Ray counts the node dead) or its own cause."""
    from ray.exceptions import ActorUnavailableError

    cause = root_cause(exc)
    # unreachable (its connection broke): wait until Ray knows whether the node went with it
    wait = NODE_DEATH_WAIT_S if isinstance(exc, ActorUnavailableError) or "node" in cause.lower() else 0.0
    record = node_gone(ray, node_id, wait)
    if record is None:
        return cause
    said = (record.get("DeathReasonMessage") or "").strip()
    # the node's loss is the root cause: Ray's own words for the broken connection add nothing
    return "its node is gone" + (f" ({said})" if said else "")
