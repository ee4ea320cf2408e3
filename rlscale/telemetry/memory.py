"""Measured device-memory peaks per phase of a step, named as the memory plan names its phases.

A worker calls `end(phase)` where a phase ends; the peak since the previous end (what
torch.cuda.max_memory_allocated reports) is that phase's. The controller logs them as
`memory/<phase>_peak_gb` (the largest over workers), beside the plan's own figures
(rlscale.memory_plan), and `rlscale bench mem` compares the two. Free and silent off CUDA.
"""

from __future__ import annotations

import torch

GB = 1e9  # as rlscale.memory_plan counts


def metric_name(phase: str) -> str:
    return f"memory/{phase.replace(' ', '_')}_peak_gb"


class PhasePeaks:
    def __init__(self, device: torch.device):
        self.device = device
        self.on = device.type == "cuda"
        self.peaks: dict[str, int] = {}
        if self.on:
            torch.cuda.reset_peak_memory_stats(device)

    def end(self, phase: str) -> None:
        """The phase that just ended: its peak is the largest since the previous end."""
        if not self.on:
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        torch.cuda.reset_peak_memory_stats(self.device)

    def pop(self) -> dict[str, float]:
        """{metric name: GB} for the phases ended since the last pop."""
        out = {metric_name(phase): peak / GB for phase, peak in self.peaks.items()}
        self.peaks = {}
        return out


def largest_over_workers(results: list[dict[str, float]]) -> dict[str, float]:
    """The memory metrics of several workers' results: the largest of each (the binding GPU)."""
    keys = dict.fromkeys(key for r in results for key in r if key.startswith("memory/"))
    return {key: max(r.get(key, 0.0) for r in results) for key in keys}
