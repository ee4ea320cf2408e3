"""The memory plan: model shapes, per-phase bytes, the settings it picks and the runs it refuses.

Expected figures are worked out here by hand from the formulas in rlscale/memory_plan.py (each
written out below), not read back from the planner; the calibrated H200 table comes later. The
one exception, test_update_agrees_with_recorded_h200_peaks, compares with peaks already measured.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlscale import memory_plan as mp
from rlscale.config_loading import load_config
from tests.integration.helpers import SEED_OVERRIDES

GB = 1e9
H200 = 150_754_820_096  # torch.cuda.get_device_properties(0).total_memory of an H200
# `rlscale bench step`'s GRPO step: 32 prompts × 8 samples, 256 new tokens, sequences of 1024, no validation
BENCH = ["grpo.num_prompts_per_step=32", "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=256",
         "policy.generation.max_new_tokens=256", "policy.max_total_sequence_length=1024", "grpo.val_at_start=false",
         "grpo.val_at_end=false", "grpo.val_period=0", "loss.reference_policy_kl_penalty=0"]
# the seed's job as NeMo-RL's 70B recipe runs it: sequences of 4096, on B200s (180 GB each)
SEED_72B = [*SEED_OVERRIDES, "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=3584",
            "cluster.gpu_memory_gb=180"]


def usable(budget: float) -> float:
    return budget * 0.97 - 2e9  # the reserve: 2 GB and 3% of the device


def qwen2_params(h, layers, heads, kv, i, vocab, tied) -> int:
    """Qwen2 by hand: q/k/v with bias, o without; gate/up/down; two norms a layer; embedding, final
    norm, and the LM head when untied."""
    d = h // heads
    layer = h * (heads * d + 2 * kv * d) + (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i + 2 * h
    return layers * layer + vocab * h * (1 if tied else 2) + h


def plan(overrides, budget, shape=None):
    cfg = load_config(None, overrides)
    return cfg, mp.plan_memory(cfg, shape or mp.load_shape(cfg.policy.model_name), budget)


def phase(plan_, name):
    return next(ph for ph in plan_.phases if ph.name == name)


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_a_transformers_qwen2(tied):
    config = Qwen2Config(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    shape = mp.ModelShape.from_config(config.to_dict())
    assert shape.parameter_count() == sum(p.numel() for p in model.parameters())
    assert shape.parameter_count() == qwen2_params(64, 3, 4, 2, 176, 300, tied)


def test_parameter_count_matches_llama_and_qwen3_variants():
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, vocab_size=128, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config)
    assert mp.ModelShape.from_config(config.to_dict()).parameter_count() == sum(p.numel() for p in model.parameters())
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=24, vocab_size=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    assert mp.ModelShape.from_config(config.to_dict()).parameter_count() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, expected", [
    ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768), ("Qwen/Qwen2.5-1.5B", 1_543_714_304),
    ("Qwen/Qwen2.5-3B-Instruct", 3_085_938_688), ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),
    ("Qwen/Qwen2.5-14B", 14_770_033_664), ("Qwen/Qwen2.5-32B-Instruct", 32_763_876_352),
    ("Qwen/Qwen2.5-72B-Instruct", 72_706_203_648), ("Qwen/Qwen2-7B", 7_615_616_512),
])
def test_known_shapes_have_the_published_parameter_counts(name, expected, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    assert mp.load_shape(name).parameter_count() == expected


def test_load_shape_reads_builtin_local_and_cached_configs(tmp_path, monkeypatch):
    import huggingface_hub

    tiny = mp.load_shape("builtin:tiny-arith")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size, tiny.tie_word_embeddings) == (128, 4, 99, True)
    config = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 50}
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps(config))
    assert mp.load_shape(str(tmp_path / "local")).intermediate_size == 64
    # a hub id in the HF cache: models--ORG--NAME/snapshots/REV/config.json, refs/main -> REV
    cache = tmp_path / "hub"
    repo = cache / "models--someone--small"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert mp.load_shape("someone/small").intermediate_size == 96
    assert mp.load_shape("someone/not-cached") is None
    assert mp.load_shape("builtin:no-such-model") is None


def test_unknown_shape_gives_one_line_and_does_not_block():
    cfg = load_config(None, ["cluster.gpu_memory_gb=80"])
    plan_ = mp.plan_memory(cfg, None, 80 * 10**9)
    assert len(plan_.lines()) == 1 and "no figures" in plan_.lines()[0]
    assert plan_.refusal() is None and plan_.apply(cfg) is cfg


# ---------------------------------------------------------------- the seed's 72B job


def test_seed_72b_job_is_refused_naming_the_whole_model_floor():
    # with the policy kept gathered (the user's policy.keep_gathered=true), the weight sync gathers it whole
    cfg, plan_ = plan([*SEED_72B, "policy.keep_gathered=true"], None)
    assert mp.budget_bytes(cfg) == 180 * 10**9
    cfg, plan_ = plan([*SEED_72B, "policy.keep_gathered=true"], mp.budget_bytes(cfg))
    p = qwen2_params(8192, 80, 64, 8, 29568, 152064, False)  # 72.7e9
    # the rollout engine's bf16 copy and the gathered bf16 policy: 2 × 2 bytes a parameter, at any GPU count
    floor = 2 * 2 * p
    assert f"{floor / GB:.1f}" == "290.8"
    line = plan_.refusal()
    # the hint: the smallest tensor-parallel size that fits, with the setting of the user's to change
    # (T = 2 by hand: test_seed_72b_job_at_t1_streams_its_sync_and_is_told_the_tensor_parallel_size)
    assert line == (f"memory plan: the logprobs phase needs {plan_.peak.total / GB:.1f} GB per GPU, more than the "
                    f"{usable(180e9) / GB:.1f} GB usable of 180.0 GB: the rollout engine's whole bf16 copy and the "
                    f"gathered policy alone take 290.8 GB per GPU at any GPU count: it fits with "
                    "policy.generation.tensor_parallel_size=2, policy.keep_gathered=false, peak 167.3 GB")
    # kept gathered, the reference's pass holds the engine copy, the gathered policy and the gathered
    # reference: 3 × 2 bytes a parameter
    assert plan_.peak.total > 3 * 2 * p > floor and plan_.settings.keep_gathered
    assert not plan_.fits and plan_.picks == ()

    # its weight sync, by hand, under the least-memory settings left (bf16_stochastic, reference sharded)
    sync = phase(plan_, "weight sync")
    layer = qwen2_params(8192, 1, 64, 8, 29568, 0, True) - 8192  # one decoder layer
    unit = max(6 * layer, 2 * 152064 * 8192 + 8192)  # 6 layers per FSDP2 unit, or the root
    expected = (2 * p  # gathered policy, bf16
                + (2 + 8) * p / 64  # bf16 weights, fp32 moments: sharded over 64 (gradients freed after each step)
                + 2 * p / 64  # the reference, sharded
                + 2 * p  # the rollout engine's copy
                + 8 * 4096 * 2 * 80 * 8 * 128 * 2  # KV cache: 8 slots (4 samples → bucket 8) × 4096, bf16
                + 8 * (152064 * 16 + 3584 * 12)  # decode buffers: logits, sampling, tokens and logprobs
                + unit * 2 * (1 + 1 / 64))  # one unit's all-gather output and input
    assert sync.total == pytest.approx(expected, rel=1e-12)


def test_seed_72b_job_without_the_reference_peaks_in_the_update():
    cfg, plan_ = plan([*SEED_72B, "loss.reference_policy_kl_penalty=0", "policy.keep_gathered=true"], 180 * 10**9)
    assert [ph.name for ph in plan_.phases] == ["weight sync", "generation", "update", "optimizer step"]
    assert plan_.refusal().startswith(f"memory plan: the {plan_.peak.name} phase needs ")
    assert "290.8 GB per GPU at any GPU count" in plan_.refusal()


def test_seed_72b_job_at_t1_streams_its_sync_and_is_told_the_tensor_parallel_size():
    """Left to the plan, keep_gathered=false syncs one FSDP2 unit at a time: no gathered policy. At
    T = 1 each GPU's whole engine copy (145.4 GB) still leaves too little; T = 2 fits."""
    cfg, plan_ = plan(SEED_72B, 180 * 10**9)
    p = qwen2_params(8192, 80, 64, 8, 29568, 152064, False)
    assert not plan_.fits and not plan_.settings.keep_gathered and plan_.settings.shard_reference
    assert plan_.settings.master_weights == "bf16_stochastic"
    assert plan_.refusal() == (f"memory plan: the update phase needs {plan_.peak.total / GB:.1f} GB per GPU, more "
                               f"than the {usable(180e9) / GB:.1f} GB usable of 180.0 GB: it fits with "
                               "policy.generation.tensor_parallel_size=2, peak 167.3 GB")
    sync = phase(plan_, "weight sync")
    layer = qwen2_params(8192, 1, 64, 8, 29568, 0, True) - 8192  # one decoder layer
    root = 2 * 152064 * 8192 + 8192  # embedding, LM head, final norm: FSDP2's root unit
    expected = ((2 + 8) * p / 64  # bf16 weights, fp32 moments: sharded over 64
                + 2 * p / 64  # the reference, sharded
                + 2 * p  # the rollout engine's whole copy (T = 1)
                + 8 * 4096 * 2 * 80 * 8 * 128 * 2  # KV cache: 8 slots (4 samples → bucket 8) × 4096, bf16
                + 8 * (152064 * 16 + 3584 * 12)  # decode buffers
                + 2 * root  # the root unit, gathered for the whole sync
                + 6 * layer * 2 * (1 + 1 / 64))  # one unit of 6 layers in flight: all-gather output and input
    assert sync.total == pytest.approx(expected, rel=1e-12)
    assert sync.components["training weights"] == 0  # no gathered policy
    # the reference's pass gathers it one unit at a time too: the sharded copy, no whole one
    assert phase(plan_, "logprobs").components["reference"] == pytest.approx(2 * p / 64, rel=1e-12)


