"""Logprobs of a packed micro-batch straight from a transformers model's LM head.

The head is patched once per model (`packed_logprobs` does it at the first call): while a request
is pending on it (the `_REQUEST` attribute, set for the length of one forward), it returns the
targets' chunked logprobs (rlscale.grpo.loss.linear_logprobs) instead of full-vocabulary logits;
otherwise it is the plain linear layer, so `generate` and other callers see nothing different.
A packed micro-batch is rlscale.workers.packing.PackedMicroBatch: one row of whole samples with
`input_ids`, `position_ids`, `cu_seqlens`, `max_seqlen` (rlscale.models.packed_attention), the
response positions `logit_index` and their next tokens `targets`.
"""

from __future__ import annotations

import torch

from rlscale.grpo.loss import linear_logprobs, linear_logprobs_loss
from rlscale.models.packed_attention import packed_kwargs

_REQUEST = "_rlscale_logprob_request"


def _install_logprob_head(head) -> None:
    """Let the LM head return chunked logprobs instead of logits when a request is pending.

    The head runs inside the model's own forward, so FSDP2 has its weight gathered there and
    treats the result as the forward's output; parameter names and tying are untouched.
    """
    if getattr(head, "bias", None) is not None:
        raise ValueError("packed logprobs assume an LM head without bias")
    linear_forward = type(head).forward

    def forward(hidden):
        request = getattr(head, _REQUEST, None)
        if request is None:
            return linear_forward(head, hidden)
        targets, with_entropy, chunk, compiled, token_loss = request
        if token_loss is None:
            logprobs, entropy = linear_logprobs(hidden[0], head.weight, targets, with_entropy, chunk, compiled)
            columns = [logprobs]
        else:
            logprobs, entropy, losses = linear_logprobs_loss(hidden[0], head.weight, targets, token_loss,
                                                             with_entropy, chunk, compiled)
            columns = [logprobs, losses]
        columns.append(entropy if with_entropy else torch.zeros_like(logprobs))
        return torch.stack([column[None] for column in columns], -1)  # [1, R, columns], a fresh tensor (no view)

    head.forward = forward
    setattr(head, _REQUEST, None)


def packed_logprobs(model, mb, with_entropy: bool = False, chunk: int = 2048,
                    compiled: bool = False, token_loss=None):
    """Logprobs [R] (and entropy, reported only) of the response tokens of one packed micro-batch.

    `logits_to_keep` hands the head only the response positions; the head computes their
    log-softmax `chunk` rows at a time (rlscale.grpo.loss.linear_logprobs). With token_loss
    (see rlscale.grpo.loss.linear_logprobs_loss), (logprobs, entropy, per-token losses): the
    losses carry the gradient, taken in the head's forward.
    """
    head = model.get_output_embeddings()
    if not hasattr(head, _REQUEST):
        _install_logprob_head(head)
    setattr(head, _REQUEST, (mb.targets, with_entropy, chunk, compiled, token_loss))
    try:
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                    logits_to_keep=mb.logit_index, **packed_kwargs(mb.cu_seqlens, mb.max_seqlen)).logits[0]
    finally:
        setattr(head, _REQUEST, None)
    entropy = out[:, -1] if with_entropy else None
    return (out[:, 0], entropy) if token_loss is None else (out[:, 0], entropy, out[:, 1])
