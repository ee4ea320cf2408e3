"""The `rlscale` command. Thin: parse, validate, hand over to the library."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import typer

from rlscale.bench.cli import bench_app
from rlscale.errors import UserError
from rlscale.preemption import RunStopped

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="GRPO post-training of language models with verifiable rewards.")

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file")
OVERRIDES_ARG = typer.Argument(None, help="dotted overrides, e.g. grpo.max_num_steps=20", show_default=False)


def _print_resolved(cfg) -> None:
    from rlscale.config import derive_sizes

    typer.echo(cfg.to_yaml().rstrip())
    typer.echo("# derived sizes")
    for key, value in derive_sizes(cfg).as_dict().items():
        typer.echo(f"#   {key}: {value}")


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    config: Optional[Path] = CONFIG_OPTION,
    dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the resolved config, then stop"),
    strict: bool = typer.Option(False, "--strict", help="refuse NeMo-RL keys that rlscale does not act on "
                                "(by default they are listed once, with what rlscale does instead)"),
) -> None:
    """Run GRPO (the built-in tiny arithmetic job when given no arguments).

    Exit codes: 0 done; 2 a problem to fix (one line on stderr; out of memory too, its traceback
    then in <logger.log_dir>/error.log).

    143 (SIGTERM) or 130 (SIGINT): stopped after saving what fit in checkpointing.preemption_grace_s.

    75: stopped for checkpointing.checkpoint_must_save_by, after a save. Run the same command to resume.
    """
    from rlscale.config import config_notes
    from rlscale.config_loading import load_config_and_notes
    from rlscale.telemetry import print_note

    loaded = load_config_and_notes(config, overrides or [], strict=strict)  # a NeMo-RL recipe too
    cfg = loaded.cfg
    for note in [*loaded.ignored_lines(), *loaded.notes, *config_notes(cfg)]:
        print_note(note)
    if dry_run:
        from rlscale.data.presets import find_preset

        find_preset(cfg.data.dataset_name)  # a name check only: no data is read
        from rlscale.memory_plan import plan_for

        plan = plan_for(cfg)  # printed before a refusal: the table shows where the memory goes
        _print_resolved(plan.apply(cfg))
        for line in plan.lines():
            typer.echo(f"# {line}")
        if plan.refusal():
            raise UserError(plan.refusal())
        return
    from rlscale.controller import train as run_training

    summary = run_training(cfg)
    typer.echo(json.dumps(summary, indent=2))


def eval_config(checkpoint: Path | None, config: Path | None, overrides: list[str]):
    """`rlscale eval`'s settings: with --checkpoint and no --config, those of the checkpoint's run
    (its data, prompts, generation, reward), the hardware settings this machine's; then overrides."""
    from rlscale.config_loading import load_config

    run_config = checkpoint / "config.yaml" if checkpoint is not None and config is None else None
    if run_config is None or not run_config.is_file():
        return load_config(config, overrides)
    here = ["policy.device=auto", "policy.dtype=auto", "policy.attention_backend=auto", "policy.compile=null",
            "policy.cpu_threads=null"]
    try:
        return load_config(run_config, here + list(overrides))
    except UserError as exc:
        raise UserError(f"{run_config} (the checkpoint's run settings): {exc}; pass --config FILE to evaluate "
                        "with other settings") from None