# ---------------------------------------------------------------- tensor-parallel generation


def test_seed_72b_job_fits_on_b200s_at_tensor_parallel_size_8():
    """The reference job (NeMo-RL's 70B recipe on 8 × 8 B200): at T = 8 each GPU holds 1/8 of the
    engine, the KV cache of one of the 8 kv heads for its group's 32 samples, and the sync
    streams the policy one unit at a time. Every component worked out by hand below."""
    cfg, plan_ = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8"], 180 * 10**9)
    assert plan_.fits and plan_.refusal() is None and plan_.tensor_parallel_size == 8
    assert {k.key: k.value for k in plan_.picks} == {"master_weights": "fp32", "shard_reference": True,
                                                     "activation_checkpointing": True, "keep_gathered": False}
    p = qwen2_params(8192, 80, 64, 8, 29568, 152064, False)  # 72,706,203,648
    layer = qwen2_params(8192, 1, 64, 8, 29568, 0, True) - 8192  # 877,684,736
    root = 2 * 152064 * 8192 + 8192
    unit = 6 * layer  # 5.27e9 > the root's 2.49e9
    # one rank of the engine: q 8 heads of 128, k and v one kv head (8 / 8), o; the MLP's 29568 / 8;
    # both norms whole; the embedding and the LM head 152064 / 8 rows each, the final norm whole
    engine_layer = 8192 * (1024 + 2 * 128) + 1024 * 8192 + (1024 + 2 * 128) + 3 * 8192 * 3696 + 2 * 8192
    engine = 2 * (80 * engine_layer + 2 * 19008 * 8192 + 8192)
    assert engine / GB == pytest.approx(2 * p / 8 / GB, abs=0.01)  # 18.2 GB: 72.71B × 2 bytes / 8, norms whole
    base = {"master weights": 4 * p / 64,  # fp32, sharded over 64: 4.5
            "moments": 8 * p / 64,  # 9.1
            "reference": 2 * p / 64,  # bf16, sharded: 2.3
            "rollout-engine weights": engine,  # 18.2
            # the group generates its 8 ranks' 8 × 4 samples: 32 slots × 4096, one kv head of 128: 5.4
            "KV cache": 32 * 4096 * 2 * 80 * 1 * 128 * 2,
            "decode buffers": 32 * (152064 * 16 + 3584 * 12)}  # full-vocabulary logits per slot: 0.08
    tokens = 4 * 4096  # 4 samples a GPU: one micro-batch of 16384 tokens
    outside = tokens * 12 * 8192
    by_hand = {
        # the root unit gathered (5.0) and one unit of 6 layers in flight, output and input (10.7)
        "weight sync": 2 * root + unit * 2 * (1 + 1 / 64),
        # prefill of 16384 tokens: residual and norms (12 × 8192), the rank's MLP (8 × 29568 / 8)
        "generation": 16384 * (12 * 8192 + 8 * 3696),
        # the reference's pass one unit at a time: a unit's gather, one layer's forward, a logits chunk
        # (eager under fp32 master weights, policy.compile's default: LOGITS_BYTES_EAGER, 16 bytes an element: 5.0)
        "logprobs": unit * 2 * (1 + 1 / 64) + tokens * (12 * 8192 + 8 * 29568) + outside + 2048 * 152064 * 16,
        # a unit's bf16 gradients twice (21.1), its fp32 reduce-scatter (21.4), checkpointed activations
        # (80 layers' bf16 inputs and two eager layers' saved tensors, SAVED_EAGER: 35.3), an eager logits
        # chunk (5.0), the head's gradient (12.5)
        "update": 2 * unit * 2 + unit * 4 * (1 + 1 / 64)
        + tokens * (80 * 2 * 8192 + 2 * (12 * 8192 + 4 * 8192 + 4 * 1024 + 8 * 29568)) + outside
        + 2048 * 152064 * 16 + 152064 * 8192 * (2 * 4 + 2),
        "optimizer step": 4 * p / 64,  # the fp32 gradients, resharded (fused AdamW: no temporaries)
    }
    totals = {name: (sum(base.values()) + extra) / GB for name, extra in by_hand.items()}
    assert {ph.name: ph.total / GB for ph in plan_.phases} == pytest.approx(totals, rel=1e-9)
    # the planner's totals, GB per GPU
    assert totals == pytest.approx({"weight sync": 55.2, "generation": 41.6, "logprobs": 62.3, "update": 134.7,
                                    "optimizer step": 44.1}, abs=0.1)
    assert usable(180e9) / GB == pytest.approx(172.6, abs=0.1)
    line = next(line for line in plan_.lines() if "tensor-parallel" in line)
    assert line.strip() == ("rollout engine tensor-parallel over 8 GPUs: each holds 1/8 of its weights, the KV "
                            "cache of 1 of 8 kv heads for its group's samples")
    assert plan_.as_dict()["tensor_parallel_size"] == 8


