"""`rlscale bench gen` on CPU with the tiny shape: every variant runs and the numbers add up."""

import json

import torch
from typer.testing import CliRunner

from rlscale.bench.gen import bandwidth_bound_tokens_per_s, build_model
from rlscale.cli import app


def bench_gen_tiny(variants: list[str], tokens: int, *options: str) -> None:
    """`rlscale bench gen` on the tiny shape, one timed repetition; the command must succeed."""
    torch.set_num_threads(1)
    args = ["bench", "gen", "--model", "tiny", "--reps", "1", "--prompt-tokens", str(tokens),
            "--new-tokens", str(tokens), *[a for v in variants for a in ("--variant", v)], *options]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


def test_bench_gen_writes_each_variant_and_the_engine_logprob_check(tmp_path):
    out = tmp_path / "gen.json"
    bench_gen_tiny(["engine", "hf_dynamic"], 8, "--batch", "4", "--json", str(out))
    entry = json.loads(out.read_text())["models"]["tiny"]
    assert set(entry["results"]) == {"engine", "hf_dynamic"}
    for r in entry["results"].values():
        assert r["tokens_per_s"] == 4 * 8 / r["median_s"]
    assert entry["best_engine_vs_best_hf"] == (entry["results"]["engine"]["tokens_per_s"]
                                               / entry["results"]["hf_dynamic"]["tokens_per_s"])
    check = entry["engine_logprobs_vs_forward"]
    assert check["max_abs"] < 1e-4 and abs(check["token_mult_prob_error"] - 1.0) < 1e-4  # fp32 on CPU


def test_the_bandwidth_bound_counts_weights_once_per_step_plus_the_growing_kv_cache():
    model = build_model("tiny", torch.device("cpu"), torch.float32)
    weights = sum(p.numel() for p in model.parameters()) * 4
    kv_per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 64/4, fp32
    seconds = sum(weights + 3 * (5 + t) * kv_per_token for t in range(2)) / 1e9
    assert abs(bandwidth_bound_tokens_per_s(model, 3, 5, 2, 1e9) - 3 * 2 / seconds) < 1e-6


def test_bench_gen_kernel_profile_appends_one_table_set_per_variant(tmp_path):
    tables = tmp_path / "kernels.txt"
    bench_gen_tiny(["engine", "engine_eager"], 4, "--batch", "2", "--kernel-profile", str(tables))
    text = tables.read_text()
    assert text.count("# tiny engine,") == 1 and text.count("# tiny engine_eager,") == 1
    assert text.count("## by CPU time (inclusive)") == 2 and "aten::" in text


def test_bench_gen_runs_the_hf_baselines_and_the_engine_as_training_runs_it_by_default(monkeypatch):
    import rlscale.bench.gen as gen

    seen = []
    monkeypatch.setattr(gen, "run_benchmark", lambda shapes, variants, *args, **kwargs: seen.append(variants)
                        or {"device": "cpu", "batch": 1, "prompt_tokens": 1, "new_tokens": 2, "models": {}})
    assert CliRunner().invoke(app, ["bench", "gen"]).exit_code == 0
    assert seen == [["hf_dynamic", "hf_static", "engine_compiled"]]
    assert gen.ENGINE_VARIANTS["engine_compiled"] == {"compiled": True}  # graphs on CUDA too: policy.generation's defaults
