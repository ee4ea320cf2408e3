"""Held-out evaluation: accuracy and pass@k."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlscale.data import Problem
from rlscale.workers.group import split_evenly
from rlscale.rollout.sampling import SamplingParams


@dataclass
class EvalResult:
    accuracy: float  # share of all samples judged correct (pass@1)
    pass_at_k: float  # share of problems with a correct answer among k samples
    k: int
    reward_mean: float
    num_problems: int
    response_length_mean: float

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        return {f"{prefix}/accuracy": self.accuracy, f"{prefix}/pass_at_{self.k}": self.pass_at_k,
                f"{prefix}/reward_mean": self.reward_mean, f"{prefix}/response_length": self.response_length_mean}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def is_correct(reward: float) -> bool:
    return reward >= 1.0 - 1e-6


def evaluate(group, problems: list[Problem], scorer, params: SamplingParams, k: int = 1,
             chunk: int = 256) -> EvalResult:
    """Generate k samples per problem (greedy when params.temperature == 0) and score them. Each
    sample is keyed by its index among all of them (see rlscale.controller.generation_seed)."""
    texts = [p.text for p in problems for _ in range(k)]
    answers = [p.answer for p in problems for _ in range(k)]
    responses: list[str] = []
    lengths: list[int] = []
    for start in range(0, len(texts), chunk):
        shards = split_evenly(texts[start:start + chunk], group.world_size)
        ids = split_evenly(list(range(start, min(start + chunk, len(texts)))), group.world_size)
        for rollouts in group.run_all("generate", [(shard, params, False, shard_ids)
                                                   for shard, shard_ids in zip(shards, ids)]):
            responses += rollouts.texts
            lengths += [len(r) for r in rollouts.response_ids]
    scores = scorer.score(responses, answers)
    scores.check(scorer.function, "the evaluation")  # raises when the reward function failed on every sample
    rewards = scores.rewards
    correct_per_problem = [sum(is_correct(r) for r in rewards[i * k:(i + 1) * k]) for i in range(len(problems))]
    return EvalResult(
        accuracy=sum(correct_per_problem) / max(len(rewards), 1),
        pass_at_k=sum(pass_at_k(k, c, k) for c in correct_per_problem) / max(len(problems), 1),
        k=k,
        reward_mean=sum(rewards) / max(len(rewards), 1),
        num_problems=len(problems),
        response_length_mean=sum(lengths) / max(len(lengths), 1),
    )
