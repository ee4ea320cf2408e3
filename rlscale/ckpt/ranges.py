"""The sharded layout: which byte ranges of which files hold which rows of every tensor.

A sharded save (FSDP2 over several ranks: every weight and moment is a DTensor split on dim 0)
gathers nothing. Each rank writes the rows it holds into files of its own, in parallel:

  policy/shard-rRRR-JJJ.safetensors   rank R's rows of the weights, by Hugging Face name
  optim/shard-rRRR-JJJ.safetensors    rank R's rows of the AdamW moments ("<param name>::<key>")

Each file is a valid safetensors file of local slices (local shapes), not a Hugging Face model:
`rlscale ckpt export` turns a step into one (rlscale/ckpt/tools.py). Tensors that no rank shards
(AdamW's `step` counters) are written whole, each by one rank. The manifest (written last, as in
every layout) adds format 3's table of every tensor:

  "tensors": {"model.embed_tokens.weight": {
      "dtype": "F32", "shape": [151936, 896],
      "ranges": [{"file": "policy/shard-r000-000.safetensors", "offset": 4096, "length": 1048576,
                  "rows": [0, 292], "checksum": "xxh3_64:..."}, ...]}, ...}

A range is rows [start, stop) of the whole tensor: `length` contiguous bytes at `offset` of
`file` (a 0-d tensor is one range of rows [0, 1)). The ranges of a tensor cover its rows once,
in order. A rank's slice is cut into ranges of at most BLOCK_BYTES (whole rows), each with its own
checksum: a loading rank reads only the rows it will hold (any N -> M: the overlap of the saved
row ranges with its own), and to verify them it reads at most one range more than it needs at
each end of its rows. "files" and "checksums" still list every file whole, so `ckpt verify`
and the size check at resume are the same for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlscale.ckpt.tensorfile import CODE_DTYPES, DTYPE_CODES, FilePlan

BLOCK_BYTES = 16 << 20  # per-range checksum granularity: ~60 ranges per GB in the manifest


def rows_of(shape) -> int:
    """Rows of a tensor of `shape` in this layout (a 0-d tensor is one row)."""
    return shape[0] if len(shape) else 1


def file_ranges(rel: str, plan: FilePlan, rows: dict[str, tuple[int, tuple[int, ...]]],
                block_bytes: int | None = None) -> list[dict]:
    """The ranges of one rank's file (checksums to be filled in once its bytes are final).
    rows: tensor name -> (its first row in the whole tensor, the whole tensor's shape)."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    out = []
    for slot in plan.slots:
        first, shape = rows[slot.name]
        local_rows = rows_of(slot.shape)
        if local_rows == 0 or slot.end == slot.start:
            continue
        row_bytes = (slot.end - slot.start) // local_rows
        per = max(1, block_bytes // row_bytes)
        for k in range(0, local_rows, per):
            n = min(per, local_rows - k)
            out.append({"name": slot.name, "dtype": DTYPE_CODES[slot.dtype], "shape": list(shape), "file": rel,
                        "offset": slot.start + k * row_bytes, "length": n * row_bytes,
                        "rows": [first + k, first + k + n]})
    return out


def table(ranges: list[dict]) -> dict[str, dict]:
    """Every rank's ranges as the manifest's "tensors": by name, ranges in row order. Raises
    ValueError when a tensor's ranges do not cover its rows exactly once (a bug, never committed)."""
    out: dict[str, dict] = {}
    for r in ranges:
        entry = out.setdefault(r["name"], {"dtype": r["dtype"], "shape": r["shape"], "ranges": []})
        if entry["dtype"] != r["dtype"] or entry["shape"] != r["shape"]:
            raise ValueError(f"ranks disagree on the dtype or shape of {r['name']}")
        entry["ranges"].append({k: r[k] for k in ("file", "offset", "length", "rows", "checksum")})
    for name, entry in out.items():
        entry["ranges"].sort(key=lambda r: r["rows"][0])
        expected = 0
        for r in entry["ranges"]:
            if r["rows"][0] != expected:
                raise ValueError(f"{name}: rows {expected}.. are saved {'twice' if r['rows'][0] < expected else 'by no rank'}")
            expected = r["rows"][1]
        if expected != rows_of(entry["shape"]):
            raise ValueError(f"{name}: rows {expected}.. are saved by no rank")
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class Piece:
    """One read: `length` bytes at `offset` of `path`, of which rows [skip_rows, skip_rows +
    dest rows) go into `dest` (cast on copy if its dtype differs). With `checksum` set the read is
    a whole saved range, checked before anything is copied."""

    path: str
    offset: int
    length: int
    checksum: str | None
    dtype: torch.dtype  # as saved
    row_shape: tuple[int, ...]  # the shape of one row (empty for a 1-D or 0-d tensor)
    skip_rows: int
    dest: torch.Tensor


def plan_reads(entry: dict, step_dir: Path, start: int, stop: int, dest: torch.Tensor, verify: bool) -> list[Piece]:
    """The reads that fill `dest`, rows [start, stop) of the tensor `entry` describes."""
    dtype, shape = CODE_DTYPES[entry["dtype"]], tuple(entry["shape"])
    row_shape = shape[1:]
    dest_rows = dest.reshape(stop - start, *row_shape)
    pieces = []
    for r in entry["ranges"]:
        first, last = r["rows"]
        lo, hi = max(first, start), min(last, stop)
        if lo >= hi:
            continue
        row_bytes = r["length"] // (last - first)
        target = dest_rows[lo - start:hi - start]
        if verify:  # the whole range, so its checksum can be checked
            pieces.append(Piece(str(step_dir / r["file"]), r["offset"], r["length"], r["checksum"], dtype,
                                row_shape, lo - first, target))
        else:
            pieces.append(Piece(str(step_dir / r["file"]), r["offset"] + (lo - first) * row_bytes,
                                (hi - lo) * row_bytes, None, dtype, row_shape, 0, target))
    return pieces
