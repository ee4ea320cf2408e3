"""The decoder forward pass over `DecodeWeights` and a slotted KV cache.

Each sequence owns one row ("slot") of the cache, `max_length` positions long. Prefill runs the
right-padded prompts through every layer at once and writes their keys/values to positions
0..len-1; a decode step feeds one token per slot at its own position, writes its key/value there
and attends to the positions before it, reading only the first `span` positions of the cache (a
bound the caller chooses to cover every slot's position). Shapes never depend on the data, so a
decode step can be captured as a CUDA graph (one per span).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlscale.rollout.weights import DecodeWeights, LayerWeights, ModelShape

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's Llama/Qwen RMSNorm computes it (fp32 statistics, weight in model dtype)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split convention; cos/sin broadcast over the head axis."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Per layer: keys and values [slots, kv_heads, max_length, head_dim] (attention's own layout)."""

    def __init__(self, shape: ModelShape, slots: int, max_length: int, device, dtype):
        size = (slots, shape.num_kv_heads, max_length, shape.head_dim)
        # zeroed, not empty: masked-out positions still enter the attention product, and 0 * NaN
        # from uninitialised memory would poison every row
        self.keys = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.num_layers)]
        self.slots, self.max_length = slots, max_length


def rotary_table(source_model, max_length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..max_length-1 from the model's own rotary module (any rope scaling)."""
    rotary = source_model.model.rotary_emb
    positions = torch.arange(max_length, device=rotary.inv_freq.device)[None]
    probe = torch.empty(0, device=rotary.inv_freq.device, dtype=dtype)
    cos, sin = rotary(probe, positions)
    return cos[0].to(device=device, dtype=dtype), sin[0].to(device=device, dtype=dtype)


class DecoderForward:
    """Prefill and decode over the engine's weights; no Python state between calls besides the cache."""

    def __init__(self, weights: DecodeWeights, cos: torch.Tensor, sin: torch.Tensor, decode_attention: str = "sdpa"):
        self.w, self.s = weights, weights.shape
        self.cos, self.sin = cos, sin
        self.act = ACTIVATIONS[self.s.hidden_act]
        if decode_attention not in ("sdpa", "matmul"):
            raise ValueError(f"decode_attention must be sdpa or matmul, not {decode_attention!r}")
        self.decode_attention = decode_attention

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
        """x [..., hidden] -> q [..., H, D], k and v [..., Hkv, D], rotated at `positions` [...]."""
        s = self.s
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[..., :q_width].unflatten(-1, (s.num_heads, s.head_dim))
        k = qkv[..., q_width:q_width + kv_width].unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = qkv[..., q_width + kv_width:].unflatten(-1, (s.num_kv_heads, s.head_dim))
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, s.rms_eps)
            k = rms_norm(k, layer.k_norm, s.rms_eps)
        cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _block_tail(self, layer: LayerWeights, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + F.linear(attn, layer.o, layer.o_bias)
        gate, up = F.linear(rms_norm(h, layer.post_norm, self.s.rms_eps), layer.gate_up).chunk(2, dim=-1)
        return h + F.linear(self.act(gate) * up, layer.down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(h, self.w.final_norm, self.s.rms_eps), self.w.lm_head)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache, slot0: int) -> torch.Tensor:
        """Right-padded prompts [B, T] into cache slots slot0..slot0+B-1; returns the logits
        at each prompt's last token [B, vocab]."""
        batch, width = tokens.shape
        positions = torch.arange(width, device=tokens.device).expand(batch, width)
        h = F.embedding(tokens, self.w.embed)
        for i, layer in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, rms_norm(h, layer.input_norm, self.s.rms_eps), positions)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            cache.keys[i][slot0:slot0 + batch, :, :width] = k
            cache.values[i][slot0:slot0 + batch, :, :width] = v
            # causal attention suffices with right padding: real tokens never see the padding
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, enable_gqa=self.s.num_heads != self.s.num_kv_heads)
            h = self._block_tail(layer, h, attn.transpose(1, 2).flatten(-2))
        last = h[torch.arange(batch, device=h.device), lengths - 1]
        return self.logits(last)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               span: int | None = None) -> torch.Tensor:
        """One token per slot [B] at `positions` [B] -> next-token logits [B, vocab].

        Attention reads cache positions 0..span-1 only (default: the whole cache); every position
        must be below `span`, or that slot would not see its own key. Not checked here: it would
        take a host sync per step.
        """
        s = self.s
        batch = tokens.shape[0]
        span = cache.max_length if span is None else span
        slots = torch.arange(batch, device=tokens.device)
        group = s.num_heads // s.num_kv_heads
        # slot b attends to its positions 0..positions[b]
        visible = (torch.arange(span, device=tokens.device) <= positions[:, None])[:, None, None, :]
        h = F.embedding(tokens, self.w.embed)
        for i, layer in enumerate(self.w.layers):
            q, k, v = self._qkv(layer, rms_norm(h, layer.input_norm, s.rms_eps), positions)
            keys, values = cache.keys[i][:batch], cache.values[i][:batch]
            keys[slots, :, positions] = k
            values[slots, :, positions] = v
            keys, values = keys[:, :, :span], values[:, :, :span]
            # the query heads sharing a kv head act as that head's "query positions": no kv repeat
            q = q.unflatten(1, (s.num_kv_heads, group))  # [B, Hkv, G, D]
            if self.decode_attention == "sdpa":
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
            else:  # plain batched matmuls; torch.compile fuses the mask and softmax between them
                scores = (q @ keys.transpose(-1, -2)).float() * s.head_dim ** -0.5
                probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(values.dtype)
                attn = probs @ values
            h = self._block_tail(layer, h, attn.flatten(1))
        return self.logits(h)
