"""`rlscale bench mem`: the memory plan's figures against the peaks the GPU measures, phase by phase.

Per model shape (Qwen2 architecture, random weights, the step bench's BPE tokenizer), one
`rlscale train` on this machine's GPU with the plan's own picks: the step bench's workload
(32 prompts × 8 samples, one optimizer step on all 256, no reference model), but 448 new tokens in
512 at most, so that nearly every sample is as long as the plan assumes (random weights rarely
sample the end-of-sequence token). The run writes its plan to memory_plan.json and each step's
measured peaks (torch.cuda.max_memory_allocated per phase, rlscale.telemetry.memory) to
metrics.jsonl; the bench reports both and their ratio, the largest peak over the steps. A run that
runs out of memory is reported with its one-line error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlscale.bench import code_revision, write_result
from rlscale.bench.scale import train_overrides
from rlscale.bench.step import GENERATIONS, PROMPTS, build_bpe_model, rlscale_overrides, versions
from rlscale.telemetry.memory import metric_name

NEW_TOKENS, MAX_LENGTH = 448, 512
TOLERANCE = 0.15  # the plan is trusted to this fraction of the measured peak, phase by phase
STDERR_TAIL_LINES = 40  # of a failed run's stderr, kept in the JSON


def compare(plan: dict, rows: list[dict]) -> list[dict]:
    """Per planned phase: planned GB, the largest measured peak over the steps, measured / planned."""
    out = []
    for phase, figures in plan["phases"].items():
        measured = [r[metric_name(phase)] for r in rows if metric_name(phase) in r]
        peak = max(measured) if measured else None
        planned = figures["total_gb"]
        out.append({"phase": phase, "planned_gb": round(planned, 3), "measured_gb": None if peak is None else round(peak, 3),
                    "measured_over_planned": None if peak is None or not planned else round(peak / planned, 3)})
    return out


def within(phases: list[dict], tolerance: float = TOLERANCE) -> bool | None:
    """Whether every measured phase is within tolerance of its plan (None: nothing measured)."""
    ratios = [p["measured_over_planned"] for p in phases if p["measured_over_planned"] is not None]
    return all(abs(r - 1) <= tolerance for r in ratios) if ratios else None


def measure(shape: str, steps: int, overrides: list[str], work: Path) -> dict:
    model_dir, log_dir = work / shape, work / f"{shape}-run"
    build_bpe_model(shape, model_dir)
    cmd = [*train_overrides(model_dir, 1, PROMPTS, GENERATIONS, NEW_TOKENS, steps, log_dir), *rlscale_overrides(),
           f"policy.max_total_sequence_length={MAX_LENGTH}", *overrides]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlscale.cli", "train", *cmd], capture_output=True, text=True)
    result = {"model": shape, "overrides": overrides, "wall_s": round(time.perf_counter() - started, 1)}
    plan_file = log_dir / "memory_plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else None
    metrics = log_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "time/step_s" in r]
    lines = done.stderr.strip().splitlines()
    result.update(status="ok" if done.returncode == 0 else "failed", returncode=done.returncode,
                  error=lines[-1] if done.returncode and lines else None,
                  # the last line alone often only says where to look (a CUDA assert): keep what led to it
                  stderr_tail=lines[-STDERR_TAIL_LINES:] if done.returncode else None, plan=plan, steps_run=len(rows),
                  step_s=[round(r["time/step_s"], 3) for r in rows],
                  response_length_mean=[r.get("response/length_mean") for r in rows])
    if plan is not None:
        result["phases"] = compare(plan, rows)
        result["within_tolerance"] = within(result["phases"])
    return result


def mem_command(models: list[str], steps: int, overrides: list[str], json_file: Path | None, echo=print) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code_revision(),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "versions": versions(),
           "workload": {"prompts_per_step": PROMPTS, "generations_per_prompt": GENERATIONS, "max_new_tokens": NEW_TOKENS,
                        "max_total_sequence_length": MAX_LENGTH, "steps": steps, "tolerance": TOLERANCE},
           "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in models:
            echo(f"{shape}: running `rlscale train` ...")
            out["runs"].append(measure(shape, steps, overrides, Path(tmp)))
            write_result(out, json_file)
    return out


def format_table(out: dict) -> str:
    lines = [f"memory per GPU on {out['device']} (GB): planned / measured peak (measured ÷ planned), "
             f"tolerance ±{out['workload']['tolerance']:.0%}"]
    for run in out["runs"]:
        picks = ", ".join(f"{k}={json.dumps(v)}" for k, v in ((run.get("plan") or {}).get("picks") or {}).items())
        lines.append(f"{run['model']}: {run['status']}" + (f" ({run['error']})" if run.get("error") else "")
                     + (f"; picked {picks}" if picks else ""))
        for p in run.get("phases", []):
            measured = "-" if p["measured_gb"] is None else f"{p['measured_gb']:.2f}"
            ratio = "" if p["measured_over_planned"] is None else f" ({p['measured_over_planned']:.2f})"
            lines.append(f"  {p['phase']:16s} {p['planned_gb']:8.2f} / {measured}{ratio}")
    return "\n".join(lines)
