"""Worker groups: how the controller reaches its policy workers.

Calls are explicit: `group.run_all("train", [args_for_rank0, args_for_rank1, ...])`. The local
group keeps every worker in this process, so the same loop runs on a laptop with `breakpoint()`
working; a Ray group with the same two methods places one actor per GPU.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from rlscale.ckpt.faults import maybe_fault
from rlscale.errors import is_out_of_memory, out_of_memory


def call_worker(worker, method: str, *args, **kwargs) -> Any:
    """worker.method(*args, **kwargs), in the worker's process. Running out of memory there
    (torch.OutOfMemoryError, the CPU allocator's failure, MemoryError) raises our small, picklable
    rlscale.errors.OutOfMemory instead: the phase, this device's figures and the original traceback
    as text, so that it reaches the controller intact, through Ray too. Fault point worker.METHOD
    (RLSCALE_FAULT=worker.train:3:OOM, see rlscale/ckpt/faults.py)."""
    return _guarded(worker, method, lambda: getattr(worker, method)(*args, **kwargs))


def _guarded(worker, method: str, call: Callable[[], Any], rank: int | None = None) -> Any:
    converted = None
    try:
        maybe_fault(f"worker.{method}")
        return call()
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        converted = out_of_memory(exc, method, worker, rank=rank)
    # raised outside the except clause: the original's frames (and the memory they hold) may go
    raise converted


def memory_guarded(worker_cls: type) -> type:
    """A subclass of `worker_cls` whose constructor and public methods convert running out of
    memory as `call_worker` does: for Ray actors, where the conversion must happen in the actor's
    process (its device, its figures). Same name, same methods and signatures."""

    def guard(name: str):
        original = getattr(worker_cls, name)

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            return _guarded(self, name, lambda: original(self, *args, **kwargs))
        return method

    def __init__(self, *args, **kwargs):
        _guarded(self, "__init__", lambda: worker_cls.__init__(self, *args, **kwargs))

    public = [name for name in dir(worker_cls) if not name.startswith("_")
              and inspect.isfunction(inspect.getattr_static(worker_cls, name, None))]
    body = {name: guard(name) for name in public}
    body.update(__init__=__init__, __doc__=worker_cls.__doc__, __module__=__name__,
                __qualname__=f"memory_guarded.<{worker_cls.__name__}>")
    return type(worker_cls.__name__, (worker_cls,), body)


class LocalWorkerGroup:
    def __init__(self, make_worker: Callable[[int, int], Any], world_size: int = 1):
        self.world_size = world_size
        self.workers = [_guarded(None, "__init__", lambda: make_worker(rank, world_size),
                                 rank if world_size > 1 else None) for rank in range(world_size)]

    def run_all(self, method: str, per_worker_args: list[tuple] | None = None, **kwargs) -> list[Any]:
        """Call `method` on every worker; per_worker_args[i] are rank i's positional arguments."""
        args = per_worker_args or [()] * self.world_size
        if len(args) != self.world_size:
            raise ValueError(f"{method}: {len(args)} argument sets for {self.world_size} workers")
        return [call_worker(worker, method, *a, **kwargs) for worker, a in zip(self.workers, args)]

    def run_rank0(self, method: str, *args, **kwargs) -> Any:
        return call_worker(self.workers[0], method, *args, **kwargs)

    def shutdown(self) -> None:
        self.workers.clear()


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal shards (the first shards one longer when it does not divide)."""
    size, extra = divmod(len(items), parts)
    shards, start = [], 0
    for rank in range(parts):
        stop = start + size + (1 if rank < extra else 0)
        shards.append(items[start:stop])
        start = stop
    return shards
