"""Attention for packed rows (several documents in one row), registered with transformers.

`use_packed_attention(model)` switches a Hugging Face decoder (Qwen2, Llama, ...) to the
attention implementation "rlscale_packed". Called as usual (no `cu_seq_lens_q` keyword) it is
exactly transformers' SDPA attention, masks included, so generation is unaffected. Called with
`cu_seq_lens_q` / `max_length_q` (document boundaries of a packed row, batch size 1) and no
attention mask, each document attends causally to itself only, through one of:

- "varlen": torch.nn.attention.varlen_attn, FlashAttention over cumulative sequence lengths
  (CUDA, bf16/fp16). No mask is materialised and no work is spent on cross-document blocks;
  SDPA's flash kernel cannot take a block-diagonal mask, and its mask-taking kernels
  (memory-efficient, math) would compute the full T×T square of the packed row.
- "sdpa": one causal SDPA call per document (any device; exact, the choice on CPU).

"auto" takes varlen where it is available, else sdpa.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

NAME = "rlscale_packed"
BACKENDS = ("auto", "varlen", "sdpa")
_ATTR = "_rlscale_attention_backend"  # set on every submodule of a switched model


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    if choice not in BACKENDS:
        raise ValueError(f"attention backend {choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "auto":
        return "varlen" if varlen_available(device, dtype) else "sdpa"
    if choice == "varlen" and not varlen_available(device, dtype):
        raise ValueError("attention backend 'varlen' needs CUDA, bf16/fp16 weights and torch.nn.attention.varlen")
    return choice


_VARLEN_OPTIONS: dict = {}  # how this torch's varlen_attn spells causal/GQA/scale, read once


def _varlen_options() -> dict:
    if not _VARLEN_OPTIONS:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        _VARLEN_OPTIONS.update(
            causal={"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True},
            gqa="enable_gqa" in params, scale="scale" in params)
    return _VARLEN_OPTIONS


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> [1, T, H, D]."""
    from torch.nn.attention.varlen import varlen_attn

    options = _varlen_options()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, D]
    extra = dict(options["causal"])
    if options["scale"]:
        extra["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn has no scale argument; the model needs a non-default one")
    if q.shape[1] != k.shape[1]:
        if options["gqa"]:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **extra)
    return out.unsqueeze(0)


@torch.compiler.disable  # data-dependent splits: compiled, it would recompile per document count
def _sdpa_per_document(query, key, value, cu_seqlens, scaling):
    # split, not one slice per document: a slice's backward writes its gradient into a zeroed
    # tensor of the whole row (documents × row length), a split's backward concatenates once
    lengths = torch.diff(cu_seqlens).tolist()
    gqa = query.shape[1] != key.shape[1]
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed attention takes one packed row and no attention mask")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention does not implement sliding-window layers")
    if dropout:
        raise ValueError("packed attention does not implement attention dropout")
    if getattr(module, _ATTR, "sdpa") == "varlen":
        return _varlen(query, key, value, cu_seqlens, kwargs["max_length_q"], scaling), None
    return _sdpa_per_document(query, key, value, cu_seqlens, scaling), None


def _packed_mask(*args, **kwargs):
    """The SDPA mask, except in packed calls (no padding mask given): the attention needs none,
    and transformers would otherwise build a dense T×T block-diagonal mask from the positions."""
    from transformers.masking_utils import sdpa_mask

    given = inspect.signature(sdpa_mask).bind_partial(*args, **kwargs).arguments
    if given.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention_forward)
    AttentionMaskInterface.register(NAME, _packed_mask)


def use_packed_attention(model, backend: str = "auto", device: torch.device | None = None,
                         dtype: torch.dtype | None = None) -> str:
    """Switch `model` (a transformers PreTrainedModel) to packed-capable attention; returns the
    backend chosen for packed rows. `device` and `dtype` are where and in what the forward will
    compute, by default those of the model's first parameter: pass them where the parameters are
    not (fp32 master weights computing in bf16, a model still on the meta device)."""
    weight = next(model.parameters())
    backend = resolve_backend(backend, device or weight.device, dtype or weight.dtype)
    if backend == "varlen":
        _varlen_options()
    register()
    for submodule in model.modules():
        setattr(submodule, _ATTR, backend)
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError):  # a transformers that checks names against its own list
        model.config._attn_implementation = NAME
    return backend


def packed_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """Keyword arguments for a model forward over one packed row (the flash-attention names
    transformers forwards down to every attention layer)."""
    return dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen)
