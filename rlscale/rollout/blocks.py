"""The paged KV cache's bookkeeping on the host: which cache blocks each slot's sequence holds.

The cache is a pool of fixed-size blocks (`block_size` positions each, every layer, keys and
values); a sequence takes blocks as it grows and gives them all back when it ends, so a short
answer holds a few blocks, not a whole `max_length` row. Logical block k of a slot (its positions
k·block_size .. (k+1)·block_size - 1) lives in physical block `table[slot][k]`. Physical block
`scratch` (one past the pool) is where every position no sequence owns points: a finished or
padding slot's decode step writes there, never into a block that another sequence now holds.

Pure Python: the engine mirrors the table onto the device (`RolloutEngine._push_blocks`).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, slots: int):
        if num_blocks < 1:
            raise ValueError(f"a paged KV cache needs at least one block, not {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.table: list[list[int]] = [[] for _ in range(slots)]
        self.peak_used = 0  # the most blocks held at once since the pool was made

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    def grow(self, slot: int, positions: int) -> list[tuple[int, int]] | None:
        """Give `slot` blocks for its first `positions` positions; returns the new (logical index,
        physical block) pairs, or None (nothing taken) when the pool has too few free blocks."""
        have, need = len(self.table[slot]), self.blocks_for(positions)
        if need <= have:
            return []
        if need - have > len(self.free):
            return None
        new = [(k, self.free.popleft()) for k in range(have, need)]
        self.table[slot].extend(block for _, block in new)
        self.peak_used = max(self.peak_used, self.used)
        return new

    def release(self, slot: int) -> None:
        """The slot's sequence ended (or was preempted): its blocks go back to the pool."""
        self.free.extend(self.table[slot])
        self.table[slot] = []

    def move(self, dst: int, src: int) -> None:
        """Compaction: slot `src`'s blocks now belong to the (empty) slot `dst`."""
        assert not self.table[dst], "compaction moves a sequence into a free slot only"
        self.table[dst], self.table[src] = self.table[src], []
