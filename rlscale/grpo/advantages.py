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
    return advantages
