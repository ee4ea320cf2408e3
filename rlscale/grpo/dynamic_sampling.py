"""DAPO's dynamic sampling, as NeMo-RL applies it (`grpo.use_dynamic_sampling`).

A group whose samples all got the same reward has zero advantage everywhere: it teaches nothing
and only dilutes the batch. With dynamic sampling a step generates in rounds of
ceil(num_prompts_per_step × batch_multiplier) prompts, drops the groups whose rewards all agree,
and stops as soon as it holds num_prompts_per_step informative groups; it trains on the first
of them in generation order. Informative groups beyond those are dropped, as NeMo-RL drops them
(carrying them into the next step would make them one step off-policy, and put generated
samples into the checkpoint). After `dynamic_sampling_max_gen_batches` rounds without enough
the run stops: the data or the group size gives too little signal for the step asked for. The round's
size is rlscale.config.prompts_per_round (torch-free: the memory plan reads it at --dry-run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def informative_groups(rewards: torch.Tensor) -> list[bool]:
    """Per group (a row of [prompts, group_size] rewards): do its rewards differ (std > 0)?"""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got {tuple(rewards.shape)}")
    return (rewards != rewards[:, :1]).any(dim=1).tolist()


def chosen_groups(informative: Sequence[bool], needed: int) -> list[int]:
    """The indices of the first `needed` informative groups, in generation order; fewer when
    there are not that many."""
    return [index for index, keep in enumerate(informative) if keep][:needed]


def sample_indices(groups: Sequence[int], group_size: int) -> list[int]:
    """The samples of the given groups, samples of a group being consecutive."""
    return [group * group_size + i for group in groups for i in range(group_size)]

