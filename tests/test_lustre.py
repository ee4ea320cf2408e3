"""Lustre striping of step directories (rlscale/lustre.py): `checkpointing.lustre_stripe_count=ranks`
follows the worker count, and the command that would run (`lfs` is absent here: it is captured)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlscale.config_loading import load_config
from rlscale.errors import UserError
from rlscale.lustre import setstripe_argv, stripe_count
from tests.integration.helpers import SEED_OVERRIDES


def test_the_rule_and_the_command():
    assert stripe_count("ranks", 64) == 64
    assert stripe_count(-1, 64) == -1 and stripe_count(8, 64) == 8 and stripe_count(None, 64) is None
    step = Path("/lustre/run/tmp_step_4")
    assert setstripe_argv(step, 64, "4M") == ["lfs", "setstripe", "-c", "64", "-S", "4M", "/lustre/run/tmp_step_4"]
    assert setstripe_argv(step, None, "4M") == ["lfs", "setstripe", "-S", "4M", "/lustre/run/tmp_step_4"]
    assert setstripe_argv(step, -1) == ["lfs", "setstripe", "-c", "-1", "/lustre/run/tmp_step_4"]


def test_ranks_resolves_to_the_worker_count_at_load():
    cfg = load_config(None, [*SEED_OVERRIDES, "checkpointing.lustre_stripe_count=ranks"])  # 8 nodes × 8
    assert cfg.checkpointing.lustre_stripe_count == 64
    assert load_config(None, ["checkpointing.lustre_stripe_count=ranks"]).checkpointing.lustre_stripe_count == 1
    assert load_config(None, ["checkpointing.lustre_stripe_count=-1"]).checkpointing.lustre_stripe_count == -1
    for bad in ("-2", "many"):
        with pytest.raises(UserError, match="lustre_stripe_count"):
            load_config(None, [f"checkpointing.lustre_stripe_count={bad}"])


def test_the_checkpointer_runs_that_command_on_the_step_dir(tmp_path, monkeypatch):
    """What rlscale.ckpt.layout.set_stripe (called on each tmp step dir) would run, with a stand-in
    `lfs` on PATH: the rule's argv."""
    from rlscale.ckpt import layout

    cfg = load_config(None, [*SEED_OVERRIDES, "checkpointing.lustre_stripe_count=ranks",
                             "checkpointing.lustre_stripe_size=4M"])
    ran = []
    monkeypatch.setattr(layout.shutil, "which", lambda name: "lfs" if name == "lfs" else None)
    monkeypatch.setattr(layout.subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert layout.set_stripe(tmp_path, cfg.checkpointing.lustre_stripe_count, cfg.checkpointing.lustre_stripe_size)
    assert ran == [setstripe_argv(tmp_path, 64, "4M")]
