"""Comparing two engines' samples up to float rounding: tokens must agree except where the reference
draw sits at a near-tie, where logits equal to fp32 rounding may legitimately choose differently."""

from __future__ import annotations

import torch

from rlscale.rollout import SamplingMode
from rlscale.rollout.sampling import keyed_uniform

TIE = 1e-5  # a CDF boundary, top-p cut or top-k / argmax gap closer than this to the draw is a near-tie


def next_token_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The model's float64 logits [V] for the token after prompt + response."""
    with torch.no_grad():
        return model(torch.tensor([prompt + response])).logits[0, -1].double()


def near_tie(logits: torch.Tensor, mode: SamplingMode, uniform: float | None) -> bool:
    """Whether a rounding-sized change of `logits` [V] could change the token drawn at `uniform`."""
    if mode.greedy:
        top = logits.topk(2).values
        return bool(top[0] - top[1] < TIE)
    scaled = logits / mode.temperature  # then the engine's filter_logits: top-k, then top-p
    if mode.top_k is not None and mode.top_k < len(scaled):
        ordered = scaled.sort(descending=True).values
        if ordered[mode.top_k - 1] - ordered[mode.top_k] < TIE:
            return True
        scaled = scaled.masked_fill(scaled < ordered[mode.top_k - 1], float("-inf"))
    if mode.top_p < 1.0:
        ordered = scaled.sort(descending=True)
        probs = ordered.values.softmax(-1)
        before = probs.cumsum(-1) - probs  # a token is dropped when those above it hold top_p
        if ((before - mode.top_p).abs() < TIE).any():
            return True
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, ordered.indices, before > mode.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    cdf = scaled.softmax(-1).cumsum(-1)
    return bool((cdf - uniform).abs().min() < TIE)


def assert_same_samples(model, prompts, reference, other, mode: SamplingMode, seed: int | None = None,
                        sample_ids=None, logprob_atol: float = 1e-4) -> int:
    """`other` (a Generation) has `reference`'s tokens, and log-probs within `logprob_atol`, on every
    sample up to its first differing token, which must then be a near-tie of the reference's
    distribution at that position (its keyed draw when seeded). Returns the number of such samples."""
    ids = list(range(len(prompts))) if sample_ids is None else sample_ids
    differing = 0
    for i, (prompt, expected, got) in enumerate(zip(prompts, reference.tokens, other.tokens)):
        same = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        torch.testing.assert_close(torch.tensor(other.logprobs[i][:same]), torch.tensor(reference.logprobs[i][:same]),
                                   atol=logprob_atol, rtol=0, msg=f"sample {i}: log-probs")
        if expected == got:
            continue
        assert same < min(len(expected), len(got)), f"sample {i}: one response is a prefix of the other"
        uniform = None
        if not mode.greedy:
            uniform = float(keyed_uniform(seed, torch.tensor([ids[i]]), torch.tensor([same]))[0])
        logits = next_token_logits(model, prompt, expected[:same])
        assert near_tie(logits, mode, uniform), f"sample {i} differs at token {same} without a near-tie"
        differing += 1
    return differing
