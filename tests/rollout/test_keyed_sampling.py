"""Keyed draws: a pure hash of (seed, sample id, response position), and the engine sampling with them."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlscale.rollout import RolloutEngine, SamplingMode, SamplingParams
from rlscale.rollout.sampling import keyed_uniform
from tests.rollout.sample_checks import assert_same_samples

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=99, max_position_embeddings=256, pad_token_id=0, eos_token_id=1)
SAMPLED = [SamplingMode(1.0), SamplingMode(1.0, top_p=0.9), SamplingMode(1.0, top_k=20)]


def long(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64)


def test_keyed_uniform_is_a_pure_function_in_the_unit_interval():
    ids, positions = long(range(1000)).repeat_interleave(100), long(range(100)).repeat(1000)
    u = keyed_uniform(3, ids, positions)
    assert u.dtype == torch.float32 and u.shape == (100_000,)
    assert u.min() >= 0 and u.max() < 1
    assert torch.equal(u, keyed_uniform(3, ids, positions))
    assert torch.equal(u * 2 ** 24, (u * 2 ** 24).floor())  # 24-bit values, exact in float32
    rng = torch.get_rng_state()
    keyed_uniform(long([3]), ids, positions)
    assert torch.equal(torch.get_rng_state(), rng)  # no generator involved


def test_keyed_uniform_is_distinct_across_ids_positions_and_seeds():
    grid = keyed_uniform(11, long(range(1000)), long([7]))  # broadcasts, as a step counter does
    assert len(grid.unique()) == 1000
    assert len(keyed_uniform(11, long([7]), long(range(1000))).unique()) == 1000
    assert torch.equal(grid, keyed_uniform(long([11]), long(range(1000)), long([7] * 1000)))
    other_seed = keyed_uniform(12, long(range(1000)), long([7]))
    assert (grid != other_seed).float().mean() > 0.99
    swapped = keyed_uniform(11, long([7]), long(range(1000)))  # (id, position) is ordered
    assert (grid != swapped).float().mean() > 0.99


def test_keyed_uniform_passes_a_kolmogorov_smirnov_bound():
    n = 100_000
    ids, positions = long(range(n // 50)).repeat_interleave(50), long(range(50)).repeat(n // 50)
    for seed in (0, 1, 2 ** 40 + 17):
        u = keyed_uniform(seed, ids, positions).double().sort().values
        grid = torch.arange(1, n + 1, dtype=torch.float64) / n
        distance = torch.maximum(grid - u, u - (grid - 1 / n)).max()
        assert distance < 1.95 / n ** 0.5  # the 99.9% critical value of the KS statistic
    # and its low bits too: pairs of consecutive positions are not correlated
    u = keyed_uniform(5, ids, positions).view(-1, 50).double()
    correlation = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(correlation) < 0.02


def test_keyed_uniform_keeps_its_recorded_values():
    # the draws are part of a run's record: a change here changes every seeded rollout
    u = keyed_uniform(1234, long([0, 1, 7, 2 ** 40, -3]), long([0, 0, 5, 3, 1]))
    assert (u * 2 ** 24).long().tolist() == [1961465, 257297, 12516681, 2030209, 15732837]
    assert int(keyed_uniform(0, long([0]), long([0])) * 2 ** 24) == 5648368
    assert int(keyed_uniform(-1, long([5]), long([2 ** 33])) * 2 ** 24) == 14404067


def test_sampling_params_carry_a_seed_outside_the_captured_mode():
    params = SamplingParams(temperature=1.0, seed=7)
    assert SamplingParams().seed is None and params.seed == 7
    assert params.mode == SamplingParams(temperature=1.0).mode  # a new seed needs no new graph


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 99, (int(n),), generator=g).tolist() for n in torch.randint(3, 14, (count,), generator=g)]


def test_seeded_generation_repeats_uses_no_global_randomness_and_changes_with_the_seed(model):
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    batch = prompts(5)
    rng = torch.get_rng_state()
    first = engine.generate(batch, 20, SamplingMode(1.0), [1], 0, ignore_eos=True, seed=9)
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(123)  # the global generator plays no part
    again = engine.generate(batch, 20, SamplingMode(1.0), [1], 0, ignore_eos=True, seed=9)
    assert again.tokens == first.tokens and again.logprobs == first.logprobs
    other = engine.generate(batch, 20, SamplingMode(1.0), [1], 0, ignore_eos=True, seed=10)
    assert other.tokens != first.tokens
    # prefill's first token is keyed too: sample 0's first draw is keyed_uniform(9, 0, 0)
    probs = torch.softmax(model(torch.tensor([batch[0]])).logits[0, -1].double(), -1)
    expected = torch.searchsorted(probs.cumsum(-1), keyed_uniform(9, long([0]), long([0])).double(), right=True)
    assert first.tokens[0][0] == int(expected[0])


@pytest.mark.parametrize("mode", SAMPLED, ids=str)
def test_a_sample_draws_the_same_tokens_in_any_batch_and_slot(model, mode):
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    seven, ids = prompts(7, seed=2), [40, 41, 42, 43, 44, 45, 46]
    big = engine.generate(seven, 24, mode, [1], 0, ignore_eos=True, seed=3, sample_ids=ids)
    picked = [5, 0, 3]  # a batch of 3 in another order: other slots, another batch size
    small = engine.generate([seven[i] for i in picked], 24, mode, [1], 0, ignore_eos=True, seed=3,
                            sample_ids=[ids[i] for i in picked])
    reference = type(big)([big.tokens[i] for i in picked], [big.logprobs[i] for i in picked], [False] * 3)
    assert_same_samples(model, [seven[i] for i in picked], reference, small, mode, 3, [ids[i] for i in picked])
    assert len({tuple(row) for row in big.tokens}) == 7  # the samples did draw differently
    # the negative control: the same samples under other ids are not excused as near-ties
    shifted = engine.generate([seven[i] for i in picked], 24, mode, [1], 0, ignore_eos=True, seed=3,
                              sample_ids=[ids[i] + 1 for i in picked])
    with pytest.raises(AssertionError, match="without a near-tie"):
        assert_same_samples(model, [seven[i] for i in picked], reference, shifted, mode, 3, [ids[i] for i in picked])


def test_greedy_ignores_the_seed(model):
    engine = RolloutEngine(model, torch.device("cpu"), torch.float32, max_length=128)
    batch = prompts(4)
    plain = engine.generate(batch, 12, SamplingMode(0.0), [1], 0, ignore_eos=True)
    assert engine.generate(batch, 12, SamplingMode(0.0), [1], 0, ignore_eos=True, seed=4).tokens == plain.tokens
    with pytest.raises(ValueError, match="sample ids"):
        engine.generate(batch, 12, SamplingMode(1.0), [1], 0, seed=4, sample_ids=[1, 2])
