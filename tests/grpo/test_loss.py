import math

import torch

from rlscale.grpo import grpo_token_loss, token_logprobs_and_entropy


def test_ratio_one_gives_minus_advantage_and_no_clipping():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    terms = grpo_token_loss(logp, logp.clone(), torch.tensor([2.0]))
    assert torch.allclose(terms.loss, torch.tensor([[-2.0, -2.0]]))
    assert terms.clipped.sum() == 0


def test_clipping_positive_and_negative_advantages_by_hand():
    old = torch.zeros(1, 2)
    # ratios e^0.5 = 1.6487 and e^-0.5 = 0.6065
    new = torch.tensor([[0.5, -0.5]])
    pos = grpo_token_loss(new, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.2)
    # A>0: min(r*A, clip(r)*A) -> 1.2 for r=1.65 (clipped); 0.6065 for r=0.61 (unclipped: smaller)
    assert torch.allclose(pos.loss, torch.tensor([[-1.2, -math.exp(-0.5)]]), atol=1e-6)
    assert pos.clipped.tolist() == [[1.0, 0.0]]
    neg = grpo_token_loss(new, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.2)
    # A<0: min(-r, -clip(r)) -> -1.6487 for r=1.65 (unclipped); -0.8 for r=0.61 (clipped)
    assert torch.allclose(neg.loss, torch.tensor([[math.exp(0.5), 0.8]]), atol=1e-6)
    assert neg.clipped.tolist() == [[0.0, 1.0]]


def test_asymmetric_clip_high():
    old = torch.zeros(1, 1)
    new = torch.tensor([[0.5]])
    terms = grpo_token_loss(new, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    assert torch.allclose(terms.loss, torch.tensor([[-1.28]]))


def test_k3_kl_by_hand_and_gradient_flows():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    terms = grpo_token_loss(logp, logp.detach(), torch.tensor([0.0]), ref, kl_beta=0.1)
    # k3 = e^(ref-logp) - (ref-logp) - 1 = 0.5 - ln(0.5) - 1
    expected_kl = 0.5 - math.log(0.5) - 1
    assert abs(terms.kl.item() - expected_kl) < 1e-6
    assert abs(terms.loss.item() - 0.1 * expected_kl) < 1e-6
    terms.loss.sum().backward()
    # d/dlogp [e^(ref-logp) - (ref-logp)] = -e^(ref-logp) + 1 = 0.5, times beta
    assert abs(logp.grad.item() - 0.05) < 1e-6


def test_kl_off_when_beta_zero():
    logp = torch.zeros(2, 3)
    terms = grpo_token_loss(logp, logp, torch.ones(2), torch.full((2, 3), -1.0), kl_beta=0.0)
    assert torch.equal(terms.kl, torch.zeros(2, 3))


def test_chunked_logprobs_match_log_softmax_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    lp, ent = token_logprobs_and_entropy(logits, targets, with_entropy=True, chunk=4)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref.gather(-1, targets[..., None]).squeeze(-1), atol=1e-6)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
