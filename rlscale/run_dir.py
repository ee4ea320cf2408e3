"""A run's bookkeeping around the GRPO loop: what a start finds in its directories and what it
leaves there.

Before the loop: the checkpoint `checkpointing.resume` picks (the choice itself is
rlscale/ckpt/resume.py's), whether that run already finished, whether a fresh start would
overwrite another run's metrics, the run dir, and the restore (`resume_or_start`). Once the loop
may start: config.yaml and memory_plan.json (`write_start_files`). After it: summary.json
(`write_summary`). Every function here reads or writes files; none trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlscale.ckpt import Checkpointer
from rlscale.ckpt.layout import read_manifest
from rlscale.ckpt.resume import ResumeChoice, choose as choose_resume, set_aside_newer
from rlscale.config import Config, flat_dict
from rlscale.data import PromptLoader
from rlscale.errors import UserError
from rlscale.fsutil import ensure_writable_dir, write_atomic
from rlscale.telemetry import print_note

SUMMARY = "summary.json"


@dataclass
class TrainerState:
    """Everything the controller needs to continue a run exactly where it stopped."""

    step: int = 0
    loader: dict = field(default_factory=dict)
    eval_before: dict | None = None
    last_val: dict = field(default_factory=dict)
    wall_s: float = 0.0


# ------------------------------------------------------------------ before anything loads


def resume_choice(cfg: Config) -> ResumeChoice | None:
    """The checkpoint `checkpointing.resume` picks in checkpoint_dir (only reads; a wrong
    checkpointing.resume fails here); None: checkpointing is off."""
    if not cfg.checkpointing.enabled:
        return None
    return choose_resume(cfg.checkpoint_dir, cfg.checkpointing.resume, cfg.checkpointing.verify_checksums)


def finished_summary(cfg: Config, choice: ResumeChoice | None) -> dict | None:
    """The summary of a run that already ended at the checkpoint it would resume from: that step
    reaches grpo.max_num_steps and the run's summary.json was written for it. None when work is
    left (more steps, or the final validation). Decided from files alone, before any model loads."""
    if choice is None or choice.path is None:
        return None
    step = (read_manifest(choice.path) or {}).get("step")
    if step is None or step < cfg.grpo.max_num_steps:
        return None
    try:
        summary = json.loads((Path(cfg.logger.log_dir) / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("final_step") == step else None


def already_finished(cfg: Config, choice: ResumeChoice, finished: dict) -> dict:
    """Nothing left to do: say so, load nothing, leave the run's files as they are."""
    for note in choice.notes() + [f"the run in {cfg.logger.log_dir} finished at step {finished['final_step']} "
                                  f"(grpo.max_num_steps={cfg.grpo.max_num_steps}); raise grpo.max_num_steps "
                                  "to train on, or set logger.log_dir for a new run"]:
        print_note(note)
    return finished


# settings a resumed run is expected to change: the horizon, where and how it saves and logs
_RESUME_MAY_CHANGE = ("grpo.max_num_steps", "checkpointing.", "logger.")


