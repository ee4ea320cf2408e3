"""`rlscale bench io PATH`: fsync'd write and cold read throughput of a directory, 1..N writers.

Each trial writes the same total bytes as shard-sized files: writer threads take files in turn,
each written with the checkpoint engine's own write path (tensorfile.write_file: 64 MiB writes,
hashed, fsynced), then the page cache is dropped for those files (posix_fadvise DONTNEED) and
as many reader threads read them back. It ends with a recommendation for
`checkpointing.writers_per_rank` and, on Lustre, `checkpointing.lustre_stripe_count`.
All files live in a temporary subdirectory of PATH, removed at the end even on error.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlscale.bench import write_result
from rlscale.bench.ckpt import drop_cache
from rlscale.ckpt.tensorfile import CHUNK, write_file
from rlscale.errors import UserError, short_reason

GAIN = 0.10  # a doubling of writers must add at least this much write GB/s to be worth it
FADVISE_NOTE = ("page cache dropped with posix_fadvise(POSIX_FADV_DONTNEED) after fsync; network and FUSE "
                "file systems (NFS, Lustre clients, gcsfuse) may ignore it, and reads can then be served from memory")


def writer_counts(max_writers: int) -> list[int]:
    """1, 2, 4, ... below max_writers, then max_writers itself."""
    counts = [1 << i for i in range(max_writers.bit_length()) if (1 << i) < max_writers]
    return counts + [max_writers]


def recommend_writers(results: list[dict], gain: float = GAIN) -> int:
    """The writer count beyond which write GB/s improves by less than `gain` (pure function of
    the per-count rows, sorted by writers); the largest count when every step still pays."""
    rows = sorted(results, key=lambda row: row["writers"])
    for here, there in zip(rows, rows[1:]):
        if there["write_GBps"] < here["write_GBps"] * (1 + gain):
            return here["writers"]
    return rows[-1]["writers"]


def recommend_stripe(osts: int | None, writers: int) -> int:
    """Stripe count: every writer's file on its own target, never more targets than exist."""
    return writers if not osts else max(1, min(osts, writers))


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path`, from /proc/mounts (best effort)."""
    path, best, kind = Path(path).resolve(), -1, "unknown"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) > best:
            best, kind = len(mount), fields[2]
    return kind


def lustre_info(path: Path) -> dict | None:
    """{"osts": N or None} when `lfs` is on PATH and `lfs getstripe PATH` succeeds, else None."""
    lfs = shutil.which("lfs")
    if lfs is None:
        return None
    try:
        if subprocess.run([lfs, "getstripe", str(path)], capture_output=True, timeout=30).returncode != 0:
            return None
        df = subprocess.run([lfs, "df", str(path)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    osts = sum("[OST:" in line for line in df.stdout.splitlines()) if df.returncode == 0 else 0
    return {"osts": osts or None}


def _trial(directory: Path, writers: int, names: list[str], data: bytes) -> dict:
    directory.mkdir()
    paths = [str(directory / name) for name in names]
    shares = [paths[i::writers] for i in range(writers)]

    def write(share: list[str]) -> None:
        for path in share:
            write_file(path, data)

    def read(share: list[str]) -> None:
        buffer = bytearray(CHUNK)
        for path in share:
            with open(path, "rb", buffering=0) as handle:
                while handle.readinto(buffer):
                    pass

    with ThreadPoolExecutor(writers) as pool:
        started = time.perf_counter()
        list(pool.map(write, shares))
        write_s = time.perf_counter() - started
        drop_cache(directory)
        started = time.perf_counter()
        list(pool.map(read, shares))
        read_s = time.perf_counter() - started
    shutil.rmtree(directory)
    total = len(data) * len(names)
    return {"writers": writers, "write_GBps": total / write_s / 1e9, "read_GBps": total / read_s / 1e9,
            "write_s": write_s, "read_s": read_s, "seconds": write_s + read_s}


def io_command(path: Path, max_writers: int, file_size_mb: int, total_gb: float, json_file: Path | None) -> dict:
    path = Path(path)
    if max_writers < 1 or file_size_mb < 1 or total_gb <= 0:
        raise UserError("bench io: max_writers and file_size_mb must be >= 1 and total_gb > 0")
    if not path.is_dir():
        raise UserError(f"bench io: {path} is not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"bench io: {path} is not writable")
    counts = writer_counts(max_writers)
    file_bytes = file_size_mb << 20
    # the same files in every trial, a multiple of every writer count so each writer gets an equal share
    step = math.lcm(*counts)
    n_files = max(step, step * math.ceil(total_gb * 1e9 / file_bytes / step))
    data = os.urandom(file_bytes)  # incompressible, so compressing file systems cannot flatter the numbers
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".rlscale-bench-io-", dir=path))
    except OSError as exc:
        raise UserError(f"bench io: cannot create files in {path}: {short_reason(exc)}") from None
    try:
        names = [f"shard{i:05d}.bin" for i in range(n_files)]
        results = [_trial(scratch / f"w{n}", n, names, data) for n in counts]
    except OSError as exc:
        raise UserError(f"bench io: {path}: {short_reason(exc)}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    best = recommend_writers(results)
    why = (f"more writers add < {GAIN:.0%} write GB/s here" if best < counts[-1] or len(counts) == 1
           else f"still gaining >= {GAIN:.0%} at {best}: try a larger max_writers")
    lines = [f"checkpointing.writers_per_rank={best}  ({why})"]
    lustre = lustre_info(path)
    stripe = None
    if lustre is not None:
        stripe = recommend_stripe(lustre["osts"], best)
        lines.append(f"checkpointing.lustre_stripe_count={stripe} checkpointing.lustre_stripe_size=4M  "
                     f"(min of {lustre['osts'] or '?'} OSTs and {best} writers)")
    elif shutil.which("lfs") is None:
        lines.append("lfs is absent: no Lustre stripe recommendation")
    else:
        lines.append(f"lfs getstripe fails on {path}: not on Lustre, no stripe recommendation")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "path": str(path.resolve()), "fs_type": fs_type(path), "file_size_mb": file_size_mb,
           "files_per_trial": n_files, "bytes_per_trial": n_files * file_bytes, "results": results,
           "recommendation": {"writers_per_rank": best, "lustre_stripe_count": stripe,
                              "lustre": lustre, "text": lines},
           "notes": [FADVISE_NOTE]}
    write_result(out, json_file)
    return out


def format_table(result: dict) -> str:
    lines = [f"{result['path']} ({result['fs_type']}): {result['files_per_trial']} files of "
             f"{result['file_size_mb']} MiB per trial, {result['bytes_per_trial'] / 1e9:.3f} GB",
             f"{'writers':>7}{'write GB/s':>12}{'read GB/s':>11}{'write s':>9}{'read s':>8}"]
    for row in result["results"]:
        lines.append(f"{row['writers']:>7}{row['write_GBps']:>12.3f}{row['read_GBps']:>11.3f}"
                     f"{row['write_s']:>9.3f}{row['read_s']:>8.3f}")
    lines += [f"note: {note}" for note in result["notes"]]
    lines += [f"recommend: {line}" for line in result["recommendation"]["text"]]
    return "\n".join(lines)
