"""Timers, metric sinks and the progress display."""

from rlscale.telemetry.progress import ProgressDisplay, print_note
from rlscale.telemetry.sinks import Sinks, build_sinks
from rlscale.telemetry.timers import StepTimer

__all__ = ["ProgressDisplay", "Sinks", "build_sinks", "print_note", "StepTimer"]
