"""Parallel reads of safetensors files, or of byte ranges of them, into their destination tensors.

Each reader thread takes whole files. A file is read front to back: the header, then every
tensor's bytes into the tensor the caller chose (the model's own parameter when dtype and shape
match, so weights land in place with no extra copy). A destination in host memory is read into
directly; one on a GPU is filled through two pinned chunk buffers per reader, so the copy of one
chunk to the device overlaps the read of the next. file reads and device copies release the GIL.

read_pieces reads the sharded layout's byte ranges (rlscale/ckpt/ranges.py): only the rows a
rank will hold, straight into its tensors where it can, and counts the bytes it read.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
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


def read_pieces(pieces: list, readers: int) -> int:
    """Read ranged pieces (rlscale.ckpt.ranges.Piece), one reader thread per file at a time, each
    file's pieces in offset order with os.preadv. A piece read straight into its destination when
    it can be (host memory, contiguous, same dtype, nothing to verify); through a host buffer
    otherwise. Returns the bytes read; raises the first error (a checksum that does not match
    names the file) after every reader has stopped."""
    by_file: dict[str, list] = {}
    for piece in pieces:
        by_file.setdefault(piece.path, []).append(piece)

    def read_file_pieces(path: str) -> int:
        done = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            for piece in sorted(by_file[path], key=lambda p: p.offset):
                done += _read_piece(fd, piece)
        finally:
            os.close(fd)
        return done

    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="ckpt-reader") as pool:
        order = sorted(by_file, key=lambda path: -sum(p.length for p in by_file[path]))
        futures = [pool.submit(read_file_pieces, path) for path in order]
        wait(futures)
    for future in futures:
        if future.exception() is not None:
            raise future.exception()
    if any(p.dest.is_cuda for p in pieces):
        torch.cuda.synchronize()
    return sum(f.result() for f in futures)


def read_whole(entry: dict, step_dir, verify: bool = True) -> torch.Tensor:
    """One whole tensor of the sharded layout (its manifest `entry`), assembled on the host from
    every rank's rows, each range's checksum checked when `verify`."""
    from rlscale.ckpt import ranges

    tensor = torch.empty(tuple(entry["shape"]), dtype=tensorfile.CODE_DTYPES[entry["dtype"]])
    read_pieces(ranges.plan_reads(entry, Path(step_dir), 0, ranges.rows_of(tensor.shape), tensor, verify), 1)
    return tensor


def _read_piece(fd: int, piece) -> int:
    dest = piece.dest
    direct = (piece.checksum is None and not dest.is_cuda and dest.dtype == piece.dtype and dest.is_contiguous())
    buffer = dest.reshape(-1).view(torch.uint8) if direct else tensorfile.host_buffer(piece.length, pinned=False)
    view = memoryview(buffer.numpy())
    if len(view) != piece.length:
        raise ValueError(f"{piece.path}: a range of {piece.length} bytes for {len(view)} bytes of tensor")
    got = 0
    while got < piece.length:
        n = os.preadv(fd, [view[got:]], piece.offset + got)
        if not n:
            raise ValueError(f"{piece.path}: file ends before byte {piece.offset + piece.length}")
        got += n
    if piece.checksum is not None and tensorfile.checksum_of(view) != piece.checksum:
        where = "/".join(Path(piece.path).parts[-2:])  # policy/... or optim/...
        raise ValueError(f"{where}: bytes {piece.offset}..{piece.offset + piece.length} "
                         f"do not match the manifest's checksum {piece.checksum}")
    if not direct:
        saved = buffer.view(piece.dtype).view(-1, *piece.row_shape)
        dest.copy_(saved[piece.skip_rows:piece.skip_rows + dest.shape[0]])
    return piece.length
