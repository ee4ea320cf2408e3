"""safetensors files written from, and read into, flat byte buffers.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range), then the tensors' bytes back to back. Planning a file is a pure function of the tensors'
names, dtypes and shapes, so a rank can allocate a buffer of the exact file size once, copy into
it at every save, and persist the file as one sequential write of that buffer. Reading is the
reverse: one sequential read into a buffer, then tensor views of it. Nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property

import torch
import xxhash

CHUNK = 64 << 20  # bytes per write/read call: large enough to stream, small enough to hash in cache
CHECKSUM = "xxh3_64"  # releases the GIL on large buffers and runs at memory speed

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class FilePlan:
    header: bytes  # length prefix + JSON header, padded so the data starts 8-byte aligned
    slots: tuple[Slot, ...]

    @property
    def size(self) -> int:
        return self.slots[-1].end if self.slots else len(self.header)

    @cached_property
    def header_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.header), dtype=torch.uint8)


def plan_file(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> FilePlan:
    """Lay out tensors (name, dtype, shape) in a file. Wider elements go first, so every tensor
    starts aligned to its element size (views of a read buffer need that)."""
    ordered = sorted(specs, key=lambda s: -s[1].itemsize)  # stable: keeps the given order otherwise
    entries, ranges, offset = {}, [], 0
    for name, dtype, shape in ordered:
        nbytes = dtype.itemsize * _numel(shape)
        entries[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        ranges.append((name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    if metadata:
        entries = {"__metadata__": metadata, **entries}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    header = struct.pack("<Q", len(text)) + text
    base = len(header)
    return FilePlan(header, tuple(Slot(n, d, s, base + a, base + b) for n, d, s, a, b in ranges))


@functools.lru_cache(maxsize=128)
def cached_plan(specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
                metadata: tuple[tuple[str, str], ...] = ()) -> FilePlan:
    """plan_file, memoised: a file of the same tensors (a sharded rank gathers fresh ones every
    save) gets the same plan object back without its JSON header being made again."""
    return plan_file(list(specs), dict(metadata))


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def parse_header(head: bytes, file_size: int) -> FilePlan:
    """The plan of an existing file from its first bytes; ValueError says what is wrong."""
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head[:8])
    if 8 + length > min(len(head), file_size):
        raise ValueError(f"header length {length} runs past the file")
    try:
        entries = json.loads(head[8:8 + length])
    except ValueError:
        raise ValueError("header is not valid JSON") from None
    entries.pop("__metadata__", None)
    base, slots, expected = 8 + length, [], 0
    for name, entry in sorted(entries.items(), key=lambda item: item[1]["data_offsets"][0]):
        dtype = CODE_DTYPES.get(entry.get("dtype"))
        start, end = entry["data_offsets"]
        if dtype is None or start != expected or end - start != dtype.itemsize * _numel(entry["shape"]):
            raise ValueError(f"tensor {name!r} has a bad dtype or byte range")
        slots.append(Slot(name, dtype, tuple(entry["shape"]), base + start, base + end))
        expected = end
    if base + expected != file_size:
        raise ValueError(f"data ends at byte {base + expected} but the file has {file_size}")
    return FilePlan(bytes(head[:base]), tuple(slots))


def header_length(head8: bytes) -> int:
    return 8 + struct.unpack("<Q", head8[:8])[0]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's memory (made contiguous first if it is not)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def fill(buffer: torch.Tensor, plan: FilePlan, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a file's header and tensors into `buffer` (uint8, at least plan.size long).
    From CUDA into pinned memory the copies are asynchronous: synchronise before reading it."""
    fill_views(destinations(buffer, plan), plan, [tensors[slot.name].detach() for slot in plan.slots])


def destinations(buffer: torch.Tensor, plan: FilePlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Where fill_views copies a file in `buffer`: its header bytes, and a view per slot. They
    depend only on the buffer and the plan, so a caller that keeps both may keep these too."""
    return buffer[: len(plan.header)], list(views(buffer, plan).values())


def fill_views(targets: tuple[torch.Tensor, list[torch.Tensor]], plan: FilePlan, sources: list[torch.Tensor]) -> None:
    """Copy the header and `sources` (in plan.slots order) into destinations(buffer, plan)."""
    header, slots = targets
    header.copy_(plan.header_tensor)
    try:  # one call queues every copy: no per-tensor Python overhead while the loop waits
        torch._foreach_copy_(slots, sources, non_blocking=True)
    except (RuntimeError, TypeError, AttributeError):
        for target, source in zip(slots, sources):
            target.copy_(source, non_blocking=True)


def views(buffer: torch.Tensor, plan: FilePlan) -> dict[str, torch.Tensor]:
    """Tensors that share memory with `buffer` (no copies)."""
    return {s.name: buffer[s.start:s.end].view(s.dtype).view(s.shape) for s in plan.slots}


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def write_file(path: str, buffer: torch.Tensor | bytes) -> tuple[int, str]:
    """Write, hash and fsync a whole file in large sequential chunks; returns (size, checksum).
    os.write, fsync and the hash release the GIL, so writer threads run beside training."""
    view = memoryview(buffer.numpy()) if isinstance(buffer, torch.Tensor) else memoryview(buffer)
    hasher = xxhash.xxh3_64()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(view), CHUNK):
            piece = view[offset:offset + CHUNK]
            hasher.update(piece)
            while piece:
                written = os.write(fd, piece)
                piece = piece[written:]
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):  # not on macOS
            # the pages are clean now and nobody reads a checkpoint soon: free them for the run
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return len(view), f"{CHECKSUM}:{hasher.hexdigest()}"


def range_checksums(buffer: torch.Tensor | bytes, ranges: list[tuple[int, int]]) -> list[str]:
    """The checksum of each byte range [start, end) of a file's buffer (the sharded layout's
    per-range checksums, so a rank that reads only some ranges can verify what it read)."""
    view = memoryview(buffer.numpy()) if isinstance(buffer, torch.Tensor) else memoryview(buffer)
    return [checksum_of(view[start:end]) for start, end in ranges]


def checksum_of(data) -> str:
    return f"{CHECKSUM}:{xxhash.xxh3_64_hexdigest(data)}"


def read_file(path: str, size: int, pinned: bool = False, checksum: bool = False) -> tuple[torch.Tensor, str | None]:
    """Read a whole file of known size into a fresh host buffer; optionally hash it on the way."""
    buffer = host_buffer(size, pinned)
    view = memoryview(buffer.numpy())
    hasher = xxhash.xxh3_64() if checksum else None
    with open(path, "rb", buffering=0) as handle:
        offset = 0
        while offset < size:
            got = handle.readinto(view[offset:offset + CHUNK])
            if not got:
                raise OSError(f"{path}: file ended after {offset} of {size} bytes")
            if hasher is not None:
                hasher.update(view[offset:offset + got])
            offset += got
    return buffer, (f"{CHECKSUM}:{hasher.hexdigest()}" if hasher is not None else None)


def file_checksum(path: str) -> str:
    hasher = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(CHUNK):
            hasher.update(chunk)
    return f"{CHECKSUM}:{hasher.hexdigest()}"
