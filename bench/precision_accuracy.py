"""The built-in task at a small learning rate, once per policy.master_weights: does the model learn?

Runs `rlscale train` (defaults otherwise: the shipped tiny model, the arithmetic task) for each
setting in turn and records held-out accuracy before and after, the step time and the peak GPU
memory the run's metrics report. Usage (on the GPU machine, from the project root):
  python bench/precision_accuracy.py --steps 120 --lr 1e-5 --json bench/results/precision-accuracy.json \
      auto bf16 bf16_stochastic
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlscale.bench import code_revision, write_result


def run(master: str, steps: int, lr: float, work: Path, extra: list[str]) -> dict:
    log_dir = work / master
    cmd = [sys.executable, "-m", "rlscale.cli", "train", f"policy.master_weights={master}",
           f"policy.optimizer.lr={lr}", f"grpo.max_num_steps={steps}", f"logger.log_dir={log_dir}",
           "logger.progress=false", "checkpointing.enabled=false", *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"master_weights": master, "status": "failed", "returncode": done.returncode,
                "stderr_tail": done.stderr[-3000:]}
    summary = json.loads((log_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(r["time/step_s"] for r in rows if "time/step_s" in r)
    before, after = summary["eval"]["before"]["accuracy"], summary["eval"]["after"]["accuracy"]
    return {"master_weights": master, "overrides": extra, "status": "ok", "accuracy_before": before, "accuracy_after": after,
            "gain_points": round(100 * (after - before), 1), "median_step_s": step_s[len(step_s) // 2],
            "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("masters", nargs="+")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", action="append", default=[], help="another config override (repeatable)")
    args = parser.parse_args()
    import torch

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "code": code_revision(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "steps": args.steps, "lr": args.lr, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for master in args.masters:
            out["runs"].append(run(master, args.steps, args.lr, Path(tmp), args.set))
            print(json.dumps(out["runs"][-1]), flush=True)
            write_result(out, args.json)


if __name__ == "__main__":
    main()
