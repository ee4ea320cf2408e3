"""Which checkpoint a run starts from: `checkpointing.resume: auto | never | PATH`.

auto   the newest committed step that verifies; damaged newer steps are skipped and reported
       (a run whose every committed step is damaged stops with an error rather than start over
       beside them). No committed step: a fresh start.
never  a fresh start; refused while the directory holds committed steps, because the new run's
       saves and retention would replace or delete them. Nothing is ever deleted to make room.
PATH   that step directory, verified; a one-line error naming the path if missing or damaged.
       Newer steps in checkpoint_dir belong to the timeline the run leaves: once the chosen step
       has loaded they are renamed abandoned_step_N (kept: the newest abandoned copy of each step;
       `set_aside_newer`), so
       `auto` afterwards continues this run, not the abandoned one.

Verification checks file sizes against the manifest, and checksums too with
`checkpointing.verify_checksums` (that reads every byte, so a flipped bit is caught as well).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rlscale.ckpt import layout
from rlscale.errors import UserError


@dataclass
class ResumeChoice:
    path: Path | None  # None: start fresh
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (step dir name, why) of damaged newer steps
    newer: list[str] = field(default_factory=list)  # committed steps newer than an explicitly chosen one

    def notes(self) -> list[str]:
        target = self.path.name if self.path is not None else "nothing"
        out = []
        if self.skipped:
            skipped = "; ".join(f"{name}: {why}" for name, why in self.skipped)
            out.append(f"skipped damaged checkpoint(s) ({skipped}); resuming from {target}")
        if self.newer:
            out.append(f"resuming from {target} although the checkpoint dir holds newer steps "
                       f"({', '.join(self.newer)}): they are set aside as abandoned_step_N (kept, one "
                       "copy per step; delete them when sure), and checkpointing.resume=auto continues "
                       "this run from here on")
        return out


def set_aside_newer(root: Path, choice: ResumeChoice) -> list[Path]:
    """Rename the committed steps newer than an explicitly chosen one to abandoned_step_N (a
    different timeline: resuming `auto` from them later would mix two runs' steps). An older
    abandoned copy of the same step is replaced; nothing else is deleted."""
    moved = []
    for name in choice.newer:
        source = Path(root) / name
        if not source.is_dir():
            continue
        # one abandoned copy per step: a job retried with the same explicit resume path would
        # otherwise set aside a new copy of its own steps on every attempt, until the disk fills
        target = source.with_name(f"abandoned_{name}")
        if target.exists():
            shutil.rmtree(target)
        source.rename(target)
        moved.append(target)
    return moved


def choose(root: Path, mode: str, checksums: bool = False) -> ResumeChoice:
    root = Path(root)
    if mode == "never":
        committed = layout.committed_steps(root)
        if committed:
            raise UserError(f"checkpointing.resume=never, but {str(root)!r} holds checkpoints of an earlier run "
                            f"({committed[-1][1].name}); point logger.log_dir or checkpointing.checkpoint_dir at a "
                            "new directory, or resume with checkpointing.resume=auto")
        return ResumeChoice(None)
    if mode == "auto":
        path, skipped = layout.newest_intact(root, checksums)
        if path is not None:
            return ResumeChoice(path, skipped)
        if skipped:
            raise UserError(f"no intact checkpoint in {str(root)!r}: {skipped[0][0]} is damaged ({skipped[0][1]}); "
                            "move the directory away to start fresh, or set checkpointing.resume to a good step_N")
        return ResumeChoice(None)
    path = Path(mode).expanduser()
    if not path.exists():
        raise UserError(f"checkpointing.resume: {mode!r} does not exist (expected auto, never or the path of a "
                        "checkpoint's step_N directory)")
    verdict = layout.verify_step_dir(path, checksums=checksums)
    if not verdict.ok:
        raise UserError(f"checkpointing.resume: {mode!r} is not an intact checkpoint: {verdict.reason}")
    chosen = layout.read_manifest(path).get("step", -1)
    return ResumeChoice(path, newer=[p.name for step, p in layout.committed_steps(root) if step > chosen])
