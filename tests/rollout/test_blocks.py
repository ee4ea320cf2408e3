"""The paged KV cache's host bookkeeping (rlscale.rollout.blocks.BlockPool)."""

import pytest

from rlscale.rollout.blocks import BlockPool


def test_blocks_are_taken_as_a_sequence_grows_and_all_come_back():
    pool = BlockPool(num_blocks=5, block_size=4, slots=3)
    assert pool.grow(0, 1) == [(0, 0)] and pool.grow(0, 4) == []  # 4 positions still fit one block
    assert pool.grow(0, 9) == [(1, 1), (2, 2)] and pool.table[0] == [0, 1, 2]
    assert pool.grow(1, 8) == [(0, 3), (1, 4)] and pool.used == 5 == pool.peak_used
    assert pool.grow(2, 1) is None and pool.table[2] == []  # nothing taken when it does not fit
    pool.release(0)
    assert pool.used == 2 and pool.grow(2, 12) == [(0, 0), (1, 1), (2, 2)]
    pool.move(0, 2)
    assert pool.table[0] == [0, 1, 2] and pool.table[2] == []
    with pytest.raises(AssertionError):
        pool.move(1, 0)  # only into a free slot
    pool.release(0), pool.release(1)
    assert pool.used == 0 and sorted(pool.free) == list(range(5)) and pool.peak_used == 5
    assert pool.scratch == 5  # one past the pool: where unowned positions point


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, 16, 1)
