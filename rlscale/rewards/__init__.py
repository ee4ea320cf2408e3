"""Rewards: the built-in math-verify reward, user reward functions, and the process-pool scorer."""

from rlscale.rewards.loader import load_reward_function
from rlscale.rewards.math_answer import extract_boxed, math_reward
from rlscale.rewards.scorer import RewardScorer, ScoreResult

__all__ = ["RewardScorer", "ScoreResult", "extract_boxed", "load_reward_function", "math_reward"]
