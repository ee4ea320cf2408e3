import operator
import re

import pytest

from rlscale.config import ArithmeticConfig, DataConfig
from rlscale.data.arithmetic import (ArithmeticSource, arithmetic_answer, arithmetic_train_pairs,
                                     held_out_keys)
from rlscale.errors import UserError

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def test_answers_for_each_operator():
    assert arithmetic_answer(47, "+", 38) == "85"
    assert arithmetic_answer(3, "-", 7) == "-4"
    assert arithmetic_answer(12, "*", 11) == "132"
    with pytest.raises(ValueError):
        arithmetic_answer(1, "/", 2)


def test_problems_are_well_formed_and_answers_correct():
    source = ArithmeticSource(ArithmeticConfig(operations="+-*"), seed=0)
    for i in range(300):
        p = source[i]
        m = re.fullmatch(r"(\d+)([-+*])(\d+)=", p.text)
        assert m, p.text
        a, op, b = int(m[1]), m[2], int(m[3])
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert p.answer == str(OPS[op](a, b))

def test_template_wraps_the_expression():
    plain = ArithmeticSource(ArithmeticConfig(), seed=0)
    custom = ArithmeticSource(ArithmeticConfig(), seed=0, template="Q: {problem} A:")
    assert custom[0].text == "Q: " + plain[0].text.removesuffix("=") + " A:"
    assert custom[0].answer == plain[0].answer
    with pytest.raises(UserError, match="must contain"):
        ArithmeticSource(ArithmeticConfig(), seed=0, template="no placeholder")

def test_all_configured_operators_are_drawn():
    source = ArithmeticSource(ArithmeticConfig(operations="-*"), seed=3)
    ops = {re.fullmatch(r"\d+([-+*])\d+=", source[i].text)[1] for i in range(200)}
    assert ops == {"-", "*"}


def test_train_stream_is_pure_function_of_seed_and_index():
    cfg = ArithmeticConfig(operations="+-")
    a, b = ArithmeticSource(cfg, seed=7), ArithmeticSource(cfg, seed=7)
    assert [a[i] for i in range(50)] == [b[i] for i in range(50)]
    assert a[1000] == b[1000]  # random access, no hidden iteration state
    assert [a[i] for i in range(50)] != [ArithmeticSource(cfg, seed=8)[i] for i in range(50)]
    assert a.size is None


def test_held_out_is_deterministic_distinct_and_disjoint_from_train():
    cfg = ArithmeticConfig(max_operand=9, num_val_problems=40)  # 100 problems: collisions are certain
    source = ArithmeticSource(cfg, seed=1)
    assert source.held_out == ArithmeticSource(cfg, seed=1).held_out
    held = {p.text for p in source.held_out}
    assert len(held) == 40
    train = {source[i].text for i in range(2000)}
    assert not train & held
    assert len(train) == 60  # every non-held-out problem is still reachable


def test_held_out_larger_than_half_the_space_is_a_user_error():
    with pytest.raises(UserError, match="num_val_problems=10"):
        held_out_keys(ArithmeticConfig(max_operand=2, num_val_problems=10), seed=0)


def test_train_pairs_follow_the_stream_and_the_configured_template():
    cfg = DataConfig(prompt_template="{problem} =")
    pairs = arithmetic_train_pairs(cfg, seed=5, count=4, start=10)
    source = ArithmeticSource(cfg.arithmetic, 5, "{problem} =")
    assert pairs == [(source[i].text, source[i].answer) for i in range(10, 14)]
    assert all(text.endswith(" =") for text, _ in pairs)
