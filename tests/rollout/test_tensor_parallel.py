"""Tensor-parallel generation (gloo, real processes on loopback) against the single-device engine,
and each rank's weight slices against the full weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rlscale.rollout import RolloutEngine, SamplingMode, TensorParallel, tp_unsupported_reason
from rlscale.rollout.weights import DecodeWeights, model_shape
from tests.rollout.sample_checks import assert_same_samples

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
            pad_token_id=0, eos_token_id=1)
# T=4 covers kv heads split (llama: 4 kv heads) and replicated (2 kv heads: one query head a rank
# for qwen2, two for qwen3); vocabularies 99 and 97 do not divide by 2 or 4 (padded shards)
FAMILIES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(  # q/k/v biases, tied embeddings
        **BASE, num_attention_heads=4, num_key_value_heads=2, vocab_size=99, tie_word_embeddings=True)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(  # q/k norms, head_dim 16 set apart from hidden / heads
        **BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=97)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(  # q/k/v and o_proj biases, untied LM head
        **BASE, num_attention_heads=8, num_key_value_heads=4, vocab_size=99, attention_bias=True)),
}
SEED, IDS = 21, [100, 101, 102, 103, 104]
MODES = {"greedy": SamplingMode(0.0), "t1": SamplingMode(1.0), "top_p": SamplingMode(1.0, top_p=0.9),
         "top_k": SamplingMode(1.0, top_k=20)}
NEW_TOKENS = 16


def make(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # biases are zeros at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    return model


def ragged_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7)]


def generations(engine: RolloutEngine) -> dict:
    """Every mode's generation of the ragged prompts (sampled ones keyed by SEED and IDS)."""
    out = {}
    for name, mode in MODES.items():
        out[name] = engine.generate(ragged_prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True, seed=SEED,
                                    sample_ids=IDS)
    out["unseeded"] = engine.generate(ragged_prompts(), 4, SamplingMode(1.0), [1], 0, ignore_eos=True)
    return out


def rank_main(rank: int, size: int, init_file: str, models_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.new_group(list(range(size))))
        torch.manual_seed(rank)  # unseeded draws must still agree: the engine shares rank 0's seed
        results = {}
        for family, model in torch.load(models_file, weights_only=False).items():
            engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, tp=tp)
            assert engine.cache is None and engine.weights.local_shape.num_heads == model_shape(
                model.config).num_heads // size
            results[family] = generations(engine)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models():
    return {family: make(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def single_device(models):
    return {family: generations(RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128))
            for family, model in models.items()}


def run_ranks(size: int, models: dict, tmp_path) -> dict:
    """Each family's generations on `size` ranks; asserts that every rank got the same ones."""
    torch.save(models, tmp_path / "models.pt")
    # fork where there is one: 4 fresh interpreters importing torch and transformers on 2 cores
    # take ~14 s (rank_main sets one thread before any torch op, so the parent's pools do not matter)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(rank_main, (size, str(tmp_path / "init"), str(tmp_path / "models.pt"), str(tmp_path)),
                       nprocs=size, start_method=method)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(size)]
    for other in ranks[1:]:
        for family, outs in other.items():
            for name, out in outs.items():
                assert (out.tokens, out.logprobs) == (ranks[0][family][name].tokens, ranks[0][family][name].logprobs)
    return ranks[0]


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_generation_equals_the_single_device_engine(size, models, single_device, tmp_path):
    # T=4 on 2 cores: ~7 ms a gloo all-reduce (4 processes on 2 cores), six a step: ~10 s in all
    parallel = run_ranks(size, models, tmp_path)
    differing = 0
    for family, model in models.items():
        for name, mode in MODES.items():
            reference, got = single_device[family][name], parallel[family][name]
            if mode.greedy:
                assert got.tokens == reference.tokens, family
            differing += assert_same_samples(model, ragged_prompts(), reference, got, mode, SEED, IDS)
    assert differing <= 1  # near-ties are rare: 45 sampled rows of 16 tokens, most often none


# ---------------------------------------------------------------------- weight slices (no processes)