def _saved_config(directory: Path) -> dict[str, object] | None:
    """The config.yaml a run wrote into `directory` (a step, or a run dir), flattened; None if none."""
    import yaml

    try:
        tree = yaml.safe_load((Path(directory) / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return flat_dict(tree) if isinstance(tree, dict) else None


def config_differences(directory: Path, cfg: Config, shown: int = 4) -> str | None:
    """The settings in which `cfg` differs from the config.yaml in `directory` (a step, or a run
    dir), other than the horizon, saving and logging, as "key old -> new, ..."; None when there is
    no such file or no difference."""
    saved = _saved_config(directory)
    if saved is None:
        return None
    now = flat_dict(cfg.to_dict())
    # keys only one side has come from another rlscale version (an option added or removed), not
    # from other settings
    changed = [key for key in sorted(set(saved) & set(now))
               if saved[key] != now[key] and not key.startswith(_RESUME_MAY_CHANGE)]
    if not changed:
        return None
    listed = ", ".join(f"{key} {saved[key]!r} -> {now[key]!r}" for key in changed[:shown])
    return listed + (f" (and {len(changed) - shown} more)" if len(changed) > shown else "")


def config_changes(step_dir: Path, cfg: Config) -> str | None:
    """A note naming the settings that differ from those the step was saved with, or None: a run
    resumed with another batch size or model (the directory reused by another job, say) should
    not pass unnoticed."""
    changed = config_differences(step_dir, cfg)
    return (f"resuming {Path(step_dir).name}, saved with other settings: {changed}; to start afresh "
            "instead, give this run its own logger.log_dir") if changed else None


def check_fresh_start(cfg: Config) -> None:
    """A run that starts from scratch replaces its log dir's metrics and summary: refused when they
    belong to a run with other settings (checkpointing off, or a run that never saved), which
    would be lost. The same settings again is the same run starting over, and may."""
    log_dir = Path(cfg.logger.log_dir)
    metrics = log_dir / "metrics.jsonl"
    if not (metrics.is_file() and metrics.stat().st_size > 0):
        return
    if not cfg.checkpointing.enabled and (_saved_config(log_dir) or {}).get("checkpointing.enabled"):
        raise UserError(f"logger.log_dir {str(log_dir)!r} holds a checkpointed run and this run has "
                        "checkpointing.enabled=false, so it would overwrite that run's metrics; resume it with "
                        "checkpointing on, or give this run its own logger.log_dir")
    changed = config_differences(log_dir, cfg)
    if changed:
        raise UserError(f"logger.log_dir {str(log_dir)!r} holds the metrics of a run with other settings ({changed}) "
                        "and this run starts from scratch (no checkpoint to resume), so it would overwrite them; "
                        "give this run its own logger.log_dir")


# ------------------------------------------------------------------ the directories


def new_run_dirs(cfg: Config) -> list[Path]:
    """The checkpoint and log directories that do not exist yet (this run will create them),
    children before parents, for `remove_if_empty`."""
    return [d for d in (cfg.checkpoint_dir, Path(cfg.logger.log_dir)) if not d.exists()]


def remove_if_empty(directories: list[Path]) -> None:
    for directory in directories:  # children first
        try:
            directory.rmdir()  # only ever removes an empty directory
        except OSError:
            pass


def prepare_run_dir(cfg: Config) -> Path:
    """Create the run directory and check it takes files (config.yaml is written after resuming)."""
    return ensure_writable_dir(Path(cfg.logger.log_dir), "logger.log_dir")


# ------------------------------------------------------------------ resuming


def resume_or_start(choice: ResumeChoice | None, checkpointer: Checkpointer, group,
                    loader: PromptLoader, cfg: Config) -> tuple[TrainerState, str | None, list[str]]:
    """Restore the checkpoint `checkpointing.resume` picked (see rlscale/ckpt/resume.py; None:
    checkpointing is off); returns the state, the step dir resumed from (None: a fresh start) and
    lines worth telling the user."""
    if choice is None:
        return TrainerState(), None, []
    if choice.path is None:
        return TrainerState(), None, choice.notes()
    state = TrainerState(**checkpointer.load(choice.path, group))
    loader.load_state_dict(state.loader)
    set_aside_newer(checkpointer.root, choice)  # only once the chosen step has loaded
    changes = config_changes(choice.path, cfg)
    return state, str(choice.path), choice.notes() + ([changes] if changes else [])


# ------------------------------------------------------------------ the run's files


def write_start_files(run_dir: Path, cfg: Config, plan=None) -> None:
    """What a run that starts training writes into its run dir: the older summary goes (a shorter
    run's, or one of the steps this run takes again: it must not pass for this run's if it stops
    before writing its own), config.yaml, and memory_plan.json beside the measured
    memory/*_peak_gb (rlscale bench mem) when the plan has phases."""
    (run_dir / SUMMARY).unlink(missing_ok=True)
    write_atomic(run_dir / "config.yaml", cfg.to_yaml())
    if plan is not None and plan.phases:
        write_atomic(run_dir / "memory_plan.json", json.dumps(plan.as_dict(), indent=2) + "\n")


def write_summary(run_dir: Path, cfg: Config, state: TrainerState, start_step: int,
                  resumed_from: str | None, eval_after: dict | None) -> dict:
    """Write summary.json for a run that reached its horizon; returns the summary. Called while the
    run still holds the checkpoint dir: a run waiting for the claim must find it when it gets it
    (`finished_summary`)."""
    summary = {
        "final_step": state.step,
        "steps_run": state.step - start_step,
        "resumed_from": resumed_from,
        "wall_s": round(state.wall_s, 3),
        "eval": {"before": _strip(state.eval_before), "after": _strip(eval_after)},
        "checkpoint_dir": str(cfg.checkpoint_dir) if cfg.checkpointing.enabled else None,
    }
    write_atomic(run_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def _strip(val_metrics: dict | None) -> dict | None:
    """{'val/accuracy': x, ...} -> {'accuracy': x, ...} for summary.json."""
    if val_metrics is None:
        return None
    return {key.split("/", 1)[1]: value for key, value in val_metrics.items()}