def test_seed_72b_job_with_lora_shards_the_frozen_base_and_holds_no_reference():
    """The same job with rank-64 LoRA on every linear layer of the blocks: FSDP2 shards the frozen
    bf16 base over the 64 workers (no MixedPrecisionPolicy: the layers compile), the fp32 adapters,
    their gradients and moments; the base with its adapters off is the reference (no copy), and the
    frozen LM head has no weight gradient. Every component worked out by hand below."""
    lora = ["policy.lora.enabled=true", "policy.lora.rank=64"]
    cfg, plan_ = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8", *lora], 180 * 10**9)
    assert plan_.fits and plan_.refusal() is None and plan_.tensor_parallel_size == 8
    # fp32 adapters are no choice (no master_weights pick); no reference to shard: the base is it
    assert {k.key: k.value for k in plan_.picks} == {"activation_checkpointing": True, "keep_gathered": False}
    assert "LoRA rank 64, frozen base, adapters fp32" in plan_.notes[0]
    assert "reference the base (adapters off)" in plan_.notes[0]
    p = qwen2_params(8192, 80, 64, 8, 29568, 152064, False)  # 72,706,203,648
    layer = qwen2_params(8192, 1, 64, 8, 29568, 0, True) - 8192  # 877,684,736
    root = 2 * 152064 * 8192 + 8192
    unit = 6 * layer  # 5.27e9 > the root's 2.49e9
    # A (64 × in) and B (out × 64) per projection: q and o 8192 + 8192, k and v 8192 + 1024 (8 kv heads
    # of 128), gate, up and down 8192 + 29568
    adapters = 80 * 64 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 29568))  # 842,137,600
    assert adapters == plan_.shape.lora_parameters(64, mp.LORA_LINEAR_MODULES)
    engine_layer = 8192 * (1024 + 2 * 128) + 1024 * 8192 + (1024 + 2 * 128) + 3 * 8192 * 3696 + 2 * 8192
    engine = 2 * (80 * engine_layer + 2 * 19008 * 8192 + 8192)  # one rank's 1/8 of the engine: 18.2
    base = {"training weights": 2 * p / 64,  # the frozen bf16 base, sharded over 64: 2.3
            "master weights": 4 * adapters / 64,  # the fp32 adapters, sharded: 0.05
            "moments": 8 * adapters / 64,  # 0.1
            # no reference: the base with its adapters off
            "rollout-engine weights": engine,
            "KV cache": 32 * 4096 * 2 * 80 * 1 * 128 * 2,  # 32 slots × 4096, one kv head of 128: 5.4
            "decode buffers": 32 * (152064 * 16 + 3584 * 12)}  # 0.08
    tokens = 4 * 4096  # 4 samples a GPU: one micro-batch of 16384 tokens
    outside = tokens * 12 * 8192
    gather = unit * 2 * (1 + 1 / 64)  # one unit of the bf16 base in flight, output and input: 10.7
    # the compiled logits chunk (no FSDP2 casts under LoRA: policy.compile's default is on), 4 bytes an element: 1.2
    logits = 2048 * 152064 * 4
    by_hand = {
        # streamed as without LoRA: the root unit gathered (5.0) and one unit of 6 layers in flight (10.7)
        "weight sync": 2 * root + gather,
        "generation": 16384 * (12 * 8192 + 8 * 3696),  # prefill, the rank's MLP (29568 / 8): 2.1
        # the reference's pass is the sharded base's, gathered one unit at a time as the update's
        "logprobs": gather + tokens * (12 * 8192 + 8 * 29568) + outside + logits,
        # the whole step's fp32 adapter gradients, unsharded (3.4); a unit's (6 of 80 layers) reduce-scattered
        # in fp32 (0.26) beside the base's unit in flight (10.7); checkpointed activations (80 layers' bf16
        # inputs and two compiled layers' saved tensors, SAVED_COMPILED: 31.7); the logits chunk; no head gradient
        "update": 4 * adapters + adapters * 6 / 80 * 4 * (1 + 1 / 64) + gather
        + tokens * (80 * 2 * 8192 + 2 * (6 * 8192 + 4 * 8192 + 4 * 1024 + 6 * 29568)) + outside + logits,
        "optimizer step": 4 * adapters / 64,  # the fp32 adapter gradients, resharded (fused AdamW: no temporaries)
    }
    totals = {name: (sum(base.values()) + extra) / GB for name, extra in by_hand.items()}
    assert {ph.name: ph.total / GB for ph in plan_.phases} == pytest.approx(totals, rel=1e-9)
    assert phase(plan_, "update").components["head gradient"] == 0
    assert all(ph.components["reference"] == 0 for ph in plan_.phases)
    # the planner's totals, GB per GPU
    assert totals == pytest.approx({"weight sync": 41.7, "generation": 28.2, "logprobs": 45.1, "update": 73.3,
                                    "optimizer step": 26.1}, abs=0.1)
    # every phase below the same job's full training (55.2, 41.6, 62.3, 134.7, 44.1)
    _, full = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8"], 180 * 10**9)
    assert [ph.name for ph in full.phases] == [ph.name for ph in plan_.phases]
    assert all(ph.total < phase(full, ph.name).total for ph in plan_.phases)
    # a save holds the fp32 adapters and their two moments alone: 1.26 GB a node, 0.63 s at 2 GB/s,
    # within the 15 s spot grace (the whole model's fp32 state: 109.1 GB, 54.5 s)
    save = plan_.save
    assert (save.weights_bytes, save.moments_bytes) == (-(-4 * adapters // 8), 8 * adapters // 8)
    assert save.node_bytes == 12 * adapters // 8 + 8 * 65536 == 1_263_730_688
    assert save.fits_grace and save.write_s == pytest.approx(0.632, abs=0.001)


# NeMo-RL's recipe on one node of 8 H200s (141 GB) with the 32B: sequences of 1024 (its 512 prompt
# tokens, 512 new), 32 prompts × 8 samples, the KL penalty on
SEED_32B = [*SEED_OVERRIDES, "policy.model_name=Qwen/Qwen2.5-32B-Instruct", "cluster.num_nodes=1",
            "cluster.gpu_memory_gb=141", "policy.max_total_sequence_length=1024",
            "policy.generation.max_new_tokens=512"]


def test_32b_on_8_h200s_fits_at_tensor_parallel_size_4():
    for size in (1, 2):  # the whole engine copy (65.5 GB), or half of it (32.8), does not leave enough
        cfg, refused = plan([*SEED_32B, f"policy.generation.tensor_parallel_size={size}"], 141 * 10**9)
        assert refused.refusal().endswith(": it fits with policy.generation.tensor_parallel_size=4, peak 131.2 GB")
    cfg, plan_ = plan([*SEED_32B, "policy.generation.tensor_parallel_size=4"], 141 * 10**9)
    assert plan_.fits and {k.key: k.value for k in plan_.picks} == {
        "master_weights": "bf16_stochastic", "train_micro_batch_tokens": 8192, "shard_reference": True,
        "activation_checkpointing": True, "keep_gathered": False}
    p = qwen2_params(5120, 64, 40, 8, 27648, 152064, False)  # 32,763,876,352
    layer = qwen2_params(5120, 1, 40, 8, 27648, 0, True) - 5120  # 487,605,248
    unit, root = 6 * layer, 2 * 152064 * 5120 + 5120
    # one rank: 10 of 40 heads, 2 of 8 kv heads, 27648 / 4 of the MLP, 152064 / 4 rows of embedding and head
    engine_layer = 5120 * (1280 + 2 * 256) + 1280 * 5120 + (1280 + 2 * 256) + 3 * 5120 * 6912 + 2 * 5120
    engine = 2 * (64 * engine_layer + 2 * 38016 * 5120 + 5120)  # 16.4 GB = 32.76B × 2 bytes / 4
    base = (2 * p / 8 + 8 * p / 8  # bf16 weights (stochastic rounding), fp32 moments, sharded over 8: 8.2 + 32.8
            + 2 * p / 8  # the reference, sharded: 8.2
            + engine
            + 128 * 1024 * 2 * 64 * 256 * 2  # a group of 4 ranks' 128 samples × 1024, 2 kv heads: 8.6
            + 128 * (152064 * 16 + 512 * 12))  # full-vocabulary decode buffers: 0.3
    tokens = 8192  # 32 samples a GPU in 4 micro-batches of 8192 tokens (a quarter of the derived 32768)
    outside = tokens * 12 * 5120
    by_hand = {
        "weight sync": 2 * root + unit * 2 * (1 + 1 / 8),  # the root (3.1) and one unit in flight (6.6)
        "generation": 16384 * (12 * 5120 + 8 * 6912),  # prefill, the MLP split over 4: 1.9
        # a logits chunk: eager under stochastic rounding (policy.compile's default), 16 bytes an element: 5.0
        "logprobs": unit * 2 * (1 + 1 / 8) + tokens * (12 * 5120 + 8 * 27648) + outside + 2048 * 152064 * 16,
        # earlier micro-batches' sharded bf16 gradients (8.2), a unit's twice (11.7), its fp32 reduce (13.2),
        # checkpointed activations (two eager layers' saved tensors, SAVED_EAGER: 10.9), an eager logits
        # chunk (5.0), the head's gradient (7.8)
        "update": 2 * p / 8 + 2 * unit * 2 + unit * 4 * (1 + 1 / 8)
        + tokens * (64 * 2 * 5120 + 2 * (12 * 5120 + 4 * 5120 + 4 * 1024 + 8 * 27648)) + outside
        + 2048 * 152064 * 16 + 152064 * 5120 * (2 * 4 + 2),
        # the bf16 gradients resharded, StochasticRoundingAdamW's 24 bytes over the largest parameter's shard
        "optimizer step": 2 * p / 8 + 152064 * 5120 / 8 * 24,
    }
    totals = {name: (base + extra) / GB for name, extra in by_hand.items()}
    assert {ph.name: ph.total / GB for ph in plan_.phases} == pytest.approx(totals, rel=1e-9)
    assert totals == pytest.approx({"weight sync": 84.1, "generation": 76.3, "logprobs": 88.8, "update": 131.2,
                                    "optimizer step": 85.0}, abs=0.1)


def test_32b_on_8_h200s_at_sequences_of_4096_fits_at_no_tensor_parallel_size():
    # 32 samples × 4096 a GPU: a KV cache of 34.4 GB at every T (T × the slots, 1/T of the kv heads)
    # and the update's activations (eager under stochastic rounding); the hint skips T (none fits) and
    # asks for more GPUs: 32 from T = 2 on (128 at T = 1, where each GPU holds the whole engine copy)
    overrides = [*SEED_32B, "policy.max_total_sequence_length=4096", "policy.generation.max_new_tokens=3584"]
    for size in (1, 2, 4, 8):
        cfg, plan_ = plan([*overrides, f"policy.generation.tensor_parallel_size={size}"], 141 * 10**9)
        assert not plan_.fits and plan_.hint == (f"it fits on {128 if size == 1 else 32} GPUs "
                                                 "(cluster.num_nodes × cluster.gpus_per_node, now 8)")
        assert phase(plan_, "generation").components["KV cache"] == 256 // (8 // size) * 4096 * 2 * 64 * (
            8 // size) * 128 * 2
    assert plan_.peak.name == "update" and plan_.peak.total / GB == pytest.approx(181.8, abs=0.1)


def test_tensor_parallel_shard_of_a_shape():
    shape = mp.load_shape("Qwen/Qwen2.5-72B-Instruct")
    assert shape.tensor_parallel_shard(1) is shape
    eighth = shape.tensor_parallel_shard(8)
    assert (eighth.num_attention_heads, eighth.num_key_value_heads, eighth.intermediate_size, eighth.vocab_size,
            eighth.hidden_size, eighth.head_dim) == (8, 1, 3696, 19008, 8192, 128)
    # past the kv heads, each rank keeps one of them (replicated): 1.5B's 2 kv heads over 4
    small = mp.load_shape("Qwen/Qwen2.5-1.5B").tensor_parallel_shard(4)
    assert (small.num_attention_heads, small.num_key_value_heads, small.vocab_size) == (3, 1, 37984)
    assert mp.load_shape("Qwen/Qwen2.5-7B").tensor_parallel_problem(8) == (
        "policy.generation.tensor_parallel_size=8 must divide the attention heads of the model "
        "(num_attention_heads=28)")
    assert shape.tensor_parallel_problem(8) is None


def test_a_user_who_keeps_the_policy_gathered_is_told_to_stream_it():
    cfg, plan_ = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8", "policy.keep_gathered=true"],
                      180 * 10**9)
    assert not plan_.fits and plan_.hint == "it fits with policy.keep_gathered=false, peak 134.7 GB"
    # gathered, the sync holds the whole bf16 policy (145.4 GB) beside the engine's eighth
    assert phase(plan_, "weight sync").components["training weights"] / GB == pytest.approx(145.4, abs=0.1)


# ---------------------------------------------------------------- picks


def test_a_1_5b_fits_one_h200_with_fp32_master_and_no_checkpointing():
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-1.5B-Instruct"], H200)
    assert plan_.fits and {p.key: p.value for p in plan_.picks} == {
        "master_weights": "fp32", "activation_checkpointing": False, "keep_gathered": True}
    h, layers, heads, kv_heads, i, vocab = 1536, 28, 12, 2, 8960, 151936
    p = qwen2_params(h, layers, heads, kv_heads, i, vocab, True)
    layer = qwen2_params(h, 1, heads, kv_heads, i, 0, True) - h
    unit = max(6 * layer, vocab * h + h)
    tokens = 32 * 1024  # 256 samples, micro-batches of 32 × 1024 tokens: 8 of them
    # fp32 master weights at one worker kept gathered: a bf16 compute copy (no FSDP2 hooks), so
    # policy.compile's default compiles the layers
    saved = 6 * h + 4 * h + 4 * 256 + 6 * i  # SAVED_COMPILED per token and layer (kv width 2 × 128)
    expected_update = (
        2 * p + 4 * p + 8 * p  # the bf16 compute copy, fp32 master weights, fp32 moments
        + 4 * p  # fp32 gradients accumulated over the micro-batches
        + 2 * p  # the engine's copy
        + 256 * 1024 * 2 * layers * 256 * 2 + 256 * (vocab * 16 + 256 * 12)  # KV cache, decode buffers
        + tokens * (layers + 1) * saved + tokens * 12 * h  # saved activations, the layers outside
        + 2048 * vocab * 4  # one compiled logits chunk (LOGITS_BYTES_COMPILED)
        + vocab * h * (2 * 4 + 2))  # the head's fp32 gradient accumulators and its bf16 gradient
    assert plan_.peak.name == "update" and plan_.peak.total == pytest.approx(expected_update, rel=1e-12)
    assert plan_.apply(cfg).policy.master_weights == "fp32"
    assert plan_.apply(cfg).policy.activation_checkpointing is False
    assert plan_.apply(cfg).policy.train_micro_batch_tokens is None  # the derived budget is kept


def test_a_3b_needs_activation_checkpointing_on_one_h200():
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-3B-Instruct"], H200)
    picks = {p.key: p for p in plan_.picks}
    assert plan_.fits and picks["master_weights"].value == "fp32" and picks["activation_checkpointing"].value is True
    # without checkpointing: 36 + 1 layers × 32768 tokens × SAVED_EAGER (fp32 master: eager layers by
    # default), beside the update's fp32 master weights and moments, the gathered policy, the engine copy
    # and the fp32 gradient accumulation (4 + 8 + 2 + 2 + 4 bytes a parameter), exceed what is usable
    saved = 12 * 2048 + 4 * 2048 + 4 * 256 + 8 * 11008
    assert 37 * 32768 * saved + 20 * 3_085_938_688 > usable(H200)
    assert picks["activation_checkpointing"].why.startswith("with false the update needs ")
    applied = plan_.apply(cfg)
    assert applied.policy.activation_checkpointing is True and applied.policy.master_weights == "fp32"


def test_a_3b_on_one_80gb_gpu_takes_stochastic_rounding_before_tiny_micro_batches():
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-3B-Instruct", "cluster.gpu_memory_gb=80"], 80 * 10**9)
    picks = {p.key: p.value for p in plan_.picks}
    # stochastic rounding at one worker is a plain bf16 model (compiled layers, nothing to gather):
    # checkpointed, the micro-batches keep their derived 32768 tokens
    assert plan_.fits and picks == {"master_weights": "bf16_stochastic", "activation_checkpointing": True}
    # fp32 master, gathered one unit at a time: its states, 4 + 4 + 8 bytes, and the engine's copy (2) and
    # the KV cache leave under 11 GB for a unit's fp32 gradient reduction, its gathers, the head's fp32
    # gradients and the activations: more than fits at a quarter of the micro-batch tokens
    p = 3_085_938_688
    kv = 256 * 1024 * 2 * 36 * 256 * 2
    assert usable(80e9) - (18 * p + kv) < 11e9
    assert plan_.apply(cfg).policy.train_micro_batch_tokens is None


def test_a_7b_fits_one_h200_with_stochastic_rounding_gathering_one_unit_at_a_time():
    # sequences of 320 (the bench's 256 new tokens and its short prompts); at 1024 it needs 2 GPUs
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B-Instruct", "policy.max_total_sequence_length=320"],
                      H200)
    p = 7_615_616_512
    kv = 256 * 320 * 2 * 28 * 512 * 2
    # by hand, at one GPU (FSDP2 of one worker), the policy kept gathered: fp32 master 4 + 4 + 8 bytes,
    # with the gathered policy and the engine copy (2 + 2) and the KV cache
    assert (4 + 4 + 8 + 2 + 2) * p + kv > usable(H200)
    # one unit at a time: fp32 master 4 + 4 + 8 + 2 (engine) + KV leaves under 3 GB for the update's
    # activations, head gradient and unit buffers; bf16_stochastic 2 + 2 + 8 + 2 leaves 34 GB
    assert 0 < usable(H200) - ((4 + 4 + 8 + 2) * p + kv) < 3e9
    assert usable(H200) - ((2 + 2 + 8 + 2) * p + kv) > 30e9
    assert plan_.fits and {p.key: p.value for p in plan_.picks} == {
        "master_weights": "bf16_stochastic", "activation_checkpointing": True}
    # sequences of 1024 fit too: compiled layers (a plain bf16 model, no FSDP2 hooks) at half the
    # micro-batch tokens, peak 137.9 GB (where the FSDP2 group of one's eager layers needed 2 GPUs)
    cfg, long = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B-Instruct"], H200)
    assert long.fits and {p.key: p.value for p in long.picks} == {
        "master_weights": "bf16_stochastic", "train_micro_batch_tokens": 16384, "activation_checkpointing": True}
    assert long.peak.total / GB == pytest.approx(137.9, abs=0.05)
    cfg, refused = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B-Instruct", "cluster.gpu_memory_gb=80"], 80 * 10**9)
    assert refused.refusal() == (f"memory plan: the {refused.peak.name} phase needs {refused.peak.total / GB:.1f} GB "
                                 f"per GPU, more than the {usable(80e9) / GB:.1f} GB usable of 80.0 GB: it fits on 4 GPUs "
                                 "(cluster.num_nodes × cluster.gpus_per_node, now 1)")
    cfg, two = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B-Instruct", "cluster.gpus_per_node=2"], H200)
    # on two, fp32 master fits: gathering one unit at a time is given up before the micro-batch size
    assert two.fits and {p.key: p.value for p in two.picks} == {
        "master_weights": "fp32", "activation_checkpointing": True, "keep_gathered": False}
    assert two.apply(cfg).policy.train_micro_batch_tokens is None


