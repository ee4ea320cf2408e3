"""Parallel reads of safetensors files straight into their destination tensors.

Each reader thread takes whole files. A file is read front to back: the header, then every
tensor's bytes into the tensor the caller chose (the model's own parameter when dtype and shape
match, so weights land in place with no extra copy). A destination in host memory is read into
directly; one on a GPU is filled through two pinned chunk buffers per reader, so the copy of one
chunk to the device overlaps the read of the next. file reads and device copies release the GIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

import torch
import xxhash

from rlscale.ckpt import tensorfile

CHUNK = 32 << 20

# destination(rel, slot) -> tensor to read the slot into (contiguous, the slot's dtype and shape)
Destination = Callable[[str, tensorfile.Slot], torch.Tensor]
# done(rel, {name: tensor}) -> None, once a file is read (and its checksum checked)
Done = Callable[[str, dict], None]


class _Stager:
    """A reader thread's pinned chunk buffers, with an event per buffer for its last copy."""

    def __init__(self):
        self.buffers = [tensorfile.host_buffer(CHUNK, pinned=True) for _ in range(2)]
        self.events = [None, None]
        self.stream = torch.cuda.Stream()
        self.turn = 0

    def copy(self, handle, raw: torch.Tensor, hasher) -> None:
        for offset in range(0, raw.numel(), CHUNK):
            n = min(CHUNK, raw.numel() - offset)
            k, self.turn = self.turn, 1 - self.turn
            if self.events[k] is not None:
                self.events[k].synchronize()  # the device has consumed this buffer's last chunk
            view = memoryview(self.buffers[k].numpy())[:n]
            _read_exact(handle, view, hasher)
            with torch.cuda.stream(self.stream):
                raw[offset:offset + n].copy_(self.buffers[k][:n], non_blocking=True)
                self.events[k] = torch.cuda.Event()
                self.events[k].record(self.stream)

    def drain(self) -> None:
        self.stream.synchronize()


def _read_exact(handle, view: memoryview, hasher) -> None:
    got = 0
    while got < len(view):
        n = handle.readinto(view[got:])
        if not n:
            raise ValueError(f"{handle.name}: file ends early")
        got += n
    if hasher is not None:
        hasher.update(view)


def read_file_into(path: str, rel: str, size: int, destination: Destination, checksum: str | None,
                   stager: _Stager | None) -> dict[str, torch.Tensor]:
    actual = os.path.getsize(path)
    if actual != size:
        raise ValueError(f"{rel} has {actual} bytes, the manifest says {size}")
    hasher = xxhash.xxh3_64() if checksum is not None else None
    out = {}
    with open(path, "rb", buffering=0) as handle:
        head = bytearray(8)
        _read_exact(handle, memoryview(head), None)
        length = tensorfile.header_length(bytes(head))
        if length > size:
            raise ValueError(f"{rel}: header length runs past the file")
        rest = bytearray(length - 8)
        _read_exact(handle, memoryview(rest), None)
        plan = tensorfile.parse_header(bytes(head + rest), size)
        if hasher is not None:
            hasher.update(head + rest)
        for slot in plan.slots:
            target = destination(rel, slot)
            raw = target.detach().reshape(-1).view(torch.uint8)
            if target.is_cuda:
                stager.copy(handle, raw, hasher)
            else:
                view = memoryview(raw.numpy())
                for offset in range(0, len(view), CHUNK):
                    _read_exact(handle, view[offset:offset + CHUNK], hasher)
            out[slot.name] = target
    if stager is not None:
        stager.drain()
    if hasher is not None and f"{tensorfile.CHECKSUM}:{hasher.hexdigest()}" != checksum:
        raise ValueError(f"{rel}: checksum does not match the manifest's {checksum}")
    return out


def read_files(paths: dict[str, tuple[str, int]], readers: int, checksums: dict[str, str] | None,
               destination: Destination, done: Done, cuda: bool) -> None:
    """Read files (rel -> (path, size)) with `readers` threads, largest first. With `checksums`
    each file's checksum is compared as it is read. Raises the first error after all stop."""
    local = {}

    def read_one(rel: str) -> None:
        import threading

        ident = threading.get_ident()
        if cuda and ident not in local:
            local[ident] = _Stager()
        path, size = paths[rel]
        want = None if checksums is None else checksums.get(rel, "missing")
        done(rel, read_file_into(path, rel, size, destination, want, local.get(ident)))

    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="ckpt-reader") as pool:
        futures = [pool.submit(read_one, rel) for rel in sorted(paths, key=lambda r: -paths[r][1])]
        wait(futures)
    if cuda:
        torch.cuda.synchronize()
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
