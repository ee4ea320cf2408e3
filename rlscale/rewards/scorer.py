"""RewardScorer: score a batch in worker processes, with a per-sample time limit.

Why processes: a pathological answer (sympy on 9^{9^{9^9}}) or a user function that loops
forever can sit in C code that no signal or thread can interrupt; only killing a process
bounds a GRPO step. Why this protocol: the parent sends a whole chunk of samples in one
message and the worker streams back one small result per sample as it finishes. So the parent
always knows which sample each worker is on and since when: a sample that runs past
`timeout_s` gets 0.0 and counts as a timeout, its worker is killed and replaced, and the rest
of its chunk goes back on the queue. No IPC round-trip per sample, exact per-sample limits.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import reprlib
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait

from rlscale.errors import UserError
from rlscale.rewards.loader import _one_line, load_reward_function

_START_TIMEOUT_S = 120.0  # a worker that is not up by then is broken, not slow
_MAX_CHUNK = 64
_READY, _OK, _ERROR, _TIMEOUT = "ready", "ok", "error", "timeout"


@dataclass
class ScoreResult:
    rewards: list[float]
    num_timeouts: int = 0
    num_errors: int = 0
    seconds: float = 0.0
    # "sample i: Type: message" of the lowest-index failing sample (not the first to fail in
    # time, which depends on worker scheduling), for the log
    first_error: str | None = None

    def check(self, function: str, where: str) -> str | None:
        """A line about the samples the reward function failed on (they score 0), or None when it
        failed on none. Raises UserError when it failed on every sample: a run would train (or an
        evaluation report) on nothing but zeros."""
        if not self.num_errors:
            return None
        if self.num_errors >= len(self.rewards):
            raise UserError(f"rewards.function {function!r} failed on every sample of {where}: {self.first_error}")
        return (f"rewards.function {function!r} failed on {self.num_errors} of {len(self.rewards)} samples of "
                f"{where}, scored 0 (the first: {self.first_error}); metric reward/errors counts them")


def concat_scores(parts: list[ScoreResult]) -> ScoreResult:
    """Several requests' scores as one, in order (for the step's metrics: each request's
    failures were reported on their own, so first_error is the first request's that had one)."""
    return ScoreResult(rewards=[r for p in parts for r in p.rewards], num_timeouts=sum(p.num_timeouts for p in parts),
                       num_errors=sum(p.num_errors for p in parts), seconds=sum(p.seconds for p in parts),
                       first_error=next((p.first_error for p in parts if p.first_error), None))


# ---------------------------------------------------------------- worker process side


def _call(fn, response: str, answer: str) -> tuple[str, float | str]:
    """(_OK, reward) or (_ERROR, message); a non-finite or non-numeric reward is an error."""
    try:
        value = fn(response, answer)
    except (Exception, SystemExit) as exc:
        return _ERROR, _one_line(exc)[:500]
    try:
        reward = float(value) if isinstance(value, numbers.Real) else math.nan
    except (OverflowError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        return _ERROR, f"reward must be a finite float, got {reprlib.repr(value)}"
    return _OK, reward


def _worker_main(conn, spec: str) -> None:
    # Ctrl-C, and a SIGTERM sent to the whole process group (Ray's job stop, a pod's shutdown),
    # are the parent's to handle: it finishes the step with every sample scored, then stops the
    # workers itself (a message, or SIGKILL); a worker killed mid-sample would score it 0.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fn, broken = load_reward_function(spec), ""
    except Exception as exc:  # validated in the parent, so only an odd environment gets here
        fn, broken = None, f"worker could not load {spec!r}: {_one_line(exc)}"
    conn.send(_READY)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if chunk is None:
            return
        for index, response, answer in chunk:
            status, value = _call(fn, response, answer) if fn else (_ERROR, broken)
            conn.send((index, status, value))


# ---------------------------------------------------------------- parent side


def _context():
    # Never fork: the parent holds torch/CUDA state and threads. A forkserver forks workers
    # (and replacements after a kill) from a clean process with math-verify already imported,
    # so a replacement is up in milliseconds rather than the ~1 s of a spawn + imports.
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["rlscale.rewards.forkserver_signals", "rlscale.rewards.scorer"])
        os.environ["RLSCALE_REWARD_FORKSERVER"] = "1"  # see forkserver_signals: it ignores SIGTERM
        try:
            forkserver.ensure_running()
        finally:
            del os.environ["RLSCALE_REWARD_FORKSERVER"]
        return ctx
    return mp.get_context("spawn")


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, spec), daemon=True,
                                   name="rlscale-reward-worker")
        self.process.start()
        child.close()  # so the worker's death reads as EOF here
        self.ready = False
        self.since = time.monotonic()  # start-up began, or the current sample began
        self.queue: deque[int] = deque()  # sample indices sent, not yet answered, in order

    def stop(self, kill: bool) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                kill = True
            self.process.join(timeout=1.0)
        if self.process.is_alive() or self.process.exitcode == 255:  # 255: its forkserver is gone
            try:  # by pid: Process.kill() trusts the forkserver's word that it has exited
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(timeout=5.0)
        self.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop(kill=bool(worker.queue))