def test_the_reference_follows_the_10_percent_rule_or_is_sharded_when_a_whole_copy_does_not_fit():
    # 7B on 2 H200s with the KL penalty: its bf16 weights, 15.23 GB, exceed 10% of 150.75 GB
    assert 2 * 7_615_616_512 > 0.1 * H200
    _, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B", "cluster.gpus_per_node=2",
                     "loss.reference_policy_kl_penalty=0.01"], H200)
    pick = next(p for p in plan_.picks if p.key == "shard_reference")
    assert pick.value is True and "10%" in pick.why
    # 1.5B on 4 GPUs of 36 GB, the policy kept gathered: 3.1 GB is below 10%, but a whole copy does not fit
    # (at 32 GB nothing fits now: eager layers under fp32 master or stochastic rounding, 30.7 GB > 29.0 at best)
    _, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-1.5B", "cluster.gpus_per_node=4",
                     "loss.reference_policy_kl_penalty=0.01", "policy.keep_gathered=true"], 36 * 10**9)
    pick = next(p for p in plan_.picks if p.key == "shard_reference")
    assert pick.value is True and pick.why.startswith("with false the update needs ")
    whole = mp.plan_memory(load_config(None, [*BENCH, "policy.model_name=Qwen/Qwen2.5-1.5B", "cluster.gpus_per_node=4",
                                             "loss.reference_policy_kl_penalty=0.01", "policy.shard_reference=false"]),
                           mp.load_shape("Qwen/Qwen2.5-1.5B"), 36 * 10**9)
    assert not any(p.key == "shard_reference" for p in whole.picks)


