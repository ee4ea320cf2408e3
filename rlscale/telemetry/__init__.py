"""Timers, metric sinks and the progress display."""

from rlscale.telemetry.progress import ProgressDisplay
from rlscale.telemetry.sinks import Sinks, build_sinks
from rlscale.telemetry.timers import StepTimer

__all__ = ["ProgressDisplay", "Sinks", "build_sinks", "StepTimer"]
