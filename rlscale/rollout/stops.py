"""Stop strings, checked on decoded text (a string can span several tokens, or part of one)."""

from __future__ import annotations


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