def test_user_settings_are_never_overridden():
    fixed = ["policy.master_weights=bf16", "policy.activation_checkpointing=false"]
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B", *fixed], H200)
    # the plan may only shrink the micro-batches: bf16 weights, gradients and moments (2 + 2 + 4) unsharded
    assert plan_.fits and [p.key for p in plan_.picks] == ["train_micro_batch_tokens"]
    applied = plan_.apply(cfg)
    assert applied.policy.master_weights == "bf16" and applied.policy.activation_checkpointing is False
    assert applied.policy.train_micro_batch_tokens == plan_.picks[0].value < 32768
    everything = [*fixed, "policy.train_micro_batch_tokens=32768"]
    cfg, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-7B", *everything], H200)
    assert plan_.picks == () and plan_.apply(cfg) is cfg and not plan_.fits
    assert plan_.hint.startswith("it fits with policy.activation_checkpointing=true, peak ")
    assert plan_.refusal().endswith(plan_.hint)
    assert "policy.master_weights" not in plan_.refusal()  # bf16 is the user's; the fit keeps it


def test_without_a_budget_figures_and_no_verdict():
    cfg = load_config(None, ["policy.device=cpu"])
    assert mp.budget_bytes(cfg) is None
    plan_ = mp.plan_memory(cfg, mp.load_shape(cfg.policy.model_name), None)
    assert plan_.fits is None and plan_.picks == () and plan_.refusal() is None and plan_.apply(cfg) is cfg
    lines = plan_.lines()
    assert lines[-1].endswith("no verdict: no GPU here and cluster.gpu_memory_gb is not set")
    assert "fp32 compute (CPU workers)" in lines[1]
    # the tiny model's KV cache on the CPU: 256 slots (no CUDA graphs) × 256 positions × 2 × 4 layers × 128, fp32
    assert phase(plan_, "generation").components["KV cache"] == 256 * 256 * 2 * 4 * 128 * 4


