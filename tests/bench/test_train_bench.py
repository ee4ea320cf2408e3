"""`rlscale bench train`: the FLOP count, the peak table, and a CPU smoke run of the benchmark."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.bench import train as bench_train
from rlscale.bench.scale import QWEN2_SHAPES
from rlscale.bench.train import layer_params, peak_tflops, run_benchmark, update_flops


@pytest.mark.parametrize("name", ["tiny", "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"])
def test_parameter_count_matches_the_model(name):
    shape = {"tie_word_embeddings": True, **QWEN2_SHAPES[name]}
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    assert bench_train._count_params(shape) == sum(p.numel() for p in model.parameters())
    matmuls = sum(p.numel() for n, p in model.named_parameters() if "layers." in n and n.endswith("proj.weight"))
    assert layer_params(shape) == matmuls


def test_update_flops_by_hand():
    shape = dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=10)
    # per layer: q 4*4, o 4*4, k+v 2*4*2, mlp 3*4*8 = 144 matmul parameters
    assert layer_params(shape) == 144
    # 2 documents (3 and 5 tokens), 4 response tokens: 6*(144*8 + 10*4*4) + 6*1*2*2*(9+25)
    assert update_flops(shape, [3, 5], 4) == 6 * (144 * 8 + 160) + 24 * 34


def test_peak_table():
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("some cpu") is None


def test_cpu_smoke_run_writes_json(tmp_path):
    torch.set_num_threads(1)
    out_file = tmp_path / "bench.json"
    out = run_benchmark(["tiny"], ["hf_sdpa", "rlscale"], [(4, 24)], prompt_len=8, micro_tokens=48, hf_micro=2,
                        warmup=1, reps=1, ragged=True, device_name="cpu", json_file=out_file, echo=lambda _: None)
    assert json.loads(out_file.read_text()) == out
    rows = {r["variant"]: r for r in out["results"]}
    assert set(rows) == {"hf_sdpa", "rlscale"} and not any("error" in r for r in rows.values())
    assert rows["rlscale"]["tokens"] == rows["hf_sdpa"]["tokens"] < rows["rlscale"]["padded_tokens"]
    assert rows["rlscale"]["max_abs_logprob_diff_vs_hf"] < 1e-4  # packed equals padded, float32
    assert rows["rlscale"]["tokens_per_s"] > 0 and rows["rlscale"]["mfu"] is None  # no peak known for a CPU
    assert out["torch"] == torch.__version__ and "flops_formula" in out


def test_a_failing_variant_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (pretend)")

    monkeypatch.setattr(bench_train, "run_hf", broken)
    out_file = tmp_path / "bench.json"
    run_benchmark(["tiny"], ["hf_sdpa", "rlscale"], [(2, 16)], prompt_len=4, micro_tokens=32, hf_micro=2,
                  warmup=1, reps=1, ragged=False, device_name="cpu", json_file=out_file, echo=lambda _: None)
    rows = json.loads(out_file.read_text())["results"]
    assert "out of memory" in rows[0]["error"] and "tokens_per_s" in rows[1]
