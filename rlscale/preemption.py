"""Stopping a run early without losing work: SIGTERM/SIGINT, and a wall-clock deadline.

Spot GPUs are preempted with a SIGTERM and a grace period (about 30 s on GKE) before SIGKILL.
While the training loop runs, `StopSignals` turns SIGTERM and SIGINT into a request the loop
reads at its safe points (between steps, and between the phases of a step); the loop then saves
what it can and `train()` raises `RunStopped`, which the CLI turns into a documented exit code:

    143  stopped by SIGTERM (128 + 15, what a shell reports for a SIGTERM)
    130  stopped by SIGINT (Ctrl-C; 128 + 2)
    75   stopped before checkpointing.checkpoint_must_save_by (EX_TEMPFAIL: run the command again)

A second signal while stopping exits at once with the same code: a save still in flight then
stays an uncommitted tmp_step_N/, which is never trusted and is removed at the next start.

On a cluster, a worker pod being stopped (a preempted spot node) cannot signal the driver, which
runs on the head; its preStop hook (`rlscale.cluster.render.WORKER_PRE_STOP`) instead leaves a
request file in a directory on the shared volume (RLSCALE_STOP_REQUESTS) and waits. The driver
reads it at the same safe points as a signal (`StopRequests`), saves, and removes the request once
the save has committed; the hook then returns and the pod stops, its GPU worker having taken part
in the save. Exit code 143, as for SIGTERM. Which nodes are still in the Ray cluster is asked of
rlscale/ray_runtime.py: this module imports no Ray.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from rlscale.ray_runtime import ray_node_alive  # which pods' nodes are still in the Ray cluster

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_DEADLINE = 75  # sysexits.h EX_TEMPFAIL: not finished, try again

_EXIT_CODES = {signal.SIGTERM: EXIT_SIGTERM, signal.SIGINT: EXIT_SIGINT}


class RunStopped(Exception):
    """The run stopped early on purpose, after saving what it could; resume with the same command."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


STOP_REQUESTS_ENV = "RLSCALE_STOP_REQUESTS"