@app.command("eval")
def evaluate_cmd(
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    model: Optional[str] = typer.Option(None, "--model", help="model id/path (default: policy.model_name)"),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="a committed step_N directory"),
    config: Optional[Path] = CONFIG_OPTION,
    k: int = typer.Option(1, "--k", min=1, help="samples per problem for pass@k"),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="default: 0 for k=1, else policy's"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1,
                                        help="held-out problems to use (default: grpo.max_val_samples)"),
) -> None:
    """Accuracy and pass@k on the held-out set, for a model or a checkpoint (with the settings the
    checkpoint's run used: its data, prompt format and generation length, unless --config is given)."""
    if temperature is not None and not math.isfinite(temperature):
        raise UserError(f"--temperature {temperature} must be a finite number")
    cfg = eval_config(checkpoint, config, overrides or [])
    if checkpoint is not None and model is not None:
        raise UserError("give --model or --checkpoint, not both")
    from rlscale.ckpt.layout import verify_step_dir

    if checkpoint is not None:
        verdict = verify_step_dir(checkpoint)
        if not verdict.ok:
            raise UserError(f"checkpoint {str(checkpoint)!r} is not usable: {verdict.reason}")
        from rlscale.ckpt.tools import loadable_policy_dir

        # a sharded step's policy/ is the ranks' rows: exported for the evaluation, removed after
        scratch = tempfile.TemporaryDirectory(prefix="rlscale-eval-")
        model = str(loadable_policy_dir(checkpoint, Path(scratch.name) / "policy"))
    updates = {"loss": cfg.loss.model_copy(update={"reference_policy_kl_penalty": 0.0})}
    if model is not None:
        updates["policy"] = cfg.policy.model_copy(update={"model_name": model, "tokenizer_name": None})
    cfg = cfg.model_copy(update=updates)
    from rlscale.controller import sampling_params
    from rlscale.data import build_datasets
    from rlscale.evaluate import evaluate
    from rlscale.rewards import RewardScorer
    from rlscale.workers.group import LocalWorkerGroup
    from rlscale.workers.policy import PolicyWorker

    problems = build_datasets(cfg.data, cfg.grpo.seed).val
    problems = problems[:limit or cfg.grpo.max_val_samples]  # what the run's validation scored
    if temperature is None:
        temperature = 0.0 if k == 1 else cfg.policy.generation.temperature
    if k > 1 and temperature == 0:
        raise UserError("--k > 1 needs --temperature > 0: greedy samples are all the same")
    with RewardScorer(cfg.rewards.function, cfg.rewards.timeout_s, cfg.rewards.num_workers) as scorer:
        group = LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size), 1)
        result = evaluate(group, problems, scorer, sampling_params(cfg, temperature), k=k)
    typer.echo(json.dumps({"model": cfg.policy.model_name, "temperature": temperature, **result.__dict__}, indent=2))


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a run directory (logger.log_dir)"),
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default: RUN_DIR/report)"),
) -> None:
    """One HTML page with PNG plots: reward, time split, tokens/s, checkpoint timeline, disk."""
    from rlscale.telemetry.report import report_command

    typer.echo(f"wrote {report_command(run_dir, out)}")


@app.command("config")
def config_reference() -> None:
    """Print every config key with its default and meaning (a Markdown table)."""
    from rlscale.config import reference_table

    typer.echo(reference_table())


@app.command()
def sft(
    out: Optional[Path] = typer.Option(None, "--out", help="output model directory (default: the built-in "
                                       "model's own, inside the installed package)"),
    steps: int = typer.Option(None, "--steps", min=1, help="optimizer steps"),
    slip_rate: float = typer.Option(None, "--slip-rate", min=0.0, max=1.0,
                                    help="share of carry problems shown with the carry forgotten"),
    seed: int = typer.Option(None, "--seed"),
) -> None:
    """Rebuild the built-in tiny model: a supervised warm start on the arithmetic task."""
    from rlscale.sft import SFTSettings, run_sft

    settings = SFTSettings()
    for name, value in (("steps", steps), ("slip_rate", slip_rate), ("seed", seed)):
        if value is not None:
            setattr(settings, name, value)
    if out is None:
        from rlscale.models.loading import BUILTIN_DIR

        out = BUILTIN_DIR / "tiny-arith"
    path = run_sft(out, settings)
    typer.echo(f"wrote {path}")


ckpt_app = typer.Typer(no_args_is_help=True, help="List, verify and export checkpoints.")
app.add_typer(ckpt_app, name="ckpt")


