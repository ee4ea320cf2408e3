"""Group-relative advantages."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    leave_one_out: bool = True,
    normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of every sample against the other samples of its prompt's group.

    rewards: [num_prompts, group_size] float. Returns the same shape.
    baseline: mean of the *other* samples (leave-one-out) or of the whole group;
    normalize: divide by the group's std (unbiased) where it exceeds `eps`; groups whose
    samples all scored the same keep a zero advantage and teach nothing.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group>=2], got {tuple(rewards.shape)}")
    rewards = rewards.float()
    group = rewards.shape[1]
    total = rewards.sum(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (total - rewards) / (group - 1)
    else:
        baseline = total / group
    advantages = rewards - baseline
    if normalize:
        std = rewards.std(dim=1, keepdim=True)
        advantages = torch.where(std > eps, advantages / std.clamp_min(eps), advantages)
    # a group whose rewards all agree gets exactly 0, not the rounding of its sum (0.3 * 8 in
    # float32 left ~1e-8), so the update can tell it teaches nothing (see carries_gradient)
    agree = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return advantages.masked_fill(agree, 0.0)


def carries_gradient(advantages: list[float], kl_beta: float, skip_zero_advantage: bool = True) -> list[bool]:
    """Which samples the policy update has to run forward and backward.

    Without a KL term a sample's loss is -min(ratio * A, clip(ratio) * A), exactly 0 with its
    gradient when its advantage A is 0, whatever the policy: leaving it out of the update changes
    no weight (its tokens still count in the loss's token-level normaliser). With a KL penalty every
    sample carries the KL's gradient and is kept."""
    if kl_beta > 0 or not skip_zero_advantage:
        return [True] * len(advantages)
    return [a != 0.0 for a in advantages]
