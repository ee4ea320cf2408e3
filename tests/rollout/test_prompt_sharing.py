"""A GRPO group's prompt prefilled once (RolloutEngine share_prompts): the group's other samples
hold its whole cache blocks, copy its partial last block and sample their first token from its
logits. Their samples are those of the engine that prefills every prompt, all at once or under a
KV budget (admission in waves, a group split across them, preemption); fewer blocks are held and
none leaks."""

from __future__ import annotations

import pytest
import torch

from rlscale.rollout import SamplingMode
from rlscale.rollout.blocks import BlockPool
from tests.rollout.sample_checks import assert_same_samples
from tests.rollout.test_kv_budget import BLOCK, MODES, SEED, budget, engine, make_model

GROUP, NEW_TOKENS = 4, 24
# prompt lengths: inside one block, exactly one block, one block and a part, two blocks and a part (BLOCK 16)
LENGTHS = (5, 16, 23, 40)


@pytest.fixture(scope="module")
def model():
    return make_model()


def grouped_prompts() -> list[list[int]]:
    """GROUP copies of each prompt, consecutive, as the controller repeats a group's prompt."""
    g = torch.Generator().manual_seed(3)
    distinct = [torch.randint(2, 99, (n,), generator=g).tolist() for n in LENGTHS]
    return [p for p in distinct for _ in range(GROUP)]


def generate(model, share: bool, mode: SamplingMode, budget_slots: int | None = None):
    batch = grouped_prompts()
    e = engine(model, share_prompts=share)
    if budget_slots is not None:
        e.kv_budget_bytes = budget(e, budget_slots, batch, NEW_TOKENS)
    out = e.generate(batch, NEW_TOKENS, mode, [1], 0, ignore_eos=True, seed=SEED)
    assert e.pool.used == 0 and not any(e.pool.holders), "every block back in the pool"
    return out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_shared_prefills_sample_what_separate_prefills_sample(model, mode):
    separate = generate(model, False, MODES[mode])
    shared = generate(model, True, MODES[mode])
    assert separate.shared_prefills == 0
    assert shared.shared_prefills == len(LENGTHS) * (GROUP - 1)  # one prefill per prompt
    assert_same_samples(model, grouped_prompts(), separate, shared, MODES[mode], seed=SEED, logprob_atol=1e-5)
    # the whole prompt blocks are held once per group: 0, 1, 1 and 2 of them per sample spared
    spared = sum((GROUP - 1) * (n // BLOCK) for n in LENGTHS)
    assert shared.peak_blocks == separate.peak_blocks - spared


@pytest.mark.parametrize("mode", ["greedy", "t1"])
def test_under_a_budget_groups_split_across_waves_still_share(model, mode):
    """A budget of 3 sequences for 16 samples: groups of 4 are split across admission rounds; a
    later round shares a live sequence's prompt blocks and the kept logits of its prompt."""
    unlimited = generate(model, False, MODES[mode])
    shared = generate(model, True, MODES[mode], budget_slots=3)
    assert shared.waves > 1 and shared.shared_prefills > 0
    assert_same_samples(model, grouped_prompts(), unlimited, shared, MODES[mode], seed=SEED)


def test_a_shared_block_returns_to_the_pool_with_its_last_holder():
    pool = BlockPool(num_blocks=6, block_size=4, slots=3)
    assert pool.grow(0, 10) == [(0, 0), (1, 1), (2, 2)]  # a prompt of 10: two whole blocks and a part
    assert pool.share(1, pool.table[0][:2]) == [(0, 0), (1, 1)]
    assert pool.grow(1, 11) == [(2, 3)]  # its own partial block
    assert pool.used == 4 and pool.holders[:4] == [2, 2, 1, 1]
    pool.release(0)
    assert pool.used == 3 and sorted(pool.free) == [2, 4, 5]  # the shared blocks stay with slot 1
    pool.release(1)
    assert pool.used == 0 and not any(pool.holders)


def tp_rank_main(rank: int, size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rlscale.rollout import RolloutEngine, TensorParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.new_group(list(range(size))))
        e = RolloutEngine(make_model(), torch.device("cpu"), torch.float32, max_length=128, tp=tp, check_every=4,
                          block_size=BLOCK)
        e.kv_budget_bytes = budget(e, 3, grouped_prompts(), NEW_TOKENS)
        out = e.generate(grouped_prompts(), NEW_TOKENS, MODES["t1"], [1], 0, ignore_eos=True, seed=SEED)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_share_alike_and_sample_the_single_devices_tokens(model, tmp_path):
    """Each rank shares its own kv heads' blocks; both ranks admit alike (their collectives pair)."""
    import torch.multiprocessing as mp

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(tp_rank_main, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method=method)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0].tokens == ranks[1].tokens and ranks[0].shared_prefills > 0 and ranks[0].waves > 1
    assert_same_samples(model, grouped_prompts(), generate(model, False, MODES["t1"]), ranks[0], MODES["t1"], SEED)