def test_lines_are_a_table_of_phases_and_components():
    _, plan_ = plan([*BENCH, "policy.model_name=Qwen/Qwen2.5-3B-Instruct"], H200)
    lines = plan_.lines()
    assert lines[0] == "memory plan: Qwen/Qwen2.5-3B-Instruct, 3.09B parameters, 1 GPU; GB (1e9 bytes) per GPU"
    assert lines[2].split() == ["sync", "generate", "update", "optimizer"]
    row = next(line for line in lines if line.strip().startswith("moments"))
    assert row.split()[1:] == [f"{8 * 3_085_938_688 / GB:.1f}"] * 4  # fp32 moments in every phase
    assert any(line.startswith("  picked policy.activation_checkpointing=true: ") for line in lines)
    assert any(f"budget 150.8 GB, {usable(H200) / GB:.1f} usable after 2 GB + 3% reserved: fits" in line
               for line in lines)


# ---------------------------------------------------------------- against what was measured


# `rlscale bench train` on one H200 (bench/results/train_2026-11-30_h200_qwen2-*.json): the worker's
# update alone, bf16 weights and moments (today's bf16 master), no rollout engine, no reference;
# torch.cuda.max_memory_allocated. (model, samples × 320 tokens, micro-batch tokens, compiled, GB)
RECORDED = [("0.5B", 16, 20480, False, 15.448), ("0.5B", 128, 20480, False, 38.887),
            ("0.5B", 16, 20480, True, 12.112), ("0.5B", 128, 20480, True, 29.418),
            ("0.5B", 256, 16384, True, 21.061), ("1.5B", 128, 16384, True, 46.036)]


