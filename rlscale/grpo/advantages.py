"""Group-relative advantages."""

from __future__ import annotations

import torch


STD_OF = ("baseline_samples", "group")


def group_advantages(
    rewards: torch.Tensor,
    leave_one_out: bool = True,
    normalize: bool = True,
    eps: float = 1e-6,
    std_of: str = "baseline_samples",
) -> torch.Tensor:
    """Advantage of every sample against the other samples of its prompt's group.

    rewards: [num_prompts, group_size] float. Returns the same shape.
    baseline: mean of the *other* samples (leave-one-out) or of the whole group; a group of one
    sample is its own baseline.
    normalize: divide by a std where it exceeds `eps` (else the advantage is left as it is):
    `std_of="baseline_samples"` (NeMo-RL's rule) the std of the samples the baseline averages, so
    under leave-one-out each sample's own std of the others (Bessel-corrected; undefined, hence
    not divided, with one other sample); `"group"` the whole group's std for every sample.
    Rewards 1, 2, 3: leave-one-out baselines 2.5, 2, 1.5; stds of the others 0.707, 1.414, 0.707
    give advantages -2.12, 0, 2.12 (the group's std, 1, gives -1.5, 0, 1.5).
    Groups whose samples all scored the same keep a zero advantage and teach nothing.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [prompts, group>=1], got {tuple(rewards.shape)}")
    if std_of not in STD_OF:
        raise ValueError(f"std_of must be one of {', '.join(STD_OF)}, not {std_of!r}")
    rewards = rewards.float()
    group = rewards.shape[1]
    others = leave_one_out and group > 1
    baseline = leave_one_out_mean(rewards) if others else rewards.mean(dim=1, keepdim=True)
    advantages = rewards - baseline
    if normalize:
        if std_of == "group" or not others:
            std = rewards.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(rewards)
        else:
            std = leave_one_out_std(rewards)
        advantages = torch.where(std > eps, advantages / std.clamp_min(eps), advantages)
    # a group whose rewards all agree gets exactly 0, not the rounding of its sum (0.3 * 8 in
    # float32 left ~1e-8), so the update can tell it teaches nothing (see carries_gradient)
    agree = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return advantages.masked_fill(agree, 0.0)


def leave_one_out_mean(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, group >= 2] -> each sample's mean of the other samples of its group."""
    return (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)


def leave_one_out_std(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts, group >= 2] -> each sample's std (Bessel-corrected) of the other samples of its
    group; 0 where it has one other sample (no spread to estimate). In float64, as the sums of
    squares less one term cancel."""
    x = rewards.double()
    n = x.shape[1] - 1  # the others
    if n < 2:
        return torch.zeros_like(rewards)
    mean = (x.sum(dim=1, keepdim=True) - x) / n
    squares = ((x * x).sum(dim=1, keepdim=True) - x * x) / n
    variance = (squares - mean * mean).clamp_min(0) * n / (n - 1)
    return variance.sqrt().to(rewards.dtype)


def carries_gradient(advantages: list[float], kl_beta: float, skip_zero_advantage: bool = True) -> list[bool]:
    """Which samples the policy update has to run forward and backward.

    Without a KL term a sample's loss is -min(ratio * A, clip(ratio) * A), exactly 0 with its
    gradient when its advantage A is 0, whatever the policy: leaving it out of the update changes
    no weight (its tokens still count in the loss's token-level normaliser). With a KL penalty every
    sample carries the KL's gradient and is kept."""
    if kl_beta > 0 or not skip_zero_advantage:
        return [True] * len(advantages)
    return [a != 0.0 for a in advantages]
