"""The paged KV cache's bookkeeping on the host: which cache blocks each slot's sequence holds.

The cache is a pool of fixed-size blocks (`block_size` positions each, every layer, keys and
values); a sequence takes blocks as it grows and gives them all back when it ends, so a short
answer holds a few blocks, not a whole `max_length` row. Logical block k of a slot (its positions
k·block_size .. (k+1)·block_size - 1) lives in physical block `table[slot][k]`. Physical block
`scratch` (one past the pool) is where every position no sequence owns points: a finished or
padding slot's decode step writes there, never into a block that another sequence now holds.

A block may be shared: the samples of a GRPO group have one prompt, and its whole blocks (never
written again after the prefill: decoding writes past the prompt) can serve every sequence of the
group (`share`). A block goes back to the pool when the last sequence holding it lets it go.

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
        self.holders = [0] * num_blocks  # sequences holding each block (shared prompt blocks: several)
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
        for _, block in new:
            self.holders[block] = 1
        self.table[slot].extend(block for _, block in new)
        self.peak_used = max(self.peak_used, self.used)
        return new

    def share(self, slot: int, blocks: list[int]) -> list[tuple[int, int]]:
        """The (empty) slot's first logical blocks are `blocks`, held by another sequence too (a
        shared prompt's whole blocks); returns their (logical index, physical block) pairs."""
        assert not self.table[slot], "a shared prompt's blocks start a sequence"
        for block in blocks:
            self.holders[block] += 1
        self.table[slot] = list(blocks)
        return list(enumerate(blocks))

    def release(self, slot: int) -> None:
        """The slot's sequence ended (or was preempted): the blocks no other sequence holds go
        back to the pool."""
        for block in self.table[slot]:
            self.holders[block] -= 1
            if not self.holders[block]:
                self.free.append(block)
        self.table[slot] = []

    def move(self, dst: int, src: int) -> None:
        """Compaction: slot `src`'s blocks now belong to the (empty) slot `dst`."""
        assert not self.table[dst], "compaction moves a sequence into a free slot only"
        self.table[dst], self.table[src] = self.table[src], []
