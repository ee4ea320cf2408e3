"""Worker groups: how the controller reaches its policy workers.

Calls are explicit: `group.run_all("train", [args_for_rank0, args_for_rank1, ...])`. The local
group keeps every worker in this process, so the same loop runs on a laptop with `breakpoint()`
working; a Ray group with the same two methods places one actor per GPU.
"""

from __future__ import annotations

from typing import Any, Callable


class LocalWorkerGroup:
    def __init__(self, make_worker: Callable[[int, int], Any], world_size: int = 1):
        self.world_size = world_size
        self.workers = [make_worker(rank, world_size) for rank in range(world_size)]

    def run_all(self, method: str, per_worker_args: list[tuple] | None = None, **kwargs) -> list[Any]:
        """Call `method` on every worker; per_worker_args[i] are rank i's positional arguments."""
        args = per_worker_args or [()] * self.world_size
        if len(args) != self.world_size:
            raise ValueError(f"{method}: {len(args)} argument sets for {self.world_size} workers")
        return [getattr(worker, method)(*a, **kwargs) for worker, a in zip(self.workers, args)]

    def run_rank0(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.workers[0], method)(*args, **kwargs)

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
