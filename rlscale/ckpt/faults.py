"""Named fault points, for the fault-injection tests: a real kill at a chosen moment of a save.

    RLSCALE_FAULT=commit.after_manifest:2          SIGKILL this process at the 2nd time it passes there
    RLSCALE_FAULT=loop.after_step:3:SIGTERM        send itself SIGTERM instead (a preemption)
    RLSCALE_FAULT=loop.after_step:3:PRESTOP        run a worker pod's preStop hook (its stop request
                                                   in RLSCALE_STOP_REQUESTS), as a pod being stopped
    RLSCALE_FAULT=worker.train:3:OOM               raise torch.OutOfMemoryError in the policy worker
                                                   as its 3rd `train` call starts (MEMORY: the host's
                                                   MemoryError); in each worker's own process

Without the variable (always, outside tests) `maybe_fault` is a dictionary lookup. The points, in
the order a save passes them (see checkpointer.py and engine.py):

    snapshot.before        the controller starts a save (tmp_step_N/ made, workers not yet copied)
    snapshot.after         every worker's state is copied; writers are starting
    persist.after_file     a writer thread has written and fsynced one file (any rank, any writer)
    commit.before_manifest every data file is durable; manifest.json not yet written
    commit.after_manifest  manifest.json written and fsynced; tmp_step_N/ not yet renamed
    commit.after_rename    renamed to step_N/; the checkpoint dir not yet fsynced
    commit.after_fsync     the commit is durable; retention not yet run
    retention.renamed_aside a step retention drops has been renamed aside, not yet deleted

and in the training loop: loop.after_generate, loop.after_step; in the policy workers, as a
method the controller calls starts (rlscale.workers.group.call_worker): worker.METHOD, e.g.
worker.generate, worker.train, worker.checkpoint_snapshot. A worker counts its own passages: with
validation at the start, worker.generate:2 is step 1's rollout.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "RLSCALE_FAULT"

_lock = threading.Lock()
_hits: dict[str, int] = {}


def _parse(text: str) -> tuple[str, int, str]:
    point, _, rest = text.partition(":")
    nth, _, name = rest.partition(":")
    return point, int(nth or 1), name or "SIGKILL"


def _worker_pre_stop() -> None:
    """Start the worker pods' preStop hook in a process of its own, as Kubernetes would, and return
    once its request is there; it waits (up to a minute) for the run to acknowledge it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from rlscale.cluster.render import WORKER_PRE_STOP
    from rlscale.preemption import STOP_REQUESTS_ENV

    directory = Path(os.environ[STOP_REQUESTS_ENV])
    # no process title to look for: a local run's policy worker is this process
    subprocess.Popen([sys.executable, "-c", WORKER_PRE_STOP, STOP_REQUESTS_ENV, "60", ""])
    while not any(not p.name.startswith(".") for p in directory.glob("*")):
        time.sleep(0.05)


def maybe_fault(point: str) -> None:
    """Signal this process (or run a pod's preStop hook, or raise an out-of-memory error) when
    RLSCALE_FAULT names `point` and this is its nth passage."""
    spec = os.environ.get(ENV)
    if not spec or not spec.startswith(point + ":") and spec != point:
        return
    name, nth, action = _parse(spec)
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hit = _hits[name] == nth
    if hit and action == "PRESTOP":
        _worker_pre_stop()
    elif hit and action == "OOM":
        import torch

        raise torch.OutOfMemoryError(f"injected out of memory at {name} (RLSCALE_FAULT={spec})")
    elif hit and action == "MEMORY":
        raise MemoryError(f"injected host out of memory at {name} (RLSCALE_FAULT={spec})")
    elif hit:
        os.kill(os.getpid(), getattr(signal, action))
