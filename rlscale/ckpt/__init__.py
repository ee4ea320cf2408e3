"""Checkpoints: durable, atomic saves of the whole training state, and their retention."""

from rlscale.ckpt.checkpointer import Checkpointer, SaveReport
from rlscale.ckpt.layout import latest_intact, verify_step_dir

__all__ = ["Checkpointer", "SaveReport", "latest_intact", "verify_step_dir"]
