"""One rank's half of a save: snapshot into reusable host buffers, persist with writer threads.

`snapshot` returns as soon as the state is copied, or its device copies queued (the training
loop's only wait); `finish` blocks until every file is written and fsynced and returns sizes and
checksums for the manifest. Staging buffers are allocated on the first save and reused (pinned
when CUDA is present, so the device-to-host copies run at full bandwidth). Host memory is bounded: files that do not fit in the
staging budget are written during the snapshot through a transient buffer, so a state larger than
the budget makes the stall longer, never the memory larger.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from rlscale.ckpt import ranges, tensorfile
from rlscale.ckpt.faults import maybe_fault


@dataclass(frozen=True, eq=False)
class FileSpec:
    """One file of a rank's share: tensors (written as safetensors) or ready bytes (JSON etc.).

    What it derives from its tensors is computed once: a worker passes the same FileSpec save
    after save while its tensors are the same (updated in place), and then a snapshot does no
    per-tensor Python work. It must not be changed once made (hence frozen)."""

    rel: str
    tensors: dict[str, torch.Tensor] | None = None
    data: bytes | None = None
    metadata: dict[str, str] | None = None
    # sharded layout (rlscale/ckpt/ranges.py): name -> (first row in the whole tensor, its shape);
    # the file's ranges and their checksums are then returned with its size
    rows: dict[str, tuple[int, tuple[int, ...]]] | None = None

    def byte_ranges(self) -> list[dict]:
        return ranges.file_ranges(self.rel, self.plan, self.rows) if self.rows is not None else []

    @cached_property
    def plan(self) -> tensorfile.FilePlan:
        specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items())
        return tensorfile.cached_plan(specs, tuple(sorted((self.metadata or {}).items())))

    @cached_property
    def sources(self) -> list[torch.Tensor]:
        """The tensors in the file's order, detached: what every save copies."""
        return [self.tensors[slot.name].detach() for slot in self.plan.slots]

    @cached_property
    def device_sources(self) -> list[torch.Tensor]:
        return [t for t in self.sources if t.is_cuda]


