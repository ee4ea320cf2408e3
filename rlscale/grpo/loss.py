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


class _LinearLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] in chunks of rows; see `linear_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, with_entropy):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
        logprobs = hidden.new_empty(hidden.shape[0], dtype=acc)
        entropy = hidden.new_empty(hidden.shape[0], dtype=acc) if with_entropy else None
        logz = hidden.new_empty(hidden.shape[0], dtype=acc)
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            logits = (hidden[start:stop] @ weight.T).to(acc)
            logz[start:stop] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, targets[start:stop, None]).squeeze(-1)
            logprobs[start:stop] = picked - logz[start:stop]
            if with_entropy:
                probs = torch.exp(logits - logz[start:stop, None])
                entropy[start:stop] = logz[start:stop] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.chunk = chunk
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logz = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # a [V, d] float32 accumulator: summing per-chunk bf16 products would round each time
        grad_weight = torch.zeros(weight.shape, dtype=logz.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            rows = hidden[start:stop]
            # d logp[target] / d logits = onehot(target) - softmax(logits)
            logits = (rows @ weight.T).to(logz.dtype)
            grad_logits = torch.exp(logits - logz[start:stop, None]).mul_(-grad_logprobs[start:stop, None])
            grad_logits.scatter_add_(-1, targets[start:stop, None], grad_logprobs[start:stop, None])
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.add_(grad_logits.T @ rows)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
    chunk: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target under softmax(hidden @ weight.T), never holding more than
    `chunk` rows of full-vocabulary logits.

    hidden: [N, d] (the final hidden states at the positions to score); weight: [V, d] (the LM
    head); targets: [N] long. Returns float32 (float64 for float64 inputs) logprobs [N] and, when asked, the entropy [N]
    (reported only: no gradient flows through it). The backward recomputes each chunk's logits
    instead of keeping them, so a micro-batch's memory for the head is O(N·d), not O(N·V).
    """
    return _LinearLogprobs.apply(hidden, weight, targets, chunk, with_entropy)
