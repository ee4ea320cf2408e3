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
"""

from __future__ import annotations

import os
import signal
import threading
import time

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_DEADLINE = 75  # sysexits.h EX_TEMPFAIL: not finished, try again

_EXIT_CODES = {signal.SIGTERM: EXIT_SIGTERM, signal.SIGINT: EXIT_SIGINT}


class RunStopped(Exception):
    """The run stopped early on purpose, after saving what it could; resume with the same command."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """While entered (in the main thread), SIGTERM and SIGINT record a stop request instead of
    ending the process; the previous handlers (Ray's driver installs one) come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

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
