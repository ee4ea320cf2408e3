"""DAPO's two remedies for truncated responses, as NeMo-RL applies them: the overlong soft penalty
on the reward (`grpo.reward_shaping.*`) and overlong filtering of the loss (`grpo.overlong_filtering`).

Both act before the update: the penalty changes a sample's reward, so its group's baseline and
advantages see it; filtering leaves the rewards and advantages as they are and only takes the
truncated samples out of the loss.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty: float) -> torch.Tensor:
    """The penalty (<= 0) each response's reward gets for its length L (DAPO, Section 3.4):

        expected = max_response_length - buffer_length
        penalty(L) = min(0, -(L - expected) / buffer_length * penalty)

    0 up to `expected` tokens, falling linearly to -penalty at max_response_length. Beyond it the
    fall goes on (NeMo-RL's and verl's code; DAPO's paper stops at -1), which only a response
    longer than max_response_length reaches. lengths: response tokens, any shape; float32 out.
    """
    if buffer_length < 1:
        raise ValueError(f"buffer_length must be at least 1, got {buffer_length}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    expected = max_response_length - buffer_length
    excess = lengths.double() - expected
    return (-excess / buffer_length * penalty).clamp_max(0.0).float()


def in_loss(truncated: list[bool], overlong_filtering: bool) -> list[bool]:
    """Which samples the loss sees. With overlong filtering a truncated sample (it ran into
    max_new_tokens without a stop) weighs 0 in the loss and is not counted in its normaliser
    (NeMo-RL: loss_multiplier = 0, and the valid token and sequence counts are summed over
    token_mask * sample_mask); its reward still counts in its group's baseline and std."""
    if not overlong_filtering:
        return [True] * len(truncated)
    return [not t for t in truncated]


def kl_penalized_rewards(rewards: torch.Tensor, kl_sums: torch.Tensor, beta: float) -> torch.Tensor:
    """KL in the reward (REINFORCE++, verl's use_kl_in_reward): each sample's reward minus beta
    times its per-token KL estimate to the reference summed over its response. verl puts -beta ×
    kl_t on every token and GRPO's outcome advantage sums a response's token rewards, which is
    this. rewards, kl_sums: the same shape; float32 out."""
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    return (rewards.double() - beta * kl_sums.double()).float()
