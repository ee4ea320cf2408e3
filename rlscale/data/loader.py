"""Hands out prompts batch by batch, resumable from a small JSON-serialisable state.

For a finite source, epoch e visits the problems in a permutation that is a pure function of
(seed, e), so the whole order is reproducible from (seed, epoch, position) alone: nothing
random has to be checkpointed. An unlimited source is read at consecutive indices.
"""

from __future__ import annotations

import random
from typing import Any

from rlscale.data.problem import Problem, ProblemSource
from rlscale.errors import UserError


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(size))
    if shuffle:
        random.Random(f"loader:{seed}:{epoch}").shuffle(order)  # str seed: same in every process
    return order


class PromptLoader:
    def __init__(self, source: ProblemSource, seed: int, shuffle: bool = True):
        if source.size is not None and source.size < 1:
            raise UserError("the training set holds no problems")
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0  # index into the current epoch's order (or the stream, if unlimited)
        self._consumed = 0
        self._order: list[int] | None = None  # cached permutation of the current epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    @property
    def consumed(self) -> int:
        return self._consumed

    def _current_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_order(self.source.size, self.seed, self._epoch, self.shuffle)
        return self._order

    def next_batch(self, n: int) -> list[Problem]:
        """The next n problems; a batch may span an epoch boundary."""
        if n < 0:
            raise ValueError(f"batch size must be non-negative, got {n}")
        size = self.source.size
        batch = []
        for _ in range(n):
            if size is None:
                batch.append(self.source[self._position])
                self._position += 1
            else:
                batch.append(self.source[self._current_order()[self._position]])
                self._position += 1
                if self._position == size:  # roll over eagerly, so epoch counts finished passes
                    self._epoch += 1
                    self._position = 0
                    self._order = None
            self._consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self._epoch, "position": self._position,
                "consumed": self._consumed, "size": self.source.size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("seed", "epoch", "position", "consumed") if k not in state]
        if missing:
            raise UserError(f"data loader state is missing {', '.join(missing)}")
        if state["seed"] != self.seed:
            raise UserError(f"data loader state was saved with seed {state['seed']}, but this run "
                            f"uses seed {self.seed} (grpo.seed); the problem order would differ")
        # size/shuffle are optional so a hand-written state still loads, but must match if given.
        if state.get("size", self.source.size) != self.source.size:
            raise UserError(f"data loader state was saved for {state['size']} training problems, but "
                            f"this dataset has {self.source.size}; the dataset changed")
        if state.get("shuffle", self.shuffle) != self.shuffle:
            raise UserError(f"data loader state was saved with data.shuffle={state['shuffle']}, but "
                            f"this run uses data.shuffle={self.shuffle}")
        epoch, position, consumed = (int(state[k]) for k in ("epoch", "position", "consumed"))
        size = self.source.size
        if min(epoch, position, consumed) < 0 or (size is not None and position >= size):
            raise UserError(f"data loader state is out of range: epoch={epoch}, position={position}, "
                            f"consumed={consumed}")
        self._epoch, self._position, self._consumed = epoch, position, consumed
        self._order = None