def _remove(path: Path) -> None:
    """A request file gone; an error (a shared file system's hiccup) is said, never raised: it
    must not replace what the run is doing or stopping for. The pod then waits out its grace."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        print(f"rlscale: cannot remove the stop request {path}: {exc.strerror or exc}", file=sys.stderr, flush=True)


class StopRequests:
    """Stop requests left by pods about to be stopped: one file per pod, named by its hostname,
    in `directory` (one per RayCluster; see the module's docstring).

    A run obeys and releases only the requests of pods that host its own workers (`hosts`; None =
    any pod): two jobs on one RayCluster share the directory, and one must not stop for, or
    release, the other's pod. A request is stale, removed and never obeyed, when its pod is no
    longer in the Ray cluster (its hook was killed before any driver saw it) or a minute after its
    hook's wait ran out (a line `waits until <unix time>`; a pod restarted under the same name
    must not stop every later job). Two jobs with workers in one pod are not told apart: the first
    to save releases it."""

    def __init__(self, directory: str | os.PathLike | None, alive: Callable[[str], bool] = ray_node_alive,
                 hosts: Iterable[str] | None = None):
        self.directory = Path(directory) if directory else None
        self.alive = alive
        self.hosts = None if hosts is None else frozenset(hosts)

    @classmethod
    def from_env(cls) -> StopRequests:
        """Requests for this run, which owns no pod until `watch` names those of its workers."""
        return cls(os.environ.get(STOP_REQUESTS_ENV) or None, hosts=())

    def watch(self, hosts: Iterable[str]) -> None:
        """Obey and release the requests of these pods (those running this run's workers)."""
        self.hosts = frozenset(hosts)

    def _ours(self, pod: str) -> bool:
        return self.hosts is None or pod in self.hosts

    def _entries(self) -> list[Path]:
        if self.directory is None:
            return []
        try:
            return sorted(p for p in self.directory.iterdir() if not p.name.startswith("."))
        except OSError:  # no directory yet: no request
            return []

    def pending(self) -> tuple[str, float] | None:
        """(pod, seconds since its request) of a live request from one of this run's pods. A
        directory listing per safe point: a few per step, each a metadata operation of about a
        millisecond on Lustre; a request's file is read only when there is one."""
        for path in self._entries():
            try:
                seen = path.stat()
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if _wait_ran_out(text) or not self.alive(path.name):
                _remove_if_unchanged(path, seen)
            elif self._ours(path.name):
                return path.name, max(time.time() - seen.st_mtime, 0.0)
        return None

    def acknowledge(self) -> None:
        """Remove the requests of this run's pods (the driver has saved, or is exiting and needs
        no worker any more): their hooks return and their pods stop. Two stopped at once both go."""
        for path in self._entries():
            if self._ours(path.name):
                _remove(path)


# A request is stale this long after its hook's wait ran out by this machine's clock: the pods'
# clocks may disagree by seconds, and a live request must never be taken for a stale one.
CLOCK_SLACK_S = 60.0


def _wait_ran_out(request: str) -> bool:
    for line in request.splitlines():
        if line.startswith("waits until "):
            try:
                return time.time() > float(line.removeprefix("waits until ")) + CLOCK_SLACK_S
            except ValueError:
                return False
    return False


def _remove_if_unchanged(path: Path, seen: os.stat_result) -> None:
    """Remove a stale request unless a new one replaced it since it was read (a hook writes a new
    file and renames it over the old: another inode)."""
    try:
        now = path.stat()
    except OSError:
        return
    if (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns):
        _remove(path)


class StopSignals:
    """While entered (in the main thread), SIGTERM and SIGINT record a stop request instead of
    ending the process; the previous handlers (Ray's driver installs one) come back on exit.
    `requests`, if given, are read like a SIGTERM (a worker pod's stop)."""

    def __init__(self, requests: StopRequests | None = None) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}
        self.requests = requests
        self.requester: str | None = None  # the pod whose stop request is obeyed
        self._signalled = False  # a signal came while stopping for a pod (the next one exits at once)

    @property
    def requested(self) -> bool:
        if self.signum is None and self.requests is not None:
            found = self.requests.pending()
            if found is not None:
                pod, age = found
                # the grace started when the pod's hook wrote the request
                self.signum, self.received_at, self.requester = signal.SIGTERM, time.monotonic() - age, pod
                print(f"rlscale: pod {pod} is being stopped ({self.requests.directory / pod}): saving and stopping "
                      "at this safe point", file=sys.stderr, flush=True)
        return self.signum is not None

    @property
    def name(self) -> str:
        if self.requester is not None:
            return f"the stop of pod {self.requester}"
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def acknowledge(self) -> None:
        """The stop is done (saved, or given up): release the pods that asked for it."""
        if self.requests is not None:
            self.requests.acknowledge()

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES.get(self.signum, EXIT_SIGTERM)

    def seconds_since(self) -> float:
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python only allows it there
            for signum in _EXIT_CODES:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame) -> None:
        # os.write, not print: a handler may interrupt a print of the main thread
        if self.requester is not None and not self._signalled:  # stopping for a pod: this is the first signal
            self._signalled = True
            os.write(2, f"rlscale: {signal.Signals(signum).name} received: already stopping\n".encode())
            return
        if self.signum is not None:
            os.write(2, f"rlscale: second {signal.Signals(signum).name}: exiting now; a save in flight "
                        "is discarded at the next start\n".encode())
            os._exit(_EXIT_CODES.get(signum, EXIT_SIGTERM))
        self.signum, self.received_at = signum, time.monotonic()
        os.write(2, f"rlscale: {signal.Signals(signum).name} received: saving and stopping at the next "
                    "safe point\n".encode())


def save_fits(grace_s: float, since_signal_s: float, save_estimate_s: float | None) -> bool:
    """Whether an emergency save should be tried. The estimate is the longest durable time
    (snapshot start to commit) of this invocation's saves; with none measured yet it is always
    tried: if SIGKILL cuts it short, the save is an uncommitted tmp dir and costs nothing."""
    if save_estimate_s is None:
        return True
    return since_signal_s + save_estimate_s <= grace_s


class Deadline:
    """checkpointing.checkpoint_must_save_by: a wall-clock budget counted from `started`."""

    def __init__(self, budget_s: float | None, started: float):
        self.budget_s, self.started = budget_s, started

    def due(self, step_estimate_s: float | None, save_estimate_s: float | None) -> bool:
        """True when one more step and its save would end past the budget. Not before a step has
        been timed (so a restart always makes progress); a save not yet measured counts as 0."""
        if self.budget_s is None or step_estimate_s is None:
            return False
        elapsed = time.perf_counter() - self.started
        return elapsed + step_estimate_s + (save_estimate_s or 0.0) > self.budget_s
