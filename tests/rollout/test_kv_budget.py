"""Generation within a KV budget: a paged cache (blocks taken as sequences grow, the newest
preempted when the pool runs out), continuous admission of waiting prompts into freed slots, and a
decode batch that shrinks as sequences end, against the engine that holds every sequence at once."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.rollout import RolloutEngine, SamplingMode, TensorParallel, round_up
from tests.rollout.sample_checks import assert_same_samples

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=99, max_position_embeddings=256, pad_token_id=0, eos_token_id=1)
MODES = {"greedy": SamplingMode(0.0), "t1": SamplingMode(1.0), "top_p": SamplingMode(1.0, top_p=0.9)}
SEED, NEW_TOKENS, COUNT, SLOTS = 5, 24, 12, 2  # a budget of 2 whole sequences for 12 samples: a sixth of them
BLOCK = 16  # cache positions per block: a 64-position sequence spans 4 blocks


def make_model():
    # initializer_range 0.3: greedy responses of the default (0.02) random model repeat one token
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True, initializer_range=0.3)).eval()


@pytest.fixture(scope="module")
def model():
    return make_model()


def prompts(count: int = COUNT, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 99, (int(n),), generator=g).tolist() for n in torch.randint(3, 14, (count,), generator=g)]


def budget(engine: RolloutEngine, slots: int, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> int:
    """Bytes for `slots` sequences of the cache length a generation of `batch` uses (and the scratch block)."""
    return slots * engine.slot_bytes(round_up(max(map(len, batch)) + new_tokens, 64)) + engine.block_bytes()


def engine(model, budget_slots: int | None = None, check_every: int = 4, **options) -> RolloutEngine:
    options.setdefault("block_size", BLOCK)
    out = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, check_every=check_every, **options)
    if budget_slots is not None:
        out.kv_budget_bytes = budget(out, budget_slots, prompts())
    return out


def eos_for(mode: SamplingMode, model) -> list[int]:
    """An eos id that ends the responses at uneven lengths: the token whose first occurrences in
    the full-length responses (keyed draws: the same tokens up to any eos) sit at the most
    different positions, while at least one response never samples it."""
    rows = engine(model).generate(prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True, seed=SEED).tokens

    def spread(token):
        firsts = [row.index(token) if token in row else None for row in rows]
        return len(set(firsts)) if None in firsts else 0

    return [max(range(2, SMALL["vocab_size"]), key=spread)]


def assert_same(model, mode, reference, got):
    if mode.greedy:
        assert got.tokens == reference.tokens
        # the same tokens; logprobs to fp32 rounding (a decode batch of other sequences, other blocks)
        torch.testing.assert_close(torch.tensor(sum(got.logprobs, [])), torch.tensor(sum(reference.logprobs, [])),
                                   atol=1e-4, rtol=0)
    else:
        assert_same_samples(model, prompts(), reference, got, mode, SEED)
    assert got.stopped == reference.stopped


@pytest.mark.parametrize("name", sorted(MODES))
def test_a_budget_of_a_third_of_the_samples_admits_them_in_waves_and_changes_no_sample(model, name):
    mode = MODES[name]
    eos = eos_for(mode, model)
    reference = engine(model, check_every=16).generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    lengths = [len(row) for row in reference.tokens]
    assert len(set(lengths)) > 2 and max(lengths) == NEW_TOKENS and min(lengths) < NEW_TOKENS  # uneven
    assert reference.waves == 1
    budgeted = engine(model, SLOTS)
    got = budgeted.generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    assert_same(model, mode, reference, got)
    assert got.waves > 1 and budgeted.cache.nbytes <= budgeted.kv_budget_bytes
    assert got.preemptions > 0  # the pool ran out as sequences grew: the newest went back to wait
    # paged: short sequences hold few blocks, so more than 4 decode at once, never more blocks than the pool
    assert max(got.decode_batches) > SLOTS and got.peak_blocks <= budgeted.cache.num_blocks == SLOTS * 64 // BLOCK
    # every sample ran to its end: as many decode steps as the longest chain of admissions needs,
    # fewer than one wave after another would (COUNT / SLOTS waves of NEW_TOKENS - 1 steps each)
    assert len(got.decode_batches) < COUNT // SLOTS * (NEW_TOKENS - 1)


def test_stop_strings_cut_the_same_under_admission(model):
    mode = MODES["t1"]
    eos = eos_for(mode, model)

    def stop_at_seven(index, tokens):  # a "stop string": the token 7, or 11 followed by anything
        for j, token in enumerate(tokens):
            if token == 7 or (token == 11 and j + 1 < len(tokens)):
                return j + 1 + (token == 11)
        return None

    reference = engine(model, check_every=16).generate(prompts(), NEW_TOKENS, mode, eos, 0,
                                                       stop_check=stop_at_seven, seed=SEED)
    got = engine(model, SLOTS, check_every=3).generate(prompts(), NEW_TOKENS, mode, eos, 0,
                                                       stop_check=stop_at_seven, seed=SEED)
    assert got.waves > 1
    assert_same(model, mode, reference, got)
    cut = [i for i, row in enumerate(reference.tokens) if row and row[-1] not in eos and reference.stopped[i]]
    assert cut  # some responses did end at the "stop string"


def test_no_slot_leaks_across_consecutive_generations_and_the_cache_stays_within_the_budget(model):
    mode = MODES["t1"]
    eos = eos_for(mode, model)
    budgeted = engine(model, SLOTS)
    limit = budgeted.kv_budget_bytes
    first = budgeted.generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    for batch, new_tokens in ((prompts(), NEW_TOKENS), (prompts(3, seed=2), NEW_TOKENS), (prompts(), 60),
                              (prompts(), NEW_TOKENS)):
        out = budgeted.generate(batch, new_tokens, mode, eos, 0, seed=SEED)
        assert budgeted.slot_sample and all(sample is None for sample in budgeted.slot_sample)  # all freed
        assert budgeted.cache.nbytes <= limit
        assert len(out.tokens) == len(batch) and all(row is not None for row in out.tokens)
        if len(batch) == COUNT and new_tokens == NEW_TOKENS:
            assert out.tokens == first.tokens and out.logprobs == first.logprobs
        assert budgeted.pool.used == 0 and len(budgeted.pool.free) == budgeted.cache.num_blocks  # no block leaks
    # 60 new tokens: 128 cache positions a sequence, so the same budget holds half as many whole ones
    assert budgeted.slot_capacity(128) == SLOTS // 2
    one = engine(model, 1)  # one whole 64-position sequence (and the scratch block): it fits, nothing more does
    alone = one.generate(prompts(), 8, mode, [1], 0, seed=SEED)
    assert alone.tokens == engine(model).generate(prompts(), 8, mode, [1], 0, seed=SEED).tokens
    assert alone.peak_blocks <= one.cache.num_blocks == 64 // BLOCK and alone.waves > 1
    # a byte less than the longest prompt's blocks and 8 new tokens' (and the scratch block): refused
    need = -(-(max(map(len, prompts())) + 8) // BLOCK) + 1
    with pytest.raises(ValueError, match="holds no sequence"):
        RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, block_size=BLOCK,
                      kv_budget_bytes=need * one.block_bytes() - 1).generate(prompts(), 8, mode, [1], 0)
    one.kv_budget_bytes = need * one.block_bytes()
    assert one.generate(prompts(), 8, mode, [1], 0, seed=SEED).tokens == alone.tokens


def test_unseeded_draws_and_one_token_responses_pass_through_a_budget(model):
    budgeted = engine(model, SLOTS)
    # torch.rand draws go to slots, so sequences stay where they are (no compaction); all still end
    torch.manual_seed(3)
    out = budgeted.generate(prompts(), NEW_TOKENS, MODES["t1"], eos_for(MODES["t1"], model), 0)
    assert out.waves > 1 and all(row for row in out.tokens) and all(i is None for i in budgeted.slot_sample)
    # one new token: every prompt ends at its prefill, holding one block: as many per wave as blocks
    one = budgeted.generate(prompts(), 1, MODES["greedy"], [1], 0)
    reference = engine(model).generate(prompts(), 1, MODES["greedy"], [1], 0)
    blocks = budgeted.cache.num_blocks
    assert one.tokens == reference.tokens and one.waves == -(-COUNT // blocks) and one.peak_blocks == blocks
    assert one.decode_batches == []
    # a budget of 3 blocks: the prompts pass through 3 at a time
    three = engine(model)
    three.kv_budget_bytes = 4 * three.block_bytes()
    assert three.generate(prompts(), 1, MODES["greedy"], [1], 0).waves == COUNT // 3


def test_the_decode_batch_shrinks_as_sequences_end(model):
    mode = MODES["t1"]
    eos = eos_for(mode, model)
    whole = engine(model, check_every=1)
    out = whole.generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    batches = out.decode_batches
    assert batches[0] == COUNT and batches[-1] < batches[0]
    assert all(a >= b for a, b in zip(batches, batches[1:]))  # nothing waits: it only shrinks
    # with check_every=1 each step runs at exactly the sequences still running after the step before
    lengths = sorted(len(row) for row in out.tokens)
    assert batches == [sum(length > step for length in lengths) for step in range(1, len(batches) + 1)]
    budgeted = engine(model, SLOTS, check_every=1).generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    assert budgeted.waves > 1 and budgeted.decode_batches[-1] < SLOTS
    assert_same(model, mode, out, budgeted)


def test_compaction_moves_kv_rows_and_state_rows_together(model):
    # the first tokens of samples 0, 5 and 7 as eos ids: they end at prefill, leaving holes below
    # live slots that the first check fills from above; every other response is cut at its first
    # eos in the full-length responses (ignore_eos: no compaction there)
    mode = MODES["greedy"]
    reference = engine(model).generate(prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True)
    eos = sorted({reference.tokens[i][0] for i in (0, 5, 7)})
    got = engine(model, check_every=2).generate(prompts(), NEW_TOKENS, mode, eos, 0)
    ends = [next((j + 1 for j, token in enumerate(row) if token in eos), len(row)) for row in reference.tokens]
    assert got.tokens == [row[:end] for row, end in zip(reference.tokens, ends)]
    assert got.decode_batches[0] == sum(end > 1 for end in ends) < COUNT  # compacted before the first step


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")),
                    reason="torch.compile on CPU (inductor) needs a C++ compiler")
def test_a_compiled_step_shrinks_by_batch_buckets_within_dynamos_recompile_limit(model):
    mode = MODES["t1"]
    eos = eos_for(mode, model)
    reference = engine(model).generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    compiled = engine(model, check_every=2, compile_decode=True)
    compiled.kv_budget_bytes = 11 * compiled.block_bytes()  # 10 blocks: 10 first blocks, buckets 8 and 10
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        got = compiled.generate(prompts(), NEW_TOKENS, mode, eos, 0, seed=SEED)
    assert set(got.decode_batches) <= {8, 10} and got.decode_batches[-1] == 8 and got.waves > 1
    assert_same(model, mode, reference, got)


# ---------------------------------------------------------------------- tensor parallel (2 gloo ranks)

def rank_main(rank: int, size: int, init_file: str, out_dir: str, eos: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.new_group(list(range(size))))
        model = make_model()
        results = {}
        for name in ("greedy", "t1"):
            e = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128, tp=tp, check_every=4)
            e.kv_budget_bytes = budget(e, SLOTS, prompts())  # this rank's bytes: its own kv heads
            assert e.slot_bytes(64) * size == RolloutEngine(model, torch.device("cpu"), torch.float32,
                                                            max_length=128).slot_bytes(64)
            results[name] = e.generate(prompts(), NEW_TOKENS, MODES[name], eos[name], 0, seed=SEED)
            assert e.cache.nbytes <= e.kv_budget_bytes
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_budgeted_generation_equals_the_unbudgeted_single_device_one(model, tmp_path):
    eos = {name: eos_for(MODES[name], model) for name in ("greedy", "t1")}
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(rank_main, (2, str(tmp_path / "init"), str(tmp_path), eos), nprocs=2, start_method=method)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = engine(model, check_every=16)
    for name in ("greedy", "t1"):
        assert ranks[0][name].tokens == ranks[1][name].tokens
        assert ranks[0][name].waves > 1
        reference = single.generate(prompts(), NEW_TOKENS, MODES[name], eos[name], 0, seed=SEED)
        if MODES[name].greedy:
            assert ranks[0][name].tokens == reference.tokens
        assert_same_samples(model, prompts(), reference, ranks[0][name], MODES[name], SEED)


def test_length_caps_end_each_sequence_at_its_own_length_and_a_full_batch_engine_keeps_every_slot(model):
    mode = MODES["t1"]
    full = engine(model).generate(prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True, seed=SEED)
    caps = [1 + (7 * i) % NEW_TOKENS for i in range(COUNT)]
    capped = engine(model, SLOTS).generate(prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True, seed=SEED,
                                           length_caps=caps)
    assert [len(row) for row in capped.tokens] == caps and not any(capped.stopped)
    assert capped.tokens == [row[:cap] for row, cap in zip(full.tokens, caps)]
    assert capped.waves > 1
    # shrink_batch=False (the benchmark's baseline): every step over the whole cache, same samples
    kept = engine(model, shrink_batch=False).generate(prompts(), NEW_TOKENS, mode, [1], 0, ignore_eos=True,
                                                      seed=SEED, length_caps=caps)
    assert kept.tokens == capped.tokens and set(kept.decode_batches) == {COUNT}
    assert len(kept.decode_batches) == max(caps) - 1
    with pytest.raises(ValueError, match="length_caps"):
        engine(model).generate(prompts(), NEW_TOKENS, mode, [1], 0, length_caps=[NEW_TOKENS + 1] * COUNT)


def test_periodic_checks_that_cannot_pay_read_one_number_and_grow_blocks_from_host_positions(model):
    # every sequence fits at once and runs to its cap (eos ignored): no end can shrink the batch
    # before the last step, so of the 6 periodic checks (24 tokens, every 4) none is a full one;
    # blocks are still granted as the sequences grow, from positions the host knows
    batch = prompts()[:4]
    paged = engine(model)
    paged.kv_budget_bytes = budget(paged, 4, batch)
    got = paged.generate(batch, NEW_TOKENS, SamplingMode(0.0), [1], 0, ignore_eos=True)
    reference = engine(model).generate(batch, NEW_TOKENS, SamplingMode(0.0), [1], 0, ignore_eos=True)  # no budget
    assert got.host_checks == 1  # the end of all, at the deadline (a full check every 4 steps made it 6)
    assert got.tokens == reference.tokens
    assert all(len(row) == NEW_TOKENS for row in got.tokens)
    # each sequence ends holding exactly the blocks of its prompt and response (no grant skipped or doubled)
    assert paged.pool.peak_used == sum(-(-(len(p) + NEW_TOKENS) // BLOCK) for p in batch)


def test_freed_slots_stepping_through_later_waves_stay_within_the_rotary_table(model):
    # A freed slot that a decode step still covers (every slot here, as a CUDA graph's batch bucket
    # covers the free slots above the live ones) runs on to its block table's last position: 96
    # with blocks of 48 for a 64-position cache, past max_length. That once indexed the rotary
    # table out of bounds (a device-side assert in the first budgeted GRPO generation on CUDA).
    new_tokens, mode = 40, MODES["greedy"]

    def run(budget_slots):
        out = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=64, check_every=4, block_size=48,
                            shrink_batch=False)
        if budget_slots is not None:
            out.kv_budget_bytes = budget(out, budget_slots, prompts(), new_tokens)
        return out, out.generate(prompts(), new_tokens, mode, [1], 0, ignore_eos=True, seed=SEED)

    _, reference = run(None)
    budgeted, got = run(SLOTS)
    assert got.waves > 1 and int(budgeted.state.positions.max()) >= 64
    assert got.tokens == reference.tokens