class RankEngine:
    def __init__(self, writers: int, budget_bytes: int, pinned: bool | None = None):
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.budget_bytes = budget_bytes
        self._pool = ThreadPoolExecutor(max(1, writers), thread_name_prefix="ckpt-writer", initializer=_yield_cpu)
        self._arena: HostArena | None = None
        self._layout: dict[str, tuple[int, int]] = {}  # rel -> (offset, size) in the arena
        self._buffers: dict[str, torch.Tensor] = {}  # rel -> staging buffer, reused across saves
        self._targets: dict[str, tuple] = {}  # rel -> (plan, buffer, tensorfile.destinations of them)
        self._recorded = weakref.WeakSet()  # FileSpecs whose device tensors are recorded on _stream
        self._pending: list[Future] = []
        self._started = 0.0
        self._stream = None  # side stream for device-to-host copies
        self._copied = None  # event: the last snapshot's device copies are done
        self._result: dict | None = None  # the last save's finish() result, for poll()
        self._poll_lock = threading.Lock()

    def staged_bytes(self) -> int:
        return self._arena.tensor.numel() if self._arena is not None else 0

    def snapshot(self, directory: str | Path, files: list[FileSpec]) -> dict:
        """Copy `files` into staging buffers and start writing them under `directory`.

        Host tensors are copied before it returns. Device tensors are copied by a side stream
        that starts after the work already queued (the last optimizer step) and runs on while
        the caller goes on: the rollout that follows only reads the weights. Whatever changes
        the saved tensors first calls fence(), which makes the GPU (not the CPU) wait for those
        copies; workers hook it into optimizer.step. Writers wait for the copies too.
        """
        self.abort()  # a failed earlier save may have left writers behind; they must not share buffers
        self._result = None
        started = time.perf_counter()
        directory = Path(directory)
        for parent in {(directory / f.rel).parent for f in files}:
            parent.mkdir(parents=True, exist_ok=True)
        tensor_files = [f for f in files if f.tensors is not None]
        plans = {f.rel: f.plan for f in tensor_files}
        self._fit_buffers(plans)
        on_device = [t for f in tensor_files for t in f.device_sources]
        stream = self._copy_stream(on_device)
        staged, direct, total = [], [], 0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for spec in files:
                path = str(directory / spec.rel)
                if spec.tensors is None:
                    total += len(spec.data)
                    staged.append((_write_bytes, path, spec.rel, spec.data))
                    continue
                total += spec.plan.size
                if spec.rel in self._buffers:
                    buffer = self._buffers[spec.rel]
                    tensorfile.fill_views(self._destinations(spec.rel, spec.plan, buffer), spec.plan, spec.sources)
                    staged.append((_write_buffer, path, spec.rel, buffer, spec.byte_ranges()))
                else:  # over the budget: written now, through a buffer freed when written
                    direct.append(self._pool.submit(_write_direct, path, spec.rel, spec.plan, spec.tensors,
                                                    spec.byte_ranges()))
        ready = None
        if stream is not None:
            self._record_on(stream, tensor_files)
            ready = self._copied = torch.cuda.Event()
            ready.record(stream)
        done, _ = wait(direct)
        # writers start only now: on a busy host they would slow the copies the loop waits for
        self._pending = [self._pool.submit(*job, ready) for job in staged] + direct
        self._started = started
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            raise errors[0]
        return {"bytes": total, "stall_s": time.perf_counter() - started,
                "direct_bytes": sum(plans[f.result()[0]].size for f in direct)}

    def _copy_stream(self, on_device: list[torch.Tensor]):
        """The side stream for device-to-host copies, ordered after the work queued so far."""
        if not on_device:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=on_device[0].device)
        self._stream.wait_stream(torch.cuda.current_stream(on_device[0].device))
        return self._stream

    def _record_on(self, stream, files: list[FileSpec]) -> None:
        """Tell the caching allocator that `stream` reads the files' device tensors, so their memory
        is not handed out again before the copies are done. Once per FileSpec: it keeps its tensors
        alive, and when they are freed the allocator waits for all the stream's work queued by then."""
        for spec in files:
            if spec.device_sources and spec not in self._recorded:
                for tensor in spec.device_sources:
                    tensor.record_stream(stream)
                self._recorded.add(spec)

    def _destinations(self, rel: str, plan: tensorfile.FilePlan, buffer: torch.Tensor) -> tuple:
        """The views of `buffer` a file is copied into, made once per (plan, buffer): thousands of
        small tensors' .view calls would otherwise be the largest part of a warm snapshot."""
        cached = self._targets.get(rel)
        if cached is None or cached[0] is not plan or cached[1] is not buffer:
            cached = self._targets[rel] = (plan, buffer, tensorfile.destinations(buffer, plan))
        return cached[2]

    def fence(self) -> None:
        """Make the current stream wait for the last snapshot's device copies (a GPU-side wait;
        the CPU goes on). Call before changing any tensor a snapshot may still be reading."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def _fit_buffers(self, plans: dict[str, tensorfile.FilePlan]) -> None:
        """A staging buffer per file, largest files first while they fit in the budget: slices of
        one host arena, kept while the layout stays the same (it does, save after save)."""
        layout, used = {}, 0
        for rel, plan in sorted(plans.items(), key=lambda item: -item[1].size):
            padded = -(-plan.size // 4096) * 4096  # page-aligned slices
            if used + padded <= self.budget_bytes:
                layout[rel] = (used, plan.size)
                used += padded
        if self._arena is None or self._layout != layout:
            if self._arena is not None:
                self._arena.release()
            self._arena, self._layout = HostArena(used, self.pinned), layout
            # the same buffer objects while the layout holds: _destinations keys its views on them
            self._buffers = {rel: self._arena.tensor[start:start + size] for rel, (start, size) in layout.items()}
            self._targets.clear()

    def finish(self) -> dict:
        """Wait for this save's writers; returns {"files": {rel: [size, checksum]}, "ranges": the
        sharded layout's ranges with their checksums (none otherwise), "persist_s"}.
        Raises the first writer error, after every writer has stopped."""
        pending, self._pending = self._pending, []
        wait(pending)
        for future in pending:
            if future.exception() is not None:
                raise future.exception()
        results = [f.result() for f in pending]
        return {"files": {rel: [size, checksum] for rel, size, checksum, _ in results},
                "ranges": [r for *_, file_ranges in results for r in file_ranges],
                "persist_s": time.perf_counter() - self._started}

    def poll(self) -> dict | None:
        """finish()'s result once every writer is done (the same result until the next snapshot),
        else None at once. A worker answering polls never blocks, so in a serial actor (Ray's
        default) the commit's polling does not hold up the rollout the persist overlaps."""
        with self._poll_lock:  # a second poller must not take finish()'s result away
            if self._result is None:
                if any(not future.done() for future in self._pending):
                    return None
                self._result = self.finish()
            return self._result

    def abort(self) -> None:
        """Wait for any writers still running and drop their results (after a failed save)."""
        pending, self._pending = self._pending, []
        wait(pending)

    def close(self) -> None:
        self.abort()
        self._pool.shutdown(wait=True)
        self._buffers.clear()
        self._targets.clear()
        if self._arena is not None:
            self._arena.release()
            self._arena = None


