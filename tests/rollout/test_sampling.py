"""inverse_cdf_tokens: the block search lands on the token whose CDF interval holds the draw."""

import pytest
import torch

from rlscale.rollout.sampling import block_size, flat_cdf, inverse_cdf_tokens


def reference_tokens(scaled: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The same inversion over the whole row at once, in float64."""
    cdf = torch.softmax(scaled.double(), -1).cumsum(-1)
    return torch.searchsorted(cdf, uniform.double()[:, None] * cdf[:, -1:], right=True).squeeze(-1)


@pytest.mark.parametrize("block", [1, 7, 64, 1024, 5000])  # block sizes that divide 1000 or not, or exceed it
def test_blocked_search_equals_the_whole_row_search(block):
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(64, 1000, generator=g) * 3
    uniform = torch.rand(64, generator=g)
    tokens, log_total = inverse_cdf_tokens(scaled, uniform, block)
    assert torch.equal(tokens, reference_tokens(scaled, uniform))
    torch.testing.assert_close(log_total, torch.logsumexp(scaled, -1))


@pytest.mark.parametrize("block", [1, 2, 3, 4, 16])  # 1 and 2: whole blocks without mass
def test_excluded_tokens_are_never_drawn_even_at_the_ends_of_the_unit_interval(block):
    scaled = torch.randn(16, generator=torch.Generator().manual_seed(1))
    excluded = [0, 3, 10, 11, 12, 15]  # first and last tokens, and a run across block edges
    scaled[excluded] = float("-inf")
    draws = torch.cat([torch.tensor([0.0, 1 - 2 ** -24, 0.5]), torch.rand(20000, generator=torch.Generator().manual_seed(2))])
    tokens, _ = inverse_cdf_tokens(scaled.expand(len(draws), 16).contiguous(), draws, block)
    assert tokens[0] == 1 and tokens[1] == 14  # the first and the last token with mass
    assert not torch.isin(tokens, torch.tensor(excluded)).any()
    assert tokens.min() >= 0 and tokens.max() < 16


def test_draws_follow_the_softmax():
    scaled = torch.randn(16, generator=torch.Generator().manual_seed(4))
    draws = 40000
    tokens, _ = inverse_cdf_tokens(scaled.expand(draws, 16).contiguous(),
                                   torch.rand(draws, generator=torch.Generator().manual_seed(5)), 5)
    expected = torch.softmax(scaled, -1) * draws
    assert expected.min() > 5
    chi2 = ((torch.bincount(tokens, minlength=16) - expected) ** 2 / expected).sum()
    assert chi2 < 37.70  # the 99.9% quantile of chi-square with 15 degrees of freedom


def test_a_row_with_one_token_of_mass_always_draws_it():
    scaled = torch.full((3, 2000), float("-inf"))
    scaled[:, 1234] = 0.0
    assert inverse_cdf_tokens(scaled, torch.tensor([0.0, 0.5, 1 - 2 ** -24]), 1024)[0].tolist() == [1234] * 3


def tree_sums(mass: torch.Tensor) -> torch.Tensor:
    """Running sums along the last axis in the order a parallel (Hillis–Steele) scan adds them."""
    sums, step = mass.clone(), 1
    while step < mass.shape[-1]:
        shifted = torch.nn.functional.pad(sums[..., :-step], (step, 0))
        sums, step = sums + shifted, step * 2
    return sums


def test_flat_cdf_stays_flat_at_zero_mass_where_a_tree_scan_rises():
    g = torch.Generator().manual_seed(6)
    mass = torch.rand(512, 300, generator=g)
    mass[torch.rand(512, 300, generator=g) < 0.5] = 0.0
    mass = mass / mass.sum(-1, keepdim=True)
    raw = tree_sums(mass)
    previous = torch.nn.functional.pad(raw[:, :-1], (1, 0))
    zero = mass == 0
    assert (raw[zero] != previous[zero]).any()  # the input does show the tree scan's rounding rises
    cdf = flat_cdf(mass, raw)
    previous = torch.nn.functional.pad(cdf[:, :-1], (1, 0))
    assert torch.equal(cdf[zero], previous[zero]) and (cdf >= previous).all()
    # every target below the total then lands on an entry with mass
    target = torch.minimum(torch.rand(512, 1, generator=g) * cdf[:, -1:], torch.nextafter(cdf[:, -1:], torch.zeros(1)))
    chosen = torch.searchsorted(cdf, target, right=True)
    assert (mass.gather(-1, chosen) > 0).all()


def test_non_finite_logits_still_give_tokens_in_range_and_no_rows_give_none():
    tokens, _ = inverse_cdf_tokens(torch.full((3, 2500), float("nan")), torch.rand(3))
    assert tokens.min() >= 0 and tokens.max() < 2500
    tokens, log_total = inverse_cdf_tokens(torch.zeros(0, 2500), torch.rand(0))
    assert tokens.shape == (0,) and log_total.shape == (0,)


def test_block_size_gives_about_128_blocks_within_16_to_1024_entries():
    assert [block_size(v) for v in (99, 2048, 2049, 32000, 151936, 10 ** 6)] == [16, 16, 32, 256, 1024, 1024]
    for vocab in (99, 5000, 32000, 128256):
        size = block_size(vocab)
        assert size in (16, 1024) or 64 < -(-vocab // size) <= 128


def test_default_blocks_draw_what_any_block_size_draws():
    g = torch.Generator().manual_seed(9)
    scaled = torch.randn(32, 99, generator=g) * 2
    uniform = torch.rand(32, generator=g)
    assert torch.equal(inverse_cdf_tokens(scaled, uniform)[0], inverse_cdf_tokens(scaled, uniform, 1024)[0])
