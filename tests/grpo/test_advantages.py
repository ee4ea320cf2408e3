import pytest
import torch

from rlscale.grpo import group_advantages


def test_leave_one_out_and_group_std_normalisation_match_hand_computation():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # leave-one-out baselines: (0+0+1)/3, (1+0+1)/3, (1+0+1)/3, (1+0+0)/3
    raw = torch.tensor([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]])
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased: sqrt(1/3)
    assert torch.allclose(group_advantages(rewards, normalize=False), raw)
    assert torch.allclose(group_advantages(rewards, std_of="group"), raw / std)
    assert abs(std.item() - (1 / 3) ** 0.5) < 1e-6
    # the others' stds: {0,0,1} and {1,0,1} -> sqrt(1/3) each, by symmetry
    assert torch.allclose(group_advantages(rewards), raw / (1 / 3) ** 0.5)


def test_nemo_rl_leave_one_out_std_values():
    # NeMo-RL's unit test: rewards 1, 2, 3 -> baselines 2.5, 2.0, 1.5, stds 0.707107, 1.414214, 0.707107
    from rlscale.grpo.advantages import leave_one_out_mean, leave_one_out_std

    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    assert torch.allclose(leave_one_out_mean(rewards), torch.tensor([[2.5, 2.0, 1.5]]))
    assert torch.allclose(leave_one_out_std(rewards), torch.tensor([[0.707107, 1.414214, 0.707107]]), atol=1e-6)
    assert torch.allclose(group_advantages(rewards), torch.tensor([[-2.121320, 0.0, 2.121320]]), atol=1e-5)
    assert torch.allclose(group_advantages(rewards, std_of="group"), torch.tensor([[-1.5, 0.0, 1.5]]))
    # NeMo-RL's single-sample and identical-reward cases: baseline = reward, std 0 -> advantage 0
    assert torch.equal(group_advantages(torch.tensor([[0.7], [1.0]])), torch.zeros(2, 1))
    assert torch.equal(leave_one_out_std(torch.tensor([[2.0, 2.0, 2.0]])), torch.zeros(1, 3))
    assert torch.equal(group_advantages(torch.tensor([[2.0, 2.0, 2.0]])), torch.zeros(1, 3))
    # a sample whose others agree has no spread to divide by: its advantage stays as it is
    assert torch.allclose(group_advantages(torch.tensor([[1.0, 0.0, 0.0]])),
                          torch.tensor([[1.0, -0.5 / 0.5 ** 0.5, -0.5 / 0.5 ** 0.5]]))
    with pytest.raises(ValueError, match="std_of"):
        group_advantages(rewards, std_of="others")


def test_plain_mean_baseline():
    rewards = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
    adv = group_advantages(rewards, leave_one_out=False, normalize=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))


def test_groups_with_equal_rewards_get_zero_advantage_not_nan():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    assert torch.isfinite(adv).all()
    # second group: LOO raw = [-0.5, 1, -0.5]; the group's std sqrt(1/3); the others' stds
    # {1, 0} -> sqrt(1/2), {0, 0} -> 0 (not divided), {0, 1} -> sqrt(1/2)
    assert torch.allclose(group_advantages(rewards, std_of="group")[1],
                          torch.tensor([-0.5, 1.0, -0.5]) / (1 / 3) ** 0.5)
    assert torch.allclose(adv[1], torch.tensor([-0.5 / 0.5 ** 0.5, 1.0, -0.5 / 0.5 ** 0.5]))


def test_rejects_rewards_that_are_not_groups():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("std_of", ["baseline_samples", "group"])
def test_agreeing_groups_get_exactly_zero_whatever_the_rounding(leave_one_out, normalize, std_of):
    """0.3 eight times does not sum to 2.4 in float32: the baseline missed the reward by ~1e-8."""
    rewards = torch.tensor([[0.3] * 8, [0.7] * 8, [0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.9]])
    adv = group_advantages(rewards, leave_one_out, normalize, std_of=std_of)
    assert torch.equal(adv[:2], torch.zeros(2, 8))
    assert (adv[2] != 0).sum() >= 2


def test_only_samples_with_a_gradient_are_trained():
    from rlscale.grpo import carries_gradient

    advantages = [0.0, 1.5, -0.0, -2.0]
    assert carries_gradient(advantages, kl_beta=0.0) == [False, True, False, True]
    assert carries_gradient(advantages, kl_beta=0.01) == [True] * 4  # the KL term has a gradient
    assert carries_gradient(advantages, kl_beta=0.0, skip_zero_advantage=False) == [True] * 4
