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


def exponential_noise(rows: int, vocab: int, device) -> torch.Tensor:
    """Exp(1) noise for `sample_tokens`, from the native RNG op (safe inside a captured CUDA graph)."""
    return torch.empty(rows, vocab, dtype=torch.float32, device=device).exponential_()


def sample_tokens(logits: torch.Tensor, mode: SamplingMode,
                  noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities under the unmodified distribution [B].

    Log-probabilities are those the trainer recomputes (temperature 1, no filtering), so the two
    can be compared token by token. Sampling is the exponential race (argmax p / E, E ~ Exp(1))
    taken in log space, argmax(logits / T - log E): no softmax, no sort, no host sync, so under
    torch.compile it and the logsumexp fuse into a reduction or two over the logits.
    `noise` [B, vocab] (Exp(1), float32) may come from outside: a compiled caller passes noise
    generated eagerly, since random ops inside an inductor graph that is then captured in a CUDA
    graph may replay the same numbers.
    """
    logits = logits.float()
    if mode.greedy:
        tokens = logits.argmax(-1)
    else:
        scaled = filter_logits(logits / mode.temperature, mode.top_k, mode.top_p)  # no-op when off
        if noise is None:
            noise = exponential_noise(*logits.shape, logits.device)
        tokens = (scaled - noise.log()).argmax(-1)
    chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen - torch.logsumexp(logits, -1)