@pytest.mark.parametrize("size, samples, micro, compiled, measured", RECORDED)
def test_update_agrees_with_recorded_h200_peaks(size, samples, micro, compiled, measured):
    _, plan_ = plan([f"policy.model_name=Qwen/Qwen2.5-{size}", "loss.reference_policy_kl_penalty=0",
                     "policy.max_total_sequence_length=320", "policy.generation.max_new_tokens=160",
                     f"policy.train_micro_batch_tokens={micro}", f"policy.train_global_batch_size={samples}",
                     f"grpo.num_prompts_per_step={samples}", "grpo.num_generations_per_prompt=2",
                     "policy.master_weights=bf16", "policy.activation_checkpointing=false",
                     f"policy.compile={str(compiled).lower()}"], H200)
    engine = ("rollout-engine weights", "KV cache", "decode buffers")
    update = sum(v for k, v in phase(plan_, "update").components.items() if k not in engine)
    assert update / GB == pytest.approx(measured, rel=0.15)


def test_the_module_imports_without_torch():
    code = "import sys, rlscale.memory_plan; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_budget_bytes_takes_gpu_memory_gb():
    assert mp.budget_bytes(load_config(None, ["cluster.gpu_memory_gb=141"])) == 141 * 10**9
    if not torch.cuda.is_available():
        assert mp.budget_bytes(load_config(None, [])) is None
    assert math.isclose(mp.usable_bytes(H200), usable(H200))


# ---------------------------------------------------------------- the rollout engine's KV budget


# the 1.5B of test_a_1_5b_fits_one_h200_with_fp32_master_and_no_checkpointing, its settings fixed
KV_BENCH = [*BENCH, "policy.model_name=Qwen/Qwen2.5-1.5B-Instruct", "policy.master_weights=fp32",
            "policy.keep_gathered=true", "policy.activation_checkpointing=false", "cluster.gpu_memory_gb=141"]
P_1_5B = 1_543_714_304
SEQUENCE_1_5B = 1024 * 2 * 28 * 256 * 2  # 1024 positions × keys and values × 28 layers × kv width 2 × 128 × bf16
# what the generation phase holds besides the KV cache: the gathered bf16 policy, fp32 master weights, fp32
# moments, the engine's bf16 copy (2 + 4 + 8 + 2 bytes a parameter); 256 slots' decode buffers; one prefill
# chunk of 16384 tokens through one layer's MLP (FORWARD_ONLY: 12 × hidden + 8 × intermediate)
GENERATION_OTHERS_1_5B = 16 * P_1_5B + 256 * (151936 * 16 + 256 * 12) + 16384 * (12 * 1536 + 8 * 8960)


def test_gpu_memory_utilization_gives_the_kv_cache_what_the_rest_of_the_generation_leaves():
    cfg, plan_ = plan([*KV_BENCH, "policy.generation.gpu_memory_utilization=0.2"], 141 * 10**9)
    expected = 0.2 * 141e9 - GENERATION_OTHERS_1_5B  # 3.39 GB: under the 256 sequences' 7.5 GB
    assert 0 < expected < 256 * SEQUENCE_1_5B
    for ph in plan_.phases:  # kept from one generation to the next: in every phase
        assert ph.components["KV cache"] == pytest.approx(expected, rel=1e-12), ph.name
    assert plan_.kv_budget_bytes == pytest.approx(expected, abs=1) and plan_.refusal() is None
    assert plan_.as_dict()["kv_budget_bytes"] == plan_.kv_budget_bytes
    note = next(line for line in plan_.lines() if line.startswith("  KV budget"))
    assert note.endswith(f"the cache takes {expected / GB:.2f} GB, {int(expected) // SEQUENCE_1_5B} of the 256 "
                         "sequences of 1024 positions at once")


def test_the_kv_budget_is_capped_at_what_one_slot_per_sample_takes():
    _, plan_ = plan([*KV_BENCH, "policy.generation.gpu_memory_utilization=0.9"], 141 * 10**9)
    assert 0.9 * 141e9 - GENERATION_OTHERS_1_5B > 256 * SEQUENCE_1_5B
    assert plan_.kv_budget_bytes == 256 * SEQUENCE_1_5B  # the engine never allocates more
    assert phase(plan_, "update").components["KV cache"] == 256 * SEQUENCE_1_5B


def test_without_a_known_budget_the_kv_cache_is_counted_unlimited_and_said_so():
    cfg = load_config(None, [*KV_BENCH[:-1], "policy.generation.gpu_memory_utilization=0.2"])
    plan_ = mp.plan_memory(cfg, mp.load_shape(cfg.policy.model_name), None, gpu=True)
    assert plan_.kv_budget_bytes is None and plan_.refusal() is None
    assert phase(plan_, "generation").components["KV cache"] == 256 * SEQUENCE_1_5B
    assert "  KV cache counted without policy.generation.gpu_memory_utilization=0.2 (slots × length): no GPU here " \
           "and cluster.gpu_memory_gb is not set" in plan_.lines()


def test_a_utilization_that_holds_no_sequence_is_refused_naming_the_key():
    from rlscale.errors import UserError

    cfg = load_config(None, [*KV_BENCH, "policy.generation.gpu_memory_utilization=0.15"])
    assert 0.15 * 141e9 < GENERATION_OTHERS_1_5B  # the rest of the generation alone takes more
    needed = math.ceil((GENERATION_OTHERS_1_5B + SEQUENCE_1_5B) / 141e9 * 100) / 100  # 0.2
    line = (f"memory plan: policy.generation.gpu_memory_utilization=0.15 leaves the rollout engine's KV cache 0 "
            f"bytes per GPU (0.15 × 141.0 GB less the {GENERATION_OTHERS_1_5B / GB:.1f} GB the rest of the "
            f"generation phase holds), less than the {SEQUENCE_1_5B} bytes (0.03 GB) one sequence of "
            f"policy.max_total_sequence_length=1024 needs (1024 positions): it fits with "
            f"policy.generation.gpu_memory_utilization={needed:.2f} or more, a shorter "
            "policy.max_total_sequence_length or a larger policy.generation.tensor_parallel_size (now 1)")
    assert mp.plan_for(cfg).refusal() == line
    with pytest.raises(UserError) as refused:  # at the start of a run, before anything loads
        mp.resolve(cfg)
    assert str(refused.value) == line
    # the utilization it names fits one sequence at least
    _, enough = plan([*KV_BENCH, f"policy.generation.gpu_memory_utilization={needed}"], 141 * 10**9)
    assert enough.refusal() is None and enough.kv_budget_bytes >= SEQUENCE_1_5B


