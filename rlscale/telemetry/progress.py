"""A live progress line a person can follow: step, reward, accuracy, tokens/s, ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def print_note(message: str) -> None:
    """One line for the person running this, on stderr (stdout carries the run's summary)."""
    Console(stderr=True, soft_wrap=True).print(message, highlight=False)


class ProgressDisplay:
    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.console = Console(stderr=True)
        self.enabled = enabled
        terminal = self.console.is_terminal
        # Without a terminal (a Ray job's log, CI) a live bar cannot redraw: no bar, plain lines
        # every 5% of the run, each whole on its line (a log has no width to wrap at).
        self.console.soft_wrap = not terminal
        self._progress = Progress(
            TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, disable=not (enabled and terminal), transient=False)
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self._plain_every = 0 if terminal else max(1, total_steps // 20)

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"reward {metrics.get('reward/mean', 0.0):.3f}",
                 f"acc {metrics.get('accuracy', 0.0):.3f}",
                 f"{metrics.get('throughput/tokens_per_s', 0.0):,.0f} tok/s"]
        if "val/accuracy" in metrics:
            parts.append(f"val {metrics['val/accuracy']:.3f}")
        if "ckpt/stall_s" in metrics:  # a save started this step
            parts.append(f"ckpt stall {metrics['ckpt/stall_s']:.2f}s")
        if "ckpt/GBps" in metrics:  # a save committed this step (async saves commit later)
            parts.append(f"ckpt {metrics['ckpt/persist_s']:.1f}s {metrics['ckpt/GBps']:.2f}GB/s "
                         f"free {metrics['ckpt/free_GB']:.0f}GB")
        self._progress.update(self._task, completed=step, stats="  ".join(parts))
        task = self._progress.tasks[0]
        if self.enabled and self._plain_every and (step % self._plain_every == 0 or step >= task.total):
            eta = f"  ETA {task.time_remaining:.0f}s" if task.time_remaining is not None else ""
            self.console.print(f"step {step}/{task.total}  " + "  ".join(parts) + eta, highlight=False)

    def print(self, message: str) -> None:
        self.console.print(message, highlight=False)
