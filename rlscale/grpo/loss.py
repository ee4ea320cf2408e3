"""Clipped policy loss with a k3 KL penalty, per token; the caller chooses the normaliser."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossTerms:
    """Per-token terms, each [batch, tokens]; multiply by the mask before reducing."""

    loss: torch.Tensor  # policy-gradient loss + beta * kl
    kl: torch.Tensor  # k3 estimate of KL(policy || reference)
    clipped: torch.Tensor  # 1.0 where the clipped branch was taken
    ratio: torch.Tensor  # pi / pi_old


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
) -> LossTerms:
    """PPO-style clipped surrogate, negated for minimisation.

    logprobs, old_logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens.
    advantages: [B] (one per sequence) or [B, T].
    ratio clipped to [1 - clip_low, 1 + clip_high] (asymmetric clipping allowed);
    k3 KL = exp(ref - logp) - (ref - logp) - 1, non-negative and unbiased (Schulman).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * advantages
    pg_loss = -torch.minimum(unclipped, clipped)
    took_clip = (clipped < unclipped).float()
    if ref_logprobs is not None and kl_beta > 0:
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1.0
    else:
        kl = torch.zeros_like(logprobs)
    return LossTerms(loss=pg_loss + kl_beta * kl, kl=kl, clipped=took_clip, ratio=ratio)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target token, and optionally the entropy, from logits.

    logits: [B, T, V] (any dtype); targets: [B, T] long. Works in chunks of rows so that the
    float32 log-softmax of the whole batch is never materialised at once.
    """
    batch, steps, vocab = logits.shape
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1)
    pieces_lp, pieces_ent = [], []
    for start in range(0, max(flat_logits.shape[0], 1), chunk):
        rows = flat_logits[start:start + chunk].float()
        logz = torch.logsumexp(rows, dim=-1)
        picked = rows.gather(-1, flat_targets[start:start + chunk, None]).squeeze(-1)
        pieces_lp.append(picked - logz)
        if with_entropy:
            probs = torch.softmax(rows, dim=-1)
            pieces_ent.append(logz - (probs * rows).sum(-1))
    logprobs = torch.cat(pieces_lp).view(batch, steps)
    entropy = torch.cat(pieces_ent).view(batch, steps) if with_entropy else None
    return logprobs, entropy
