"""Stops: stop strings, checked on decoded text (a string can span several tokens, or part of one),
and the lookup table of stop token ids that the decode step reads."""

from __future__ import annotations

import torch


class StopStrings:
    """Callable for `RolloutEngine.generate(stop_check=...)`: the response length, in tokens, at
    which the first stop string is complete, or None while no stop string has appeared."""

    def __init__(self, tokenizer, strings):
        self.tokenizer, self.strings = tokenizer, tuple(strings)

    def _contains(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(s in text for s in self.strings)

    def __call__(self, index: int, tokens: list[int]) -> int | None:
        if not self._contains(tokens):
            return None
        # containment only grows with the prefix: bisect for the shortest prefix holding a string
        low, high = 1, len(tokens)
        while low < high:
            mid = (low + high) // 2
            if self._contains(tokens[:mid]):
                high = mid
            else:
                low = mid + 1
        return low


def stop_table(ids: list[int], device) -> torch.Tensor:
    """A bool lookup table over token ids, True at each of `ids` (negative ones, placeholders, are
    skipped), one entry longer than the largest id: `is_stop` reads it with a gather, O(1) a token
    for a stop set of any size and capturable in a CUDA graph (torch.isin over 22 or more ids sorts,
    which a capture cannot hold)."""
    ids = [int(i) for i in ids if int(i) >= 0]
    table = torch.zeros(max(ids, default=-1) + 2, dtype=torch.bool, device=device)
    if ids:
        table[torch.tensor(ids, dtype=torch.long, device=device)] = True
    return table


def is_stop(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Whether each token is a stop id of `stop_table`'s table (ids past its end map to its last,
    False, entry)."""
    return table[tokens.clamp(max=table.shape[0] - 1)]
