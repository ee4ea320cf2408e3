"""GRPO maths as pure functions on tensors."""

from rlscale.grpo.advantages import carries_gradient, group_advantages
from rlscale.grpo.loss import LossTerms, grpo_token_loss, token_logprobs_and_entropy

__all__ = ["carries_gradient", "group_advantages", "LossTerms", "grpo_token_loss", "token_logprobs_and_entropy"]
