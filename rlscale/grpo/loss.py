"""Clipped policy loss with a KL penalty (k1, k2 or k3), per token; the caller chooses the normaliser.

Variants (docs/training.md): GSPO's sequence-level ratio (`sequence_level`), the sampler/trainer
mismatch correction of NeMo-RL (`importance_weights`, passed in as `is_weights`), and NeMo-RL's
KL estimators and clamps (`kl_estimate`). With the defaults the loss is GRPO's with the k3 KL,
the same arithmetic as before these variants existed.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch

KL_TYPES = ("k1", "k2", "k3")
IS_TYPES = ("tis", "icepop", "seq-mask-tis")


@dataclass
class LossTerms:
    """Per-token terms, each [batch, tokens]; multiply by the mask before reducing."""

    loss: torch.Tensor  # is_weight * policy-gradient loss + beta * kl
    kl: torch.Tensor  # estimate of KL(policy || reference) (kl_type)
    clipped: torch.Tensor  # 1.0 where the clipped branch was taken
    ratio: torch.Tensor  # pi / pi_old (GSPO: the sequence's, on each of its tokens)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3",
                input_clamp: float | None = None, output_clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' logprobs (Schulman,
    http://joschu.net/blog/kl-approx.html), NeMo-RL's calculate_kl: with r = ref - logp,
    k1 = -r, k2 = r²/2, k3 = exp(r) - r - 1; input_clamp clamps r to [-c, c] first,
    output_clamp the estimate to [-c, c] after (None: no clamp)."""
    log_ratio = ref_logprobs - logprobs
    if input_clamp is not None:
        log_ratio = log_ratio.clamp(-input_clamp, input_clamp)
    if kl_type == "k3":
        kl = torch.exp(log_ratio) - log_ratio - 1.0
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k1":
        kl = -log_ratio
    else:
        raise ValueError(f"kl_type={kl_type!r}: expected one of {', '.join(KL_TYPES)}")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def masked_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1]: each row's mean over its masked tokens (0 for a row without one)."""
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_beta: float = 0.0,
    kl_type: str = "k3",
    kl_input_clamp: float | None = None,
    kl_output_clamp: float | None = None,
    sequence_level: bool = False,
    mask: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> LossTerms:
    """PPO-style clipped surrogate, negated for minimisation.

    logprobs, old_logprobs, ref_logprobs: [B, T] log-probabilities of the sampled tokens.
    advantages: [B] (one per sequence) or [B, T].
    ratio clipped to [1 - clip_low, 1 + clip_high] (asymmetric clipping allowed);
    KL: `kl_estimate` (k3 by default: exp(ref - logp) - (ref - logp) - 1, non-negative, unbiased).
    sequence_level (GSPO, arXiv 2507.18071): the ratio of every token of row i is
    s_i = exp(mean over the row's masked tokens of (logp - old)), gradient flowing through the
    mean, and clipped as a whole; needs `mask` [B, T] (1 on response tokens).
    is_weights: detached per-token (or [B, 1]) weights multiplying the policy-gradient term,
    not the KL (the sampler/trainer correction, see `importance_weights`).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if sequence_level:
        if mask is None:
            raise ValueError("grpo_token_loss: sequence_level needs the response mask")
        ratio = torch.exp(masked_sequence_mean(logprobs - old_logprobs, mask)).expand_as(logprobs)
    else:
        ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * advantages
    pg_loss = -torch.minimum(unclipped, clipped)
    took_clip = (clipped < unclipped).float()
    if is_weights is not None:
        pg_loss = is_weights * pg_loss
    if ref_logprobs is not None and kl_beta > 0:
        kl = kl_estimate(logprobs, ref_logprobs, kl_type, kl_input_clamp, kl_output_clamp)
    else:
        kl = torch.zeros_like(logprobs)
    return LossTerms(loss=pg_loss + kl_beta * kl, kl=kl, clipped=took_clip, ratio=ratio)


@dataclass
class ImportanceWeights:
    """The sampler/trainer correction of one batch, all detached, each [B, T] (or [B, 1] at the
    sequence level): `weights` multiply the policy-gradient term; `raw` is pi_old / pi_sampler
    before truncation; `kept` is 1.0 where the weight was left as it is (0.0: truncated or masked)."""

    weights: torch.Tensor
    raw: torch.Tensor
    kept: torch.Tensor


def importance_weights(old_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor | None = None,
                       kind: str | None = None, ratio_max: float | None = None, ratio_min: float | None = None,
                       sequence_level: bool = False) -> ImportanceWeights:
    """NeMo-RL's correction for the mismatch between the sampler's logprobs (gen) and the trainer's
    (old, pi_old), ClippedPGLossFn's `use_importance_sampling_correction`:
    per token w = exp(old - gen); with sequence_level (GSPO) one weight per row,
    exp(sum over its masked tokens of (old - gen)); inf / nan become 0. With ratio_max (NeMo-RL's
    truncated_importance_sampling_ratio) and kind (truncated_importance_sampling_type):
      tis:          w = min(w, ratio_max);
      icepop:       w = 0 where w is outside [ratio_min, ratio_max];
      seq-mask-tis: a row's every w = 0 where the row's geometric mean exp(mean(old - gen)) is
                    outside [ratio_min, ratio_max]; the kept rows' token weights are not truncated.
    mask [B, T]: response tokens (needed at the sequence level and by seq-mask-tis)."""
    with torch.no_grad():
        diff = old_logprobs - gen_logprobs
        if sequence_level:
            raw = torch.exp((diff * mask).sum(-1, keepdim=True))
        else:
            raw = torch.exp(diff)
        raw = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)
        kept = torch.ones_like(raw)
        weights = raw
        if ratio_max is not None:
            if kind == "tis":
                weights = raw.clamp(max=ratio_max)
                kept = (raw <= ratio_max).to(raw.dtype)
            elif kind == "icepop":
                kept = ((raw >= ratio_min) & (raw <= ratio_max)).to(raw.dtype)
                weights = raw * kept
            elif kind == "seq-mask-tis":
                log_ratio = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
                geo = torch.exp(masked_sequence_mean(log_ratio, mask))
                kept = ((geo >= ratio_min) & (geo <= ratio_max)).to(raw.dtype).expand_as(raw)
                weights = raw * kept
            else:
                raise ValueError(f"importance_weights: kind={kind!r}, expected one of {', '.join(IS_TYPES)}")
        return ImportanceWeights(weights=weights, raw=raw, kept=kept)


def loss_weights(mode: str, response_lengths: torch.Tensor, global_tokens: float, global_samples: float,
                 scale: float | None = None) -> torch.Tensor:
    """Each token's weight in the loss, per sample [B] (broadcast over its tokens): how the
    per-token terms of a global batch of `global_samples` sequences and `global_tokens` response
    tokens are reduced to one number (verl's loss_agg_mode names):
      token-mean:              1 / global_tokens (every token counts the same);
      seq-mean-token-mean:     1 / (length · global_samples) (a mean per sequence, then over them);
      seq-mean-token-sum-norm: 1 / (scale · global_samples), scale a constant (Dr. GRPO, arXiv
                               2503.20783: no length bias; TRL's loss_type="dr_grpo" with scale =
                               max_completion_length)."""
    if mode == "token-mean":
        return torch.full(response_lengths.shape, 1.0 / global_tokens, dtype=torch.float32)
    if mode == "seq-mean-token-mean":  # lengths of at least 1 (the caller's clamp)
        return 1.0 / (response_lengths * global_samples)
    if mode == "seq-mean-token-sum-norm":
        if not scale or scale <= 0:
            raise ValueError("loss_weights: seq-mean-token-sum-norm needs a positive scale")
        return torch.full(response_lengths.shape, 1.0 / (scale * global_samples), dtype=torch.float32)
    raise ValueError(f"loss_weights: unknown mode {mode!r}")


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
    acc = torch.promote_types(logits.dtype, torch.float32)
    pieces_lp, pieces_ent = [], []
    for start in range(0, max(flat_logits.shape[0], 1), chunk):
        lp, _, ent = _chunk_forward(flat_logits[start:start + chunk], flat_targets[start:start + chunk],
                                    with_entropy, acc)
        pieces_lp.append(lp)
        if with_entropy:
            pieces_ent.append(ent)
    logprobs = torch.cat(pieces_lp).view(batch, steps)
    entropy = torch.cat(pieces_ent).view(batch, steps) if with_entropy else None
    return logprobs, entropy


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, acc: torch.dtype):
    """Target logprob, log-partition and (optionally) entropy of rows of logits, in `acc` precision."""
    z = logits.to(acc)
    logz = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = logz - (torch.exp(z - logz[:, None]) * z).sum(-1) if with_entropy else None
    return logprobs, logz, entropy


def _chunk_forward_fused(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, acc: torch.dtype):
    """`_chunk_forward` for torch.compile: the entropy reuses the log-partition's exponentials,
    entropy = log Σe − Σ e·(z − max) / Σe with e = exp(z − max), so the compiled kernel reads the
    logits twice (the max, then both sums) where the eager form's entropy is a third pass over
    them (on an H200, 401 against 567 µs per 2048 × 151,936 chunk). Not bit-identical to the
    eager form: its logsumexp and entropy sum in a different order."""
    z = logits.to(acc)
    top = z.amax(-1, keepdim=True)
    shifted = z - top
    mass = shifted.exp()
    total = mass.sum(-1)
    log_total = total.log()
    logz = top.squeeze(-1) + log_total
    logprobs = z.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = log_total - (mass * shifted).sum(-1) / total if with_entropy else None
    return logprobs, logz, entropy


def _softmax_grad(logits: torch.Tensor, logz: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The -grad · softmax(logits) part of the chunk gradient, in logz's precision."""
    return torch.exp(logits.to(logz.dtype) - logz[:, None]) * -grad[:, None]


def _chunk_grad(logits: torch.Tensor, logz: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """d(sum grad · logprob[target]) / d logits = grad · (onehot(target) - softmax(logits)).
    targets must be valid token ids (the forward's gather has checked them)."""
    return _softmax_grad(logits, logz, grad).scatter_add_(-1, targets[:, None], grad[:, None]).to(out_dtype)


def _chunk_grad_pointwise(logits: torch.Tensor, logz: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """`_chunk_grad` with the one-hot term as a comparison instead of a scatter, for torch.compile:
    compiled, the whole gradient is one pointwise pass over the logits that writes `out_dtype`
    (a scatter splits it into three full-size passes). The same additions, so the same bits when
    run eagerly (compiled code may fuse a multiply and an add, old and new alike); eager, it would
    hold two more [N, V] temporaries than the in-place scatter, which is why eager code uses that."""
    softmax_part = _softmax_grad(logits, logz, grad)
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    return torch.where(is_target, softmax_part + grad[:, None], softmax_part).to(out_dtype)


# torch.addmm's out_dtype (bf16 inputs, float32 output) is CUDA-only and arrived in torch 2.8
_ADDMM_OUT_DTYPE = torch.__version__ >= "2.8"


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b in acc's precision (the head's float32 grad_weight over bf16 chunks); use the
    result, which on CUDA is a new tensor. There cuBLAS adds the product straight into float32
    (addmm with out_dtype); elsewhere the product is rounded to the inputs' dtype, then added in place."""
    if acc.is_cuda and acc.dtype != a.dtype and _ADDMM_OUT_DTYPE:
        return torch.addmm(acc, a, b, out_dtype=acc.dtype)
    return acc.add_(a @ b)


def _compile(fn):
    return torch.compile(fn, dynamic=False)


def _own_code(fn):
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _by_rows(fn, rows: int):
    """`fn` compiled twice, the vocabulary static in both: with static shapes for chunks of `rows`
    rows (all but a call's last), and with the row count symbolic (marked dynamic) for other
    counts, one compilation whatever they are. Compiled with dynamic=True the vocabulary is
    symbolic too, and every element's index arithmetic divides by a runtime value, which made both
    chunk kernels 2-3× slower on an H200 (the gradient 935 against 335 µs per 2048 × 151,936 chunk,
    bench/results); automatic dynamic shapes would recompile per storage offset of the sliced
    arguments and could turn the vocabulary symbolic too."""
    # each its own copy of the code: dynamo keeps compiled entries and their limit per code object
    full, other = _compile(_own_code(fn)), _compile(_own_code(fn))

    def run(logits: torch.Tensor, *args):
        if logits.shape[0] == rows:
            return full(logits, *args)
        for tensor in (logits, *args):
            if isinstance(tensor, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return other(logits, *args)

    return run


_COMPILED: dict[int, tuple] = {}  # chunk rows -> (forward, gradient), compiled once per process


def _kernels(compiled: bool, chunk: int):
    """The chunk functions, or their torch.compile'd versions (built once per chunk size): fused,
    they read each chunk's logits once or twice instead of once per elementwise step."""
    if not compiled:
        return _chunk_forward, _chunk_grad
    if chunk not in _COMPILED:
        _COMPILED[chunk] = (_by_rows(_chunk_forward_fused, chunk), _by_rows(_chunk_grad_pointwise, chunk))
    return _COMPILED[chunk]


class _LinearLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[target] in chunks of rows; see `linear_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, with_entropy, compiled):
        chunk_forward, _ = _kernels(compiled, chunk)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
        logprobs = hidden.new_empty(hidden.shape[0], dtype=acc)
        entropy = hidden.new_empty(hidden.shape[0], dtype=acc) if with_entropy else None
        logz = hidden.new_empty(hidden.shape[0], dtype=acc)
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            lp, lz, ent = chunk_forward(hidden[start:stop] @ weight.T, targets[start:stop], with_entropy, acc)
            logprobs[start:stop], logz[start:stop] = lp, lz
            if with_entropy:
                entropy[start:stop] = ent
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.chunk, ctx.compiled = chunk, compiled
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logz = ctx.saved_tensors
        _, chunk_grad = _kernels(ctx.compiled, ctx.chunk)
        grad_logprobs = grad_logprobs.to(logz.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # a [V, d] float32 accumulator: summing per-chunk bf16 products would round each time
        grad_weight = torch.zeros(weight.shape, dtype=logz.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = start + ctx.chunk
            rows = hidden[start:stop]
            grad_logits = chunk_grad(rows @ weight.T, logz[start:stop], grad_logprobs[start:stop],
                                     targets[start:stop], hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight = _add_product(grad_weight, grad_logits.T, rows)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


class _LinearLogprobsLoss(torch.autograd.Function):
    """`linear_logprobs` and a per-token loss of the logprobs, its gradient taken in the forward;
    see `linear_logprobs_loss`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_loss, chunk, with_entropy, compiled):
        chunk_forward, chunk_grad = _kernels(compiled, chunk)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        rows_total = hidden.shape[0]
        logprobs = hidden.new_empty(rows_total, dtype=acc)
        entropy = hidden.new_empty(rows_total, dtype=acc) if with_entropy else None
        losses = hidden.new_empty(rows_total, dtype=acc)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for start in range(0, rows_total, chunk):
            part = slice(start, start + chunk)
            rows = hidden[part]
            logits = rows @ weight.T
            lp, logz, ent = chunk_forward(logits, targets[part], with_entropy, acc)
            with torch.enable_grad():  # the loss of this chunk's logprobs, and d loss / d logprobs
                lp_leaf = lp.detach().requires_grad_()
                loss = token_loss(lp_leaf, part)
                (grad_lp,) = torch.autograd.grad(loss.sum(), lp_leaf)
            logprobs[part], losses[part] = lp, loss.detach()
            if with_entropy:
                entropy[part] = ent
            grad_logits = chunk_grad(logits, logz, grad_lp.to(acc), targets[part], hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[part] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight = _add_product(grad_weight, grad_logits.T, rows)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(*(t for t in (logprobs, entropy) if t is not None))
        return logprobs, entropy, losses

    @staticmethod
    def backward(ctx, _grad_logprobs, _grad_entropy, grad_losses):
        grad_hidden, grad_weight = ctx.saved_tensors
        # what the forward stored is the gradient of losses.sum(): the upstream must be all ones
        # (an async check: no host sync on CUDA)
        torch._assert_async((grad_losses == 1).all(), "linear_logprobs_loss: backpropagate losses.sum()")
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_logprobs_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    token_loss: Callable[[torch.Tensor, slice], torch.Tensor], with_entropy: bool = False,
    chunk: int = 2048, compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`linear_logprobs` fused with a loss made of per-token terms: (logprobs, entropy, losses).

    token_loss(logprobs[part], part) -> the loss terms of those tokens (a pure, elementwise
    function of each token's logprob: GRPO's clipped surrogate and KL are). Its gradient is taken
    chunk by chunk in the forward, while the chunk's logits exist, so the backward only hands back
    what the forward stored: the LM head runs one matmul per chunk fewer than differentiating
    `linear_logprobs` (which recomputes the logits in its backward). logprobs and entropy come
    without gradient; backpropagate `losses.sum()` (a checked requirement).
    """
    return _LinearLogprobsLoss.apply(hidden, weight, targets, token_loss, chunk, with_entropy, compiled)


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
    chunk: int = 2048, compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each target under softmax(hidden @ weight.T), never holding more than
    `chunk` rows of full-vocabulary logits.

    hidden: [N, d] (the final hidden states at the positions to score); weight: [V, d] (the LM
    head); targets: [N] long. Returns float32 (float64 for float64 inputs) logprobs [N] and,
    when asked, the entropy [N] (reported only: no gradient flows through it). The backward
    recomputes each chunk's logits instead of keeping them, so the head's memory is O(N·d) plus
    one chunk, not O(N·V). compiled: fuse the per-chunk softmax arithmetic with torch.compile.
    """
    return _LinearLogprobs.apply(hidden, weight, targets, chunk, with_entropy, compiled)
