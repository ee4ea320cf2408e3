"""Developer profiling: torch.profiler around the Nth call of a worker method, as text tables.

    RLSCALE_PROFILE_DIR=/tmp/prof RLSCALE_PROFILE_CALL=3 rlscale train ...

writes `rank{r}-{method}-call{N}.txt` for every profiled method (`generate`, `train`): wall time
per section (see `mark`, also as `.json`), then operators by device time and by CPU time. Off unless
RLSCALE_PROFILE_DIR is set; Ray workers get the variables from the driver (see
workers/ray_group.py). Tables, not traces: they stay small enough to bring back from a remote
machine. The profiler's own per-operator cost inflates CPU-heavy sections; RLSCALE_PROFILE_TORCH=0
keeps only the section times, measured without it.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

DIR_VARIABLE, CALL_VARIABLE, TORCH_VARIABLE = "RLSCALE_PROFILE_DIR", "RLSCALE_PROFILE_CALL", "RLSCALE_PROFILE_TORCH"
DEFAULT_CALL = 3  # the first calls compile and capture; the third is a steady one


class CallProfiler:
    def __init__(self, rank: int):
        self.rank = rank
        self.calls: dict[str, int] = {}
        self._marks: list[tuple[str, float]] | None = None  # set while a call is profiled

    @contextmanager
    def around(self, method: str):
        count = self.calls[method] = self.calls.get(method, 0) + 1
        directory = os.environ.get(DIR_VARIABLE)
        if not directory or count != int(os.environ.get(CALL_VARIABLE, DEFAULT_CALL)):
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with_torch = os.environ.get(TORCH_VARIABLE, "1") != "0"
        self._marks = []
        self.mark("start")
        try:
            with profile(activities=activities) if with_torch else nullcontext() as prof:
                yield
                self.mark("end")
            marks = self._marks
        finally:
            self._marks = None
        # wall time of each section, from one mark to the next
        sections = [[name, round((t - before) * 1e3, 3)] for (_, before), (name, t) in zip(marks, marks[1:])]
        path = Path(directory) / f"rank{self.rank}-{method}-call{count}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sections_table(sections) + (profile_tables(prof) if with_torch else ""))
        path.with_suffix(".json").write_text(json.dumps({"sections_ms": sections, "torch_profiler": with_torch}))

    def mark(self, name: str) -> None:
        """End of a named section of a profiled call (device work included: it synchronises);
        free when the call is not profiled."""
        if self._marks is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._marks.append((name, time.perf_counter()))


def sections_table(sections: list[list]) -> str:
    """[[section, ms], ...] as the text file's first table."""
    lines = ["## sections (wall, device synchronised at each mark)"]
    lines += [f"{name:<32}{ms:10.2f} ms" for name, ms in sections]
    return "\n".join(lines) + "\n\n"


def sections_line(sections: list[list]) -> str:
    """[[section, ms], ...] on one line, for the benchmarks' tables."""
    return ", ".join(f"{name} {ms:.0f}" for name, ms in sections)


def profile_tables(prof, rows: int = 40) -> str:
    averages = prof.key_averages()
    tables = []
    if torch.cuda.is_available():
        tables.append("## by device time\n" + averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    tables.append("## by CPU time (inclusive)\n" + averages.table(sort_by="cpu_time_total", row_limit=rows))
    return "\n\n".join(tables) + "\n"