def expected_slices(model, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of the first layer's weights and of the vocabulary, by plain chunking."""
    s = model_shape(model.config)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    q = lambda t: t.chunk(size)[rank]  # noqa: E731
    if s.num_kv_heads % size == 0:
        kv = lambda t: t.chunk(size)[rank]  # noqa: E731
    else:  # replicated: rank r holds kv head r // (T / Hkv)
        kv = lambda t: t.chunk(s.num_kv_heads)[rank // (size // s.num_kv_heads)]  # noqa: E731
    padded = -(-s.vocab_size // size) * size
    out = {
        "qkv": torch.cat([q(attn.q_proj.weight), kv(attn.k_proj.weight), kv(attn.v_proj.weight)]),
        "o": attn.o_proj.weight.chunk(size, dim=1)[rank],
        "gate_up": torch.cat([q(mlp.gate_proj.weight), q(mlp.up_proj.weight)]),
        "down": mlp.down_proj.weight.chunk(size, dim=1)[rank],
        "embed": F.pad(model.model.embed_tokens.weight, (0, 0, 0, padded - s.vocab_size)).chunk(size)[rank],
        "lm_head": F.pad(model.lm_head.weight, (0, 0, 0, padded - s.vocab_size)).chunk(size)[rank],
        "input_norm": layer.input_layernorm.weight,
    }
    if attn.q_proj.bias is not None:
        out["qkv_bias"] = torch.cat([q(attn.q_proj.bias), kv(attn.k_proj.bias), kv(attn.v_proj.bias)])
    if attn.o_proj.bias is not None:
        out["o_bias"] = attn.o_proj.bias
    if hasattr(attn, "q_norm"):
        out["q_norm"], out["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
    return out


def engine_slices(weights: DecodeWeights) -> dict[str, torch.Tensor]:
    layer = weights.layers[0]
    out = {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down", "input_norm", "qkv_bias",
                                                   "o_bias", "q_norm", "k_norm")}
    return {k: v for k, v in out.items() if v is not None} | {"embed": weights.embed, "lm_head": weights.lm_head}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_exactly_its_slices_of_the_full_weights(family, size, models):
    model = models[family]
    for rank in range(size):
        weights = DecodeWeights(model, torch.device("cpu"), torch.float32, TensorParallel(rank, size))
        expected, got = expected_slices(model, rank, size), engine_slices(weights)
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), f"rank {rank}: {name}"
        if model.config.tie_word_embeddings:
            assert weights.lm_head is weights.embed  # one shard for both
        assert weights.local_shape.num_kv_heads == len(weights.slices.kv_heads)


def units(model):
    """The model's full parameters grouped as FSDP would wrap them: each layer, then the rest."""
    groups: dict[str, list] = {}
    for name, param in model.named_parameters():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((name, param.detach().clone()))
    return list(groups.values())


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_streamed_sync_unit_by_unit_fills_every_target_once(family, models):
    model = models[family]
    tp = TensorParallel(1, 2)
    reference = DecodeWeights(model, torch.device("cpu"), torch.float32, tp)
    streamed = DecodeWeights(model, torch.device("cpu"), torch.float32, tp, sync=False)
    filled, parts = [], units(model)
    for unit in parts[:-1]:
        filled += streamed.copy_named(unit)  # the worker: one gathered unit at a time
    assert streamed.missing_after(filled) == sorted(name for name, _ in parts[-1]
                                                    if name in streamed.targets)
    filled += streamed.copy_named(iter(parts[-1]))  # any iterable
    assert streamed.missing_after(filled) == [] and len(filled) == len(set(filled)) == len(streamed.targets)
    for name, tensor in engine_slices(reference).items():
        assert torch.equal(engine_slices(streamed)[name], tensor), name


def test_copy_named_refuses_shards_and_unknown_names_before_copying(models):
    model = models["llama"]
    weights = DecodeWeights(model, torch.device("cpu"), torch.float32, TensorParallel(0, 2))
    before = weights.layers[0].qkv.clone()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(ValueError, match="still sharded"):
        weights.copy_named([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64)),
                            ("model.layers.0.self_attn.q_proj.weight", q_proj.chunk(2)[0])])
    with pytest.raises(ValueError, match="unexpected parameter"):
        weights.copy_named([("model.layers.0.self_attn.q_proj.weight", torch.zeros_like(q_proj)),
                            ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    assert torch.equal(weights.layers[0].qkv, before)  # nothing copied from a refused batch
    assert weights.copy_named([("lm_head.weight", model.lm_head.weight)]) == ["lm_head.weight"]  # untied here
    tied = DecodeWeights(models["qwen2"], torch.device("cpu"), torch.float32, TensorParallel(0, 2))
    assert tied.copy_named([("lm_head.weight", torch.zeros(99, 64))]) == []  # tied: the embedding's shard


def test_kv_heads_split_or_replicate_as_vllm_does():
    def held(size, heads, kv_heads):
        return [tuple(TensorParallel(r, size).kv_heads(heads, kv_heads)) for r in range(size)]

    assert held(2, 8, 4) == [(0, 1), (2, 3)]
    assert held(4, 4, 2) == [(0,), (0,), (1,), (1,)]  # each kv head on T / Hkv = 2 ranks
    assert held(8, 16, 2) == [(0,)] * 4 + [(1,)] * 4
    assert [TensorParallel(r, 4).vocab(99) for r in range(4)] == [range(0, 25), range(25, 50), range(50, 75),
                                                                  range(75, 100)]


def test_unsupported_shapes_are_named_without_a_process_group():
    shape = model_shape(Qwen2Config(**BASE, num_attention_heads=4, num_key_value_heads=2, vocab_size=99))
    assert tp_unsupported_reason(shape, 1) is None and tp_unsupported_reason(shape, 4) is None
    assert "attention heads" in tp_unsupported_reason(shape, 3)
    assert "kv heads" in tp_unsupported_reason(model_shape(Qwen2Config(
        hidden_size=96, intermediate_size=96, num_attention_heads=12, num_key_value_heads=4)), 6)
    assert "intermediate" in tp_unsupported_reason(model_shape(Qwen2Config(
        hidden_size=64, intermediate_size=130, num_attention_heads=4, num_key_value_heads=2)), 4)
    with pytest.raises(ValueError, match="attention heads"):
        DecodeWeights(make("qwen2"), torch.device("cpu"), torch.float32, TensorParallel(0, 3))


def test_size_one_is_the_single_device_path(models):
    engine = RolloutEngine(models["qwen2"], torch.device("cpu"), torch.float32, max_length=64,
                           tp=TensorParallel(0, 1))
    assert engine.tp is None and engine.forward.tp is None and engine.weights.local_shape is engine.shape