@ckpt_app.command("list")
def ckpt_list(
    directory: Path = typer.Argument(..., help="a checkpoint directory (checkpointing.checkpoint_dir)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
) -> None:
    """Steps in a checkpoint directory: committed (sizes checked) and uncommitted ones."""
    from rlscale.ckpt.tools import list_steps

    rows = list_steps(directory)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo(f"no checkpoints in {directory}")
    for row in rows:
        size = f"{row['bytes'] / 1e9:8.3f} GB" if row["bytes"] is not None else " " * 11
        metrics = "  ".join(f"{k}={v:.4g}" for k, v in sorted(row["metrics"].items())
                            if k.startswith("val/") and isinstance(v, (int, float)))
        note = "" if row["state"] == "intact" else f"  ({row['reason']})"
        typer.echo(f"step {row['step']:>7}  {row['state']:<11} {size}  {metrics}{note}")


@ckpt_app.command("verify")
def ckpt_verify(
    step_dir: Path = typer.Argument(..., help="a step_N directory"),
    sizes_only: bool = typer.Option(False, "--sizes-only", help="skip checksums (do not read the data)"),
) -> None:
    """Whether a step is intact (file sizes and checksums as its manifest says), and why not; exit 1 if damaged."""
    from rlscale.ckpt.layout import verify_step_dir

    if not step_dir.exists():
        raise UserError(f"checkpoint {str(step_dir)!r} does not exist")
    inside = _step_dirs_inside(step_dir)
    if inside:  # a checkpoint (or run) directory given where one of its steps was meant
        raise UserError(f"{str(step_dir)!r} is not a step directory: it holds {', '.join(inside[:3])}"
                        f"{' ...' if len(inside) > 3 else ''}; verify one of those (rlscale ckpt list shows them all)")
    verdict = verify_step_dir(step_dir, checksums=not sizes_only)
    typer.echo(f"{step_dir}: {verdict.reason if verdict.ok else 'damaged: ' + verdict.reason}")
    if not verdict.ok:
        raise typer.Exit(1)


def _step_dirs_inside(directory: Path) -> list[str]:
    """step_N directories in `directory` or its checkpoints/ (newest first), when it holds no manifest."""
    from rlscale.ckpt.layout import MANIFEST, committed_steps

    if (directory / MANIFEST).exists() or not directory.is_dir():
        return []
    for root in (directory, directory / "checkpoints"):
        steps = committed_steps(root) if root.is_dir() else []
        if steps:
            return [str(path.relative_to(directory)) for _, path in sorted(steps, reverse=True)]
    return []


@ckpt_app.command("export")
def ckpt_export(
    step_dir: Path = typer.Argument(..., help="a committed step_N directory"),
    out: Path = typer.Argument(..., help="new (or empty) directory for the Hugging Face model"),
    adapter: bool = typer.Option(False, "--adapter", help="a LoRA step: PEFT's adapter directory instead of "
                                 "the merged model"),
) -> None:
    """Write the step's policy as a Hugging Face model directory (after verifying checksums); a
    LoRA step's is the merged model (base + adapters), or with --adapter PEFT's adapter directory."""
    from rlscale.ckpt.tools import export_policy

    typer.echo(f"wrote {export_policy(step_dir, out, adapter)}")


def _add_cluster_commands() -> None:
    """`rlscale cluster render` and `rlscale job ...` (the KubeRay path)."""
    from rlscale.cluster.render import render_app

    app.add_typer(render_app, name="cluster")
    try:
        from rlscale.cluster.jobs import job_app
    except ImportError:  # the jobs module needs Ray's job client
        return
    app.add_typer(job_app, name="job")


_add_cluster_commands()

app.add_typer(bench_app, name="bench")  # rlscale/bench/cli.py


def main() -> None:
    import click

    # typer >= 0.2x vendors click; older typer raises click's own exceptions
    option_errors = tuple(c for c in (getattr(typer, "TyperException", None), click.ClickException) if c)
    try:
        code = app(standalone_mode=False)  # returns, not raises, a command's typer.Exit code
        if code == 130:  # typer turns a KeyboardInterrupt (Ctrl-C before a run's own handler) into 130
            typer.echo("rlscale: interrupted", err=True)
        if isinstance(code, int) and code:
            sys.exit(code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("rlscale: interrupted", err=True)
        sys.exit(130)
    except option_errors as exc:  # a bad option or argument: one line, like any user error
        if exc.format_message():  # empty after no_args_is_help has printed the help
            typer.echo(f"rlscale: error: {exc.format_message()}", err=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except UserError as exc:  # OutOfMemory too (rlscale.errors): the phase, figures, what to change
        typer.echo(f"rlscale: error: {exc}", err=True)
        sys.exit(2)
    except RunStopped as exc:  # SIGTERM/SIGINT or the deadline, after saving: see rlscale/preemption.py
        typer.echo(f"rlscale: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("rlscale: interrupted", err=True)
        sys.exit(130)
    except (RuntimeError, MemoryError) as exc:  # out of memory outside `train` (eval, sft, bench): one line
        from rlscale.errors import is_out_of_memory, out_of_memory

        if not is_out_of_memory(exc) or os.environ.get("RLSCALE_TRACEBACK"):
            raise
        typer.echo(f"rlscale: error: {out_of_memory(exc)} (RLSCALE_TRACEBACK=1 shows where)", err=True)
        sys.exit(2)
    except OSError as exc:  # the file system or network refused (disk full, a name too long, ...)
        if os.environ.get("RLSCALE_TRACEBACK"):
            raise
        where = "".join(f"{name}: " for name in (exc.filename, exc.filename2) if name)
        typer.echo(f"rlscale: error: {where}{exc.strerror or exc} (RLSCALE_TRACEBACK=1 shows where)", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
