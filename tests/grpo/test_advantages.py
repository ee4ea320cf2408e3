import pytest
import torch

from rlscale.grpo import group_advantages


def test_leave_one_out_and_std_normalisation_match_hand_computation():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # leave-one-out baselines: (0+0+1)/3, (1+0+1)/3, (1+0+1)/3, (1+0+0)/3
    raw = torch.tensor([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]])
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased: sqrt(1/3)
    assert torch.allclose(group_advantages(rewards, normalize=False), raw)
    assert torch.allclose(group_advantages(rewards), raw / std)
    assert abs(std.item() - (1 / 3) ** 0.5) < 1e-6


def test_plain_mean_baseline():
    rewards = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
    adv = group_advantages(rewards, leave_one_out=False, normalize=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))


def test_groups_with_equal_rewards_get_zero_advantage_not_nan():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    assert torch.isfinite(adv).all()
    # second group: LOO raw = [-0.5, 1, -0.5], std = sqrt(1/3)
    assert torch.allclose(adv[1], torch.tensor([-0.5, 1.0, -0.5]) / (1 / 3) ** 0.5)


def test_rejects_groups_of_one():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([[1.0], [0.0]]))


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_agreeing_groups_get_exactly_zero_whatever_the_rounding(leave_one_out, normalize):
    """0.3 eight times does not sum to 2.4 in float32: the baseline missed the reward by ~1e-8."""
    rewards = torch.tensor([[0.3] * 8, [0.7] * 8, [0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.9]])
    adv = group_advantages(rewards, leave_one_out, normalize)
    assert torch.equal(adv[:2], torch.zeros(2, 8))
    assert (adv[2] != 0).sum() >= 2


def test_only_samples_with_a_gradient_are_trained():
    from rlscale.grpo import carries_gradient

    advantages = [0.0, 1.5, -0.0, -2.0]
    assert carries_gradient(advantages, kl_beta=0.0) == [False, True, False, True]
    assert carries_gradient(advantages, kl_beta=0.01) == [True] * 4  # the KL term has a gradient
    assert carries_gradient(advantages, kl_beta=0.0, skip_zero_advantage=False) == [True] * 4