class RewardScorer:
    """Scores (response, answer) pairs with `function` in `num_workers` processes.

    Use as a context manager or call close(). Not thread-safe: one score() at a time.
    """

    def __init__(self, function: str = "math", timeout_s: float = 5.0, num_workers: int = 2):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < math.inf:
            raise UserError(f"rewards.timeout_s={timeout_s!r} must be a positive number of seconds")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise UserError(f"rewards.num_workers={num_workers!r} must be a positive integer")
        load_reward_function(function)  # fail fast, in the parent, with a one-line UserError
        self.function, self.timeout_s, self.num_workers = function, float(timeout_s), num_workers
        self._ctx = _context()
        self._workers = [_Worker(self._ctx, function) for _ in range(num_workers)]
        self._closed = False
        # workers ignore SIGTERM, so multiprocessing's own exit handler (terminate, then join)
        # would wait for them forever: they are stopped when the scorer is collected, or at exit
        # before that handler (finalizers registered later run first); close() does it now
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def _replace(self, worker: _Worker, pending: deque) -> None:
        """Kill `worker` and start a fresh one in its slot; its unanswered samples go back first."""
        if worker.queue:
            pending.appendleft(list(worker.queue))
            worker.queue.clear()
        worker.stop(kill=True)
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.function)

    def score(self, responses: list[str], answers: list[str]) -> ScoreResult:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
        if self._closed:
            raise RuntimeError("RewardScorer.score() called after close()")
        start = time.perf_counter()
        result = ScoreResult(rewards=[0.0] * len(responses))
        size = max(1, min(_MAX_CHUNK, math.ceil(len(responses) / (4 * self.num_workers))))
        pending = deque(list(range(i, min(i + size, len(responses))))
                        for i in range(0, len(responses), size))
        for worker in list(self._workers):  # died while idle (e.g. OOM-killed): replace quietly
            if not worker.process.is_alive():
                self._replace(worker, pending)

        first_error_index = len(responses)

        def record(index: int, status: str, value) -> None:
            nonlocal first_error_index
            if status == _OK:
                result.rewards[index] = value
            elif status == _TIMEOUT:
                result.num_timeouts += 1
            else:
                result.num_errors += 1
                if index < first_error_index:  # workers finish out of order; keep it stable
                    first_error_index = index
                    result.first_error = f"sample {index}: {value}"

        left = len(responses)
        try:
            while left:
                left -= self._step(pending, responses, answers, record)
        except BaseException:
            # Interrupted mid-batch: busy workers would answer into the next call; restart them.
            for worker in list(self._workers):
                if worker.queue:
                    worker.queue.clear()
                    self._replace(worker, deque())
            raise
        result.seconds = time.perf_counter() - start
        return result

    def _step(self, pending: deque, responses, answers, record) -> int:
        """Hand out chunks, wait for results or a deadline; return how many samples finished."""
        finished = 0
        for worker in self._workers:
            if worker.ready and not worker.queue and pending:
                chunk = pending.popleft()
                try:
                    worker.conn.send([(i, responses[i], answers[i]) for i in chunk])
                except OSError:  # died since we last looked; nothing of this chunk ran
                    pending.appendleft(chunk)
                    self._replace(worker, pending)
                    continue
                worker.queue.extend(chunk)
                worker.since = time.monotonic()
        limits = [w.since + (self.timeout_s if w.ready else _START_TIMEOUT_S)
                  for w in self._workers if w.queue or not w.ready]
        by_conn = {w.conn: w for w in self._workers}
        wait_s = max(0.0, min(limits) - time.monotonic()) if limits else 0.1
        for conn in wait(list(by_conn), timeout=wait_s):
            worker = by_conn[conn]
            try:
                while conn.poll():
                    message = conn.recv()
                    if message == _READY:
                        worker.ready = True
                        continue
                    index, status, value = message
                    worker.queue.popleft()
                    worker.since = time.monotonic()
                    record(index, status, value)
                    finished += 1
            except (EOFError, OSError):  # the worker died (segfault, os._exit, OOM kill)
                worker.process.join(timeout=1.0)  # so its exit code is known
                if not worker.ready:
                    raise RuntimeError(f"reward worker for {self.function!r} exited during "
                                       f"start-up (exit code {worker.process.exitcode})") from None
                if worker.queue:
                    record(worker.queue.popleft(), _ERROR,
                           f"reward worker died (exit code {worker.process.exitcode})")
                    finished += 1
                self._replace(worker, pending)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.conn.poll():
                continue  # results are waiting: read them before judging the clock
            if worker.ready and worker.queue and now - worker.since > self.timeout_s:
                record(worker.queue.popleft(), _TIMEOUT, None)
                finished += 1
                self._replace(worker, pending)
            elif not worker.ready and now - worker.since > _START_TIMEOUT_S:
                raise RuntimeError(f"reward worker for {self.function!r} did not start within "
                                   f"{_START_TIMEOUT_S:.0f} s")
        return finished
