"""inverse_cdf_tokens: the block search lands on the token whose CDF interval holds the draw."""

import pytest
import torch

from rlscale.rollout.sampling import inverse_cdf_tokens


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
