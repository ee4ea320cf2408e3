"""Lustre striping of a checkpoint's step directory: the rule and the command.

`checkpointing.lustre_stripe_count` is a number (`lfs setstripe -c N`; -1 = every storage
target) or `ranks`: the run's worker count (cluster.num_nodes × cluster.gpus_per_node), resolved
when the config loads. Every rank writes its own shard files into the step directory at once, so
a directory striped over as many targets (OSTs) as there are ranks gives each rank's stream about
one target's bandwidth; Lustre uses every target when the count exceeds them. The files inherit
the directory's layout (rlscale.ckpt.layout.set_stripe runs the command on each tmp step dir
before any file is written, when `lfs` is on PATH).
"""

from __future__ import annotations

from pathlib import Path

RANKS = "ranks"


def stripe_count(setting: int | str | None, ranks: int) -> int | None:
    """The `-c` of a step directory: `setting` as given, the worker count for 'ranks', None (no -c)."""
    if setting == RANKS:
        return ranks
    return None if setting is None else int(setting)


def setstripe_argv(directory: str | Path, count: int | None, size: str | None = None, lfs: str = "lfs") -> list[str]:
    """`lfs setstripe [-c COUNT] [-S SIZE] DIR`: the command that stripes a step directory."""
    return ([lfs, "setstripe"] + (["-c", str(count)] if count is not None else [])
            + (["-S", size] if size else []) + [str(directory)])
