"""`rlscale report RUN_DIR`: one HTML page with PNG plots of a finished (or crashed) run.

Reads RUN_DIR/metrics.jsonl (one row per step), RUN_DIR/summary.json (absent when the run crashed)
and the manifests of the committed checkpoints. Each plot whose data is missing is replaced by a
sentence saying so. Plots are drawn on `matplotlib.figure.Figure` objects (the Agg canvas), never
through pyplot, so nothing global is touched and no display is needed.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import yaml

from rlscale.ckpt.layout import committed_steps, read_manifest
from rlscale.errors import UserError, short_reason

TIME_PARTS = ["generate", "reward", "train", "checkpoint", "validate"]
TIME_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]


def report_command(run_dir: Path, out: Path | None = None) -> Path:
    """Render RUN_DIR's report into `out` (default RUN_DIR/report/); returns the index.html path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist or is not a directory")
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = _read_json(run_dir / "summary.json")
    out = Path(out) if out is not None else run_dir / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the report directory {out}: {short_reason(exc)}") from None
    ckpt_dir = checkpoint_dir(run_dir)
    steps = _train_rows(rows)
    sections = [
        _plot(out, "reward_accuracy.png", plot_reward_accuracy, steps, rows),
        _plot(out, "time_split.png", plot_time_split, steps),
        _plot(out, "throughput.png", plot_throughput, steps),
        _plot(out, "checkpoint_timeline.png", plot_checkpoint_timeline, steps, rows, ckpt_dir),
        _plot(out, "checkpoint_disk.png", plot_checkpoint_disk, steps, ckpt_dir),
    ]
    index = out / "index.html"
    index.write_text(_html(run_dir, summary, steps, ckpt_dir, sections), encoding="utf-8")
    return index


