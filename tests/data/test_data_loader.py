import json

import pytest

from rlscale.config import ArithmeticConfig
from rlscale.data import Problem, PromptLoader
from rlscale.data.arithmetic import ArithmeticSource
from rlscale.data.problem import ListSource
from rlscale.errors import UserError


def make_source(n):
    return ListSource([Problem(f"p{i}", str(i)) for i in range(n)])


def texts(batch):
    return [p.text for p in batch]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    loader = PromptLoader(make_source(10), seed=3, shuffle=True)
    first, second = texts(loader.next_batch(10)), texts(loader.next_batch(10))
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(10))
    assert first != second  # reshuffled per epoch
    assert first != [f"p{i}" for i in range(10)]
    assert (loader.epoch, loader.position, loader.consumed) == (2, 0, 20)


def test_order_is_a_function_of_the_seed():
    a = texts(PromptLoader(make_source(20), seed=1, shuffle=True).next_batch(20))
    b = texts(PromptLoader(make_source(20), seed=1, shuffle=True).next_batch(20))
    c = texts(PromptLoader(make_source(20), seed=2, shuffle=True).next_batch(20))
    assert a == b and a != c


def test_no_shuffle_reads_in_order_across_epoch_boundary():
    loader = PromptLoader(make_source(3), seed=0, shuffle=False)
    assert texts(loader.next_batch(5)) == ["p0", "p1", "p2", "p0", "p1"]
    assert (loader.epoch, loader.position, loader.consumed) == (1, 2, 5)


def test_batch_crossing_epoch_boundary_finishes_one_epoch_then_starts_the_next():
    loader = PromptLoader(make_source(7), seed=5, shuffle=True)
    batch = texts(loader.next_batch(4)) + texts(loader.next_batch(4))
    assert len(set(batch[:7])) == 7  # all of epoch 0 before anything of epoch 1
    reference = PromptLoader(make_source(7), seed=5, shuffle=True)
    reference.next_batch(7)
    assert batch[7] == texts(reference.next_batch(1))[0]


@pytest.mark.parametrize("split", [2, 7, 10, 13])
def test_restored_loader_continues_exactly_like_an_uninterrupted_one(split):
    uninterrupted = PromptLoader(make_source(7), seed=11, shuffle=True)
    expected = texts(uninterrupted.next_batch(3)) + texts(uninterrupted.next_batch(3)) \
        + texts(uninterrupted.next_batch(3)) + texts(uninterrupted.next_batch(9))

    first = PromptLoader(make_source(7), seed=11, shuffle=True)
    got = texts(first.next_batch(split))
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = PromptLoader(make_source(7), seed=11, shuffle=True)
    resumed.load_state_dict(state)
    got += texts(resumed.next_batch(len(expected) - split))
    assert got == expected
    assert resumed.consumed == len(expected)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_unlimited_source_reads_consecutive_indices_and_resumes():
    source = ArithmeticSource(ArithmeticConfig(), seed=0)
    loader = PromptLoader(source, seed=0, shuffle=True)
    assert loader.next_batch(5) == [source[i] for i in range(5)]
    resumed = PromptLoader(source, seed=0, shuffle=True)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.next_batch(3) == [source[i] for i in range(5, 8)]
    assert (resumed.epoch, resumed.position, resumed.consumed) == (0, 8, 8)


def test_state_with_another_seed_is_a_user_error():
    state = PromptLoader(make_source(5), seed=1).state_dict()
    with pytest.raises(UserError, match="seed 1.*seed 2"):
        PromptLoader(make_source(5), seed=2).load_state_dict(state)


def test_state_for_another_dataset_size_or_incomplete_state_is_a_user_error():
    state = PromptLoader(make_source(5), seed=1).state_dict()
    with pytest.raises(UserError, match="5 training problems.*has 6"):
        PromptLoader(make_source(6), seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="missing position"):
        PromptLoader(make_source(5), seed=1).load_state_dict({"seed": 1, "epoch": 0, "consumed": 0})
