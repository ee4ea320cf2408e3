"""`rlscale bench gen` on CPU with the tiny shape: every variant runs and the numbers add up."""

import json
import math

import torch
from typer.testing import CliRunner

from rlscale.bench.gen import bandwidth_bound_tokens_per_s, build_model
from rlscale.cli import app
from rlscale.errors import UserError


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
    fixed = bandwidth_bound_tokens_per_s(model, 3, 5, 2, 1e9)
    assert bandwidth_bound_tokens_per_s(model, 3, 5, 2, 1e9, [2, 2, 2]) == fixed
    # long-tailed: a step reads only the caches of the sequences still running
    seconds = (2 * weights + 2 * 5 * kv_per_token + 1 * 6 * kv_per_token) / 1e9  # weights at both steps
    assert abs(bandwidth_bound_tokens_per_s(model, 2, 5, 2, 1e9, [1, 2]) - 3 / seconds) < 1e-6


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


def test_long_tailed_lengths_are_seeded_within_the_cap_and_have_the_requested_mean():
    from rlscale.bench.gen import draw_lengths, length_summary

    # recorded once for seed 2 (the benchmark's): the same lengths for every variant, rep and run
    assert draw_lengths("geometric", 8, 8, 32) == [19, 1, 10, 6, 19, 6, 1, 3]
    assert draw_lengths("lognormal", 8, 8, 32) == [7, 4, 4, 1, 14, 3, 9, 8]
    assert draw_lengths("fixed", 3, 8, 32) == [32, 32, 32]
    assert draw_lengths("geometric", 5, 1, 10) == [1] * 5  # mean 1: p = 1
    for kind in ("geometric", "lognormal"):
        far = draw_lengths(kind, 20000, 20, 10**6)  # a cap that clips (almost) nothing: the mean is the mean
        assert abs(sum(far) / len(far) - 20) < 0.6 and min(far) >= 1
        capped = draw_lengths(kind, 64, 16, 32)
        assert min(capped) >= 1 and max(capped) == 32
        summary = length_summary(kind, 16, 32, capped)
        assert summary["drawn"]["at_cap_fraction"] == capped.count(32) / 64
        assert summary["drawn"]["mean"] < 16  # clipping at the cap lowers it
    assert length_summary("lognormal", 16, 32, [1, 2])["mu"] == math.log(16) - 0.5


def tiny_prompts(batch: int, tokens: int):
    torch.set_num_threads(1)
    model = build_model("tiny", torch.device("cpu"), torch.float32)
    return model, torch.randint(2, 512, (batch, tokens), generator=torch.Generator().manual_seed(1))


def test_hf_generate_ends_each_row_with_eos_exactly_at_its_drawn_length():
    from rlscale.bench.gen import _hf_generate, hf_response_lengths

    model, prompts = tiny_prompts(6, 5)
    lengths = [9, 1, 5, 3, 12, 3]
    out = _hf_generate(model, prompts, 12, static=False, lengths=lengths)()
    assert hf_response_lengths(out, 5) == lengths
    response = out[:, 5:]
    for row, n in zip(response.tolist(), lengths):
        assert row[n - 1] == 1 and 1 not in row[:n - 1] and set(row[n:]) <= {0}  # EOS there only, pad after
    assert out.shape[1] == 5 + 12  # generate stopped when the longest row ended


def test_engine_variants_end_each_row_at_its_drawn_length_and_waves_follow_the_kv_budget():
    from rlscale.bench.gen import _engine_generate

    model, prompts = tiny_prompts(6, 5)
    lengths = [9, 1, 5, 3, 12, 3]
    for shrink in (True, False):
        call = _engine_generate(model, prompts, 12, lengths=lengths, shrink_batch=shrink)
        out = call()
        assert [len(t) for t in out.tokens] == lengths and call.last is out
        assert (max(out.decode_batches) == 6) != shrink  # the first step runs without the length-1 row
        assert out.decode_batches[-1] == (1 if shrink else 6)
    call = _engine_generate(model, prompts, 12, lengths=lengths)
    call.engine.kv_budget_bytes = 3 * call.engine.slot_bytes(64)  # three sequences at a time
    out = call()
    assert [len(t) for t in out.tokens] == lengths and out.waves > 1 and max(out.decode_batches) <= 3


def test_bench_gen_long_tailed_reports_useful_tokens_and_the_full_batch_ratio(tmp_path, monkeypatch):
    import rlscale.bench.gen as gen

    # the compiled variants' options without compile (CPU): the same code paths, quickly
    monkeypatch.setitem(gen.ENGINE_VARIANTS, "engine_compiled", {})
    monkeypatch.setitem(gen.ENGINE_VARIANTS, "engine_full_batch", {"shrink_batch": False})
    out = tmp_path / "gen.json"
    bench_gen_tiny(["engine_compiled", "engine_full_batch", "hf_dynamic"], 8, "--batch", "4", "--json", str(out),
                   "--lengths", "geometric", "--mean-tokens", "3", "--gpu-memory-utilization", "0.5")
    data = json.loads(out.read_text())
    lengths = data["lengths"]
    assert {k: lengths[k] for k in ("distribution", "mean_tokens", "cap", "p")} == {
        "distribution": "geometric", "mean_tokens": 3.0, "cap": 8, "p": 1 / 3}
    assert set(lengths["drawn"]) == {"mean", "median", "p90", "max", "at_cap_fraction"}
    assert data["gpu_memory_utilization"] is None  # CPU: ignored
    total = sum(gen.draw_lengths("geometric", 4, 3.0, 8))
    entry = data["models"]["tiny"]
    for name, r in entry["results"].items():
        assert r["useful_tokens_per_s"] == total / r["median_s"] and "tokens_per_s" not in r
        assert ("waves" in r) == name.startswith("engine")
    assert entry["engine_over_full_batch"] == (entry["results"]["engine_compiled"]["useful_tokens_per_s"]
                                               / entry["results"]["engine_full_batch"]["useful_tokens_per_s"])
    assert "useful tok/s" in gen.format_table(data) and "engine_compiled / engine_full_batch" in gen.format_table(data)


def test_bench_gen_groups_repeat_each_prompt_and_compare_the_shared_prefill(tmp_path):
    out = tmp_path / "gen.json"
    bench_gen_tiny(["engine_compiled", "engine_unshared"], 8, "--batch", "8", "--group", "4", "--json", str(out))
    written = json.loads(out.read_text())
    entry = written["models"]["tiny"]
    assert written["group"] == 4 and set(entry["results"]) == {"engine_compiled", "engine_unshared"}
    assert entry["shared_over_unshared"] == (entry["results"]["engine_compiled"]["tokens_per_s"]
                                             / entry["results"]["engine_unshared"]["tokens_per_s"])
    refused = CliRunner().invoke(app, ["bench", "gen", "--model", "tiny", "--batch", "6", "--group", "4"])
    assert isinstance(refused.exception, UserError) and str(refused.exception) == "--group 4 does not divide --batch 6"