# ---------------------------------------------------------------- inputs


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line cut short by a crash is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"no metrics file at {path}: is this a run directory (logger.log_dir)?") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {short_reason(exc)}") from None
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_dir(run_dir: Path) -> Path:
    """checkpointing.checkpoint_dir from RUN_DIR/config.yaml, else RUN_DIR/checkpoints."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        named = (config.get("checkpointing") or {}).get("checkpoint_dir")
    except (OSError, yaml.YAMLError, AttributeError):
        named = None
    if not named:
        return run_dir / "checkpoints"
    path = Path(named)
    return path if path.is_absolute() or path.is_dir() else run_dir / path


def _train_rows(rows: list[dict]) -> list[dict]:
    """One row per training step, in step order: the step's last logged training row, with the rows
    logged for that step after it merged in (a run stopped by a signal, or its final row, logs the
    last step's save and commit on a row of their own). An earlier attempt at a step (a run that
    crashed and resumed before it) is replaced whole by the later one."""
    by_step: dict[int, dict] = {}
    for row in rows:
        step = int(row["step"])
        if _num(row.get("reward/mean")) is not None:
            by_step[step] = dict(row)
        elif step in by_step:
            by_step[step].update(row)
    return [by_step[s] for s in sorted(by_step)]


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(int(r["step"]), _num(r.get(key))) for r in rows]
    pairs = [(s, v) for s, v in pairs if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _spacing(xs: list) -> float:
    """The smallest gap between consecutive x positions (1 when there is none)."""
    gaps = [b - a for a, b in zip(sorted(xs), sorted(xs)[1:]) if b > a]
    return min(gaps) if gaps else 1.0


def _bytes_unit(largest: float) -> tuple[float, str]:
    for scale, unit in [(1e9, "GB"), (1e6, "MB"), (1e3, "kB")]:
        if largest >= scale:
            return scale, unit
    return 1.0, "bytes"


# ---------------------------------------------------------------- plots
# Each returns a caption, or raises _Skip with the sentence that replaces the plot.


class _Skip(Exception):
    pass


def _plot(out: Path, name: str, draw, *data) -> dict:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), layout="constrained")
    try:
        caption = draw(fig, *data)
    except _Skip as skip:
        (out / name).unlink(missing_ok=True)  # a stale plot from an earlier report must not linger
        return {"image": None, "caption": str(skip)}
    fig.savefig(out / name, dpi=110)
    return {"image": name, "caption": caption}


def plot_reward_accuracy(fig, steps: list[dict], rows: list[dict]) -> str:
    if not steps:
        raise _Skip("No training steps were logged, so there is no reward or accuracy to plot.")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(*_series(steps, "reward/mean"), marker="o", label="reward (mean)")
    top.set_ylabel("reward")
    top.set_title("Reward and accuracy per step")
    top.legend(loc="best", fontsize="small")
    bottom.plot(*_series(steps, "accuracy"), marker="o", label="train accuracy")
    val = [(int(r["step"]), _num(r.get("val/accuracy", r.get("final/val/accuracy")))) for r in rows]
    val = [(s, v) for s, v in val if v is not None]
    if val:
        bottom.scatter([s for s, _ in val], [v for _, v in val], color="#c44e52", zorder=3, s=36,
                       marker="D", label="held-out accuracy")
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_ylabel("accuracy")
    bottom.set_xlabel("step")
    bottom.legend(loc="best", fontsize="small")
    fig.get_axes()[-1].xaxis.get_major_locator().set_params(integer=True)
    note = "" if val else " No held-out validation was logged."
    return "Mean reward (top) and accuracy (bottom) per training step; held-out accuracy as points." + note


def plot_time_split(fig, steps: list[dict]) -> str:
    parts = [(p, c) for p, c in zip(TIME_PARTS, TIME_COLORS) if any(f"time/{p}_s" in r for r in steps)]
    if not parts:
        raise _Skip("No step timings (time/*_s) were logged, so the time split is not plotted.")
    ax = fig.subplots()
    x = [int(r["step"]) for r in steps]
    bottom = [0.0] * len(steps)
    for part, color in parts:
        heights = [_num(r.get(f"time/{part}_s")) or 0.0 for r in steps]
        ax.bar(x, heights, bottom=bottom, color=color, label=part, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_title("Where each step's time goes")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return "Seconds per step, stacked: " + ", ".join(p for p, _ in parts) + "."


def plot_throughput(fig, steps: list[dict]) -> str:
    x, y = _series(steps, "throughput/tokens_per_s")
    if not x:
        raise _Skip("No throughput (throughput/tokens_per_s) was logged.")
    ax = fig.subplots()
    ax.plot(x, y, marker="o")
    ax.set_title("Throughput")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return "Tokens (prompt and response) processed per second of step time."


def plot_checkpoint_timeline(fig, steps: list[dict], rows: list[dict], ckpt_dir: Path) -> str:
    saves = [int(r["step"]) for r in steps if _num(r.get("ckpt/bytes")) is not None]
    if not saves:
        raise _Skip("No checkpoint was saved in this run, so there is no checkpoint timeline.")
    stall = {int(r["step"]): _num(r.get("ckpt/stall_s")) or 0.0 for r in steps}
    # A save's persist time and GB/s arrive on the row of the step where it committed (the last
    # save's on the run's final row).
    persist, gbps = {}, {}
    for r in rows:
        committed = _num(r.get("ckpt/committed_step"))
        if committed is not None:
            persist[int(committed)] = _num(r.get("ckpt/persist_s"))
            gbps[int(committed)] = _num(r.get("ckpt/GBps"))
    ax = fig.subplots()
    width = 0.38 * _spacing(saves)  # bars stay visible when saves are many steps apart
    ax.bar([s - width / 2 for s in saves], [stall[s] for s in saves], width, color="#c44e52",
           label="stall (training blocked)")
    ax.bar([s + width / 2 for s in saves], [persist.get(s) or 0.0 for s in saves], width, color="#4c72b0",
           label="persist (in background)")
    ax.set_title("Checkpoint saves")
    ax.set_xlabel("saved at step")
    ax.set_ylabel("seconds")
    ax.set_xticks(saves)
    rate = [(s, gbps[s]) for s in saves if gbps.get(s) is not None]
    handles, labels = ax.get_legend_handles_labels()
    if rate:
        twin = ax.twinx()
        twin.plot([s for s, _ in rate], [g for _, g in rate], color="#55a868", marker="o", label="write GB/s")
        twin.set_ylabel("GB/s")
        twin.set_ylim(bottom=0, top=max(g for _, g in rate) * 1.25 or 1)
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.12, 1), fontsize="small")
    pending = [s for s in saves if s not in persist]
    for s in pending:
        ax.annotate("persist\nnot logged", (s + width / 2, 0), ha="center", va="bottom", fontsize="x-small")
    return ("Per save: how long training stalled, and how long persisting took in the background; "
            "write throughput on the right axis." + _unlogged_commits_note(pending, ckpt_dir))


def _unlogged_commits_note(pending: list[int], ckpt_dir: Path) -> str:
    """Saves whose commit no row logged (the run was killed, or its last row came first): the
    checkpoint directory says whether they committed after all."""
    if not pending:
        return ""
    if not ckpt_dir.is_dir():  # a run directory copied without its checkpoints, or on another volume
        return (f" No commit logged for step {', '.join(map(str, pending))}, and {ckpt_dir} is not here to "
                "say whether it committed.")
    on_disk = {step for step, _ in committed_steps(ckpt_dir)}
    kept = [s for s in pending if s in on_disk]
    lost = [s for s in pending if s not in on_disk]
    note = ""
    if kept:
        note += f" Committed, but its persist time was not logged: step {', '.join(map(str, kept))}."
    if lost:
        note += (f" Not committed in {ckpt_dir}: step {', '.join(map(str, lost))} (the run stopped before "
                 "the save finished, or retention removed it later).")
    return note


def plot_checkpoint_disk(fig, steps: list[dict], ckpt_dir: Path) -> str:
    retained = []
    for step, path in committed_steps(ckpt_dir):
        manifest = read_manifest(path) or {}
        size = manifest.get("bytes") or sum((manifest.get("files") or {}).values())
        if size:
            retained.append((step, float(size)))
    written_x, per_save = _series(steps, "ckpt/bytes")
    if not retained and not written_x:
        raise _Skip(f"No checkpoints were written or retained (looked in {ckpt_dir}).")
    written = [sum(per_save[: i + 1]) for i in range(len(per_save))]
    scale, unit = _bytes_unit(max([b for _, b in retained] + written + [sum(b for _, b in retained)]))
    ax = fig.subplots()
    if retained:
        ax.bar([s for s, _ in retained], [b / scale for _, b in retained], 0.6 * _spacing([s for s, _ in retained]),
               color="#8172b3",
               label="retained step dir (on disk now)")
        ax.axhline(sum(b for _, b in retained) / scale, color="#8172b3", linestyle="--",
                   label="all retained, total")
    if written_x:
        ax.plot(written_x, [w / scale for w in written], color="#dd8452", marker="o",
                label="written so far (cumulative)")
    ax.set_title("Checkpoint disk usage")
    ax.set_xlabel("step")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return (f"Bytes of the committed checkpoints now in {ckpt_dir} (bars, one per retained step) "
            "against the bytes written by every save (line): the gap is what retention deleted.")


# ---------------------------------------------------------------- HTML


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _summary_html(summary: dict | None, steps: list[dict]) -> str:
    if summary is None:
        last = int(steps[-1]["step"]) if steps else 0
        return (f"<p>No summary.json: the run did not finish (it crashed or is still running). "
                f"Metrics reach step {last}.</p>")
    facts = [("final step", summary.get("final_step")), ("steps run", summary.get("steps_run")),
             ("resumed from", summary.get("resumed_from")), ("wall seconds", summary.get("wall_s"))]
    out = ["<table>"] + [f"<tr><th>{k}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in facts]
    out.append("</table>")
    evals = summary.get("eval") or {}
    before, after = evals.get("before") or {}, evals.get("after") or {}
    names = list(dict.fromkeys([*before, *after]))
    if names:
        out.append("<h3>Held-out evaluation</h3><table><tr><th></th><th>before</th><th>after</th></tr>")
        out += [f"<tr><th>{html.escape(n)}</th><td>{html.escape(_fmt(before.get(n)))}</td>"
                f"<td>{html.escape(_fmt(after.get(n)))}</td></tr>" for n in names]
        out.append("</table>")
    else:
        out.append("<p>No held-out evaluation was run.</p>")
    return "\n".join(out)


def _html(run_dir: Path, summary: dict | None, steps: list[dict], ckpt_dir: Path, sections: list[dict]) -> str:
    body = []
    for section in sections:
        caption = html.escape(section["caption"])
        if section["image"]:
            body.append(f'<figure><img src="{section["image"]}" alt="{caption}">'
                        f"<figcaption>{caption}</figcaption></figure>")
        else:
            body.append(f'<p class="skipped">{caption}</p>')
    title = html.escape(f"rlscale run report: {run_dir.resolve().name}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 960px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.7em; text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 0.9em; }} .skipped {{ color: #a33; font-style: italic; }}
</style></head><body>
<h1>{title}</h1>
<p>Run directory: <code>{html.escape(str(run_dir.resolve()))}</code>; checkpoints:
<code>{html.escape(str(ckpt_dir))}</code></p>
<h2>Summary</h2>
{_summary_html(summary, steps)}
<h2>Plots</h2>
{chr(10).join(body)}
</body></html>
"""
