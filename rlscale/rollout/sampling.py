"""Sampling on the device: pure functions of logits, safe to capture in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMode:
    """The parts of the sampling parameters that change the captured computation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask tokens outside the top-k and outside the smallest set holding top_p of the mass."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p (the first always stays)
        drop_sorted = (probs.cumsum(-1) - probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, mode: SamplingMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities under the unmodified distribution [B].

    Log-probabilities are those the trainer recomputes (temperature 1, no filtering), so the two
    can be compared token by token. Sampling uses the exponential-race form of the Gumbel-max trick
    (argmax p / E, E ~ Exp(1)): one pass, no sort, no host sync.
    """
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    if mode.greedy:
        tokens = logits.argmax(-1)
    else:
        scaled = filter_logits(logits / mode.temperature, mode.top_k, mode.top_p)
        probs = scaled.softmax(-1)
        noise = torch.empty_like(probs).exponential_(1.0)
        tokens = (probs / noise).argmax(-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
