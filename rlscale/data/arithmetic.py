"""Built-in synthetic arithmetic task: `47+38` -> `85`.

Train problem i is a pure function of (seed, i), so the stream is unlimited and needs no state
beyond an index. The held-out set comes from a different random stream, and training draws
that hit a held-out problem are rejected and redrawn (deterministically), so validation never
measures memorisation.
"""

from __future__ import annotations

import random

from rlscale.config import ArithmeticConfig, DataConfig
from rlscale.data.problem import Problem, ProblemSource, apply_template, check_template
from rlscale.errors import UserError

# Deliberately terse: a tiny character-level model reads it; the expected response is \boxed{85}.
ARITHMETIC_TEMPLATE = "{problem}="

Key = tuple[int, str, int]  # (a, op, b)


def arithmetic_answer(a: int, op: str, b: int) -> str:
    if op == "+":
        return str(a + b)
    if op == "-":
        return str(a - b)
    if op == "*":
        return str(a * b)
    raise ValueError(f"unknown arithmetic operator {op!r}")


def _operations(cfg: ArithmeticConfig) -> list[str]:
    return list(dict.fromkeys(cfg.operations))  # "++-" counts "+" once; order kept for determinism


def _draw(rng: random.Random, cfg: ArithmeticConfig, ops: list[str]) -> Key:
    a = rng.randint(0, cfg.max_operand)
    op = rng.choice(ops)
    b = rng.randint(0, cfg.max_operand)
    return a, op, b


def held_out_keys(cfg: ArithmeticConfig, seed: int) -> list[Key]:
    """`num_val_problems` distinct problems from the held-out stream, in draw order."""
    ops = _operations(cfg)
    space = (cfg.max_operand + 1) ** 2 * len(ops)
    if cfg.num_val_problems > space // 2:
        # Also bounds the rejection loops: at least half of all draws are usable for training.
        raise UserError(
            f"data.arithmetic.num_val_problems={cfg.num_val_problems} is more than half of the "
            f"{space} distinct problems (max_operand={cfg.max_operand}, operations={cfg.operations!r})")
    rng = random.Random(f"arithmetic:val:{seed}")  # str seeds hash the same in every process
    keys: dict[Key, None] = {}
    while len(keys) < cfg.num_val_problems:
        keys[_draw(rng, cfg, ops)] = None
    return list(keys)


class ArithmeticSource(ProblemSource):
    """Unlimited training stream; `held_out` holds the validation problems."""

    size = None

    def __init__(self, cfg: ArithmeticConfig, seed: int, template: str = ARITHMETIC_TEMPLATE):
        self.cfg = cfg
        self.seed = seed
        self.template = check_template(template)
        self._ops = _operations(cfg)
        keys = held_out_keys(cfg, seed)
        self._held_out_set = set(keys)
        self.held_out = [self._problem(k) for k in keys]

    def _problem(self, key: Key) -> Problem:
        a, op, b = key
        return Problem(apply_template(self.template, f"{a}{op}{b}"), arithmetic_answer(a, op, b))

    def train_key(self, i: int) -> Key:
        if i < 0:
            raise IndexError(f"arithmetic problem index {i} is negative")
        rng = random.Random(f"arithmetic:train:{self.seed}:{i}")
        while True:
            key = _draw(rng, self.cfg, self._ops)
            if key not in self._held_out_set:
                return key

    def __getitem__(self, i: int) -> Problem:
        return self._problem(self.train_key(i))


def arithmetic_train_pairs(data_cfg: DataConfig, seed: int, count: int,
                           start: int = 0) -> list[tuple[str, str]]:
    """(text, answer) pairs from the training stream, e.g. for a supervised warm start.

    Uses the same template as the GRPO run (data.prompt_template or the arithmetic default), so
    the warm-started model sees exactly the prompts it will be trained on; held-out problems are
    excluded just as in GRPO training.
    """
    source = ArithmeticSource(data_cfg.arithmetic, seed, data_cfg.prompt_template or ARITHMETIC_TEMPLATE)
    return [(p.text, p.answer) for p in (source[i] for i in range(start, start + count))]
