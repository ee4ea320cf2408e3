"""`rlscale bench mem`'s comparison of planned and measured peaks, and the workers' peak merge."""

from __future__ import annotations


from rlscale.bench.mem import compare, format_table, within
from rlscale.telemetry.memory import PhasePeaks, largest_over_workers, metric_name

PLAN = {"phases": {"weight sync": {"total_gb": 10.0}, "generation": {"total_gb": 20.0},
                   "update": {"total_gb": 40.0}, "optimizer step": {"total_gb": 12.0}}}


def test_compare_takes_the_largest_peak_over_steps_per_phase():
    rows = [{metric_name("weight sync"): 9.0, metric_name("generation"): 25.0, metric_name("update"): 38.0},
            {metric_name("weight sync"): 10.5, metric_name("generation"): 21.0, metric_name("update"): 39.0}]
    phases = {p["phase"]: p for p in compare(PLAN, rows)}
    assert phases["weight sync"]["measured_gb"] == 10.5 and phases["weight sync"]["measured_over_planned"] == 1.05
    assert phases["generation"]["measured_over_planned"] == 1.25
    assert phases["update"]["measured_over_planned"] == 0.975
    assert phases["optimizer step"]["measured_gb"] is None  # never measured (no GPU): no ratio
    assert within(list(phases.values())) is False  # generation is 25% over
    assert within([phases["weight sync"], phases["update"]]) is True
    assert within([phases["optimizer step"]]) is None


def test_the_table_names_each_phase_with_both_figures():
    out = {"device": "NVIDIA H200", "workload": {"tolerance": 0.15},
           "runs": [{"model": "qwen2-7b", "status": "ok", "error": None,
                     "plan": {"picks": {"policy.master_weights": "bf16_stochastic"}},
                     "phases": compare(PLAN, [{metric_name("update"): 44.0}])}]}
    text = format_table(out)
    assert 'qwen2-7b: ok; picked policy.master_weights="bf16_stochastic"' in text
    assert "update              40.00 / 44.00 (1.10)" in text
    assert "optimizer step      12.00 / -" in text


def test_workers_peaks_merge_to_the_largest_and_cpu_measures_nothing():
    import torch

    assert metric_name("optimizer step") == "memory/optimizer_step_peak_gb"
    results = [{"loss": 1.0, "memory/update_peak_gb": 3.0}, {"loss": 2.0, "memory/update_peak_gb": 5.0,
                                                            "memory/generation_peak_gb": 1.0}]
    assert largest_over_workers(results) == {"memory/update_peak_gb": 5.0, "memory/generation_peak_gb": 1.0}
    peaks = PhasePeaks(torch.device("cpu"))
    peaks.end("update")
    assert peaks.pop() == {}