class HostArena:
    """One block of host memory for all staging buffers. With CUDA it is page-locked in place
    (cudaHostRegister, as DCP's stager does) so device copies into it run at full speed; torch's
    pinned allocator would round the size up to a power of two, up to doubling the memory.
    The block is an anonymous mmap: page-aligned pages of its own, which no other registration
    can overlap (heap memory shares pages, and CUDA refuses to register a page twice)."""

    def __init__(self, nbytes: int, pinned: bool):
        self._map = mmap.mmap(-1, max(nbytes, 1))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self.registered = False
        if pinned and nbytes:
            ptr = self.tensor.data_ptr()
            self.registered = _off_thread(lambda: int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0)
            if not self.registered:  # e.g. a locked-memory limit: torch's allocator may still pin
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release(self) -> None:
        if self.registered:
            ptr = self.tensor.data_ptr()
            _off_thread(lambda: torch.cuda.cudart().cudaHostUnregister(ptr))
            self.registered = False


def _off_thread(call):
    """Run a CUDA runtime call in a short-lived thread: a failure sets that thread's last-error
    slot, which torch would otherwise report at the training thread's next kernel launch."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def _yield_cpu() -> None:
    """Writers run at a lower CPU priority (Linux nice is per thread): when cores are short,
    the rollout the persist overlaps goes first; the writes themselves wait on storage anyway."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _write_buffer(path: str, rel: str, buffer: torch.Tensor, file_ranges: list[dict], ready) -> tuple:
    if ready is not None:
        ready.synchronize()  # the device-to-host copies into the buffer are complete
    return _written(rel, buffer, file_ranges, tensorfile.write_file(path, buffer))


def _write_direct(path: str, rel: str, plan: tensorfile.FilePlan, tensors: dict, file_ranges: list[dict]) -> tuple:
    buffer = tensorfile.host_buffer(plan.size, pinned=False)
    tensorfile.fill(buffer, plan, tensors)
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.current_stream().synchronize()
    return _written(rel, buffer, file_ranges, tensorfile.write_file(path, buffer))


def _write_bytes(path: str, rel: str, data: bytes, _ready=None) -> tuple:
    return _written(rel, data, [], tensorfile.write_file(path, data))


def _written(rel: str, buffer, file_ranges: list[dict], size_and_checksum: tuple[int, str]) -> tuple:
    """(rel, size, checksum, ranges with their checksums): the ranges are hashed from the buffer
    just written (memory speed, beside the file's own checksum)."""
    sums = tensorfile.range_checksums(buffer, [(r["offset"], r["offset"] + r["length"]) for r in file_ranges])
    maybe_fault("persist.after_file")
    return (rel, *size_and_checksum, [{**r, "checksum": c} for r, c in zip(file_ranges, sums)])