# issue 27's one-GPU LoRA step: Qwen2.5-14B, rank 16, the bench's 256 samples of 320 positions
LORA_14B = [*BENCH, "policy.model_name=Qwen/Qwen2.5-14B", "policy.max_total_sequence_length=320",
            "policy.lora.enabled=true", "policy.lora.rank=16", "policy.lora.alpha=32"]
SEQUENCE_14B = 320 * 2 * 48 * 1024 * 2  # 320 positions × keys and values × 48 layers × kv width 8 × 128 × bf16


def test_a_run_that_fits_with_a_kv_budget_is_told_the_largest_utilization_that_fits():
    # 80 GB: one slot per sample (256 × 320 positions, 16.1 GB of cache) puts the update over the usable
    # 75.6 GB; the same GPU fits with the engine's KV cache under a budget, generating in waves
    cfg, unlimited = plan([*LORA_14B, "cluster.gpu_memory_gb=80"], 80 * 10**9)
    assert phase(unlimited, "generation").components["KV cache"] == 256 * SEQUENCE_14B
    assert not unlimited.fits and unlimited.peak.name == "update"
    util = float(unlimited.hint.split("gpu_memory_utilization=")[1].split(" ")[0])
    _, fitting = plan([*LORA_14B, "cluster.gpu_memory_gb=80", f"policy.generation.gpu_memory_utilization={util}"],
                      80 * 10**9)
    _, above = plan([*LORA_14B, "cluster.gpu_memory_gb=80",
                     f"policy.generation.gpu_memory_utilization={util + 0.01:.2f}"], 80 * 10**9)
    assert fitting.fits and fitting.refusal() is None and not above.fits  # the largest, to 0.01
    held = fitting.kv_budget_bytes // SEQUENCE_14B
    assert 1 <= held < 256
    assert unlimited.hint == (f"it fits with policy.generation.gpu_memory_utilization={util:g} (the rollout engine "
                              f"then holds {held} of its 256 sequences at once, generating in waves), peak "
                              f"{fitting.peak.total / GB:.1f} GB")
    assert unlimited.refusal().endswith(unlimited.hint) and fitting.peak.total <= usable(80e9)
    # a utilization the user set that does not fit: a lower one is named, never a higher one
    _, own = plan([*LORA_14B, "cluster.gpu_memory_gb=80", "policy.generation.gpu_memory_utilization=0.99"],
                  80 * 10**9)
    assert not own.fits and f"policy.generation.gpu_memory_utilization={util:g} " in own.hint
    # on CPU workers the engine has no KV budget: no such hint
    _, cpu = plan([*LORA_14B, "cluster.gpu_memory_gb=80", "policy.device=cpu"], 80 * 10**9)
    assert cpu.fits is False and "gpu_memory_utilization" not in cpu.hint


def test_the_worker_gives_the_engine_the_plans_kv_budget(monkeypatch):
    """Not the fraction less what is allocated when the engine is built: that is before the moments exist."""
    from types import SimpleNamespace

    from rlscale.workers.policy import PolicyWorker

    cfg = load_config(None, [*KV_BENCH, "policy.generation.gpu_memory_utilization=0.2"])
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200))
    worker = SimpleNamespace(cfg=cfg, model=SimpleNamespace(config=config), device=torch.device("cuda"))
    assert PolicyWorker._kv_budget(worker, 0.2) == int(0.2 * 141e9 - GENERATION_OTHERS_1_5B)


# ---------------------------------------------------------------- a save per node (the preemption promise)


def test_seed_72b_save_per_node_against_the_spot_grace():
    """The 8 × 8 job with fp32 master weights (the pick at T = 8 on B200s): each node writes its 8
    ranks' shares of the fp32 weights (4 bytes a parameter) and AdamW's two fp32 moments (8), plus
    64 KB of small state per rank; at 2 GB/s per node that takes ~54.5 s, past a 15 s spot grace,
    so the plan promises no emergency save and at most save_period steps lost."""
    cfg, plan_ = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8"], 180 * 10**9)
    p = qwen2_params(8192, 80, 64, 8, 29568, 152064, False)  # 72,706,203,648
    assert p == 72_706_203_648
    save = plan_.save
    assert (save.nodes, save.ranks_per_node, save.master_dtype) == (8, 8, "fp32")
    assert save.weights_bytes == 4 * p // 8 == 36_353_101_824
    assert save.moments_bytes == 8 * p // 8 == 72_706_203_648
    assert save.rest_bytes == 8 * 64 * 1024
    assert save.node_bytes == 12 * p // 8 + 8 * 65536 == 109_059_829_760  # 109.1 GB a node, 872.5 GB in all
    assert save.node_write_gbps == 2.0 and save.grace_s == 15.0 and save.save_period == 2
    assert save.write_s == pytest.approx(109_059_829_760 / 2e9) == pytest.approx(54.53, abs=0.01)
    assert not save.fits_grace
    assert [line for line in plan_.lines() if line.startswith("  save per node")] == [(
        "  save per node (8 ranks, 8 nodes): 109.1 GB = fp32 master weights 36.4 + AdamW moments 72.7 + the rest "
        "0.001; 54.5 s at checkpointing.node_write_gbps=2 GB/s, more than checkpointing.preemption_grace_s=15 s: "
        "no emergency save fits, a preemption loses at most checkpointing.save_period=2 steps")]
    assert plan_.as_dict()["save"]["node_bytes"] == 109_059_829_760

    # 8 GB/s a node: 13.6 s, within the grace: an emergency save is promised
    _, fast = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8", "checkpointing.node_write_gbps=8"],
                   180 * 10**9)
    assert fast.save.fits_grace and fast.save.write_s == pytest.approx(109_059_829_760 / 8e9)
    assert next(line for line in fast.lines() if "save per node" in line).endswith("within checkpointing.preemption_grace_s=15 s: a preemption takes an emergency save")
    # bf16 master weights (2 bytes) and bf16 moments (2 × 2): 6 bytes a parameter
    _, bf16 = plan([*SEED_72B, "policy.generation.tensor_parallel_size=8", "policy.master_weights=bf16"], 180 * 10**9)
    assert (bf16.save.master_dtype, bf16.save.weights_bytes, bf16.save.moments_bytes) == ("bf16", 2 * p // 8, 4 * p // 8)
