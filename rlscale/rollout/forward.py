"""The decoder forward pass over `DecodeWeights` and a paged KV cache.

The cache is a pool of blocks of `block_size` positions (`KVCache`; which blocks a sequence holds
is `blocks.BlockPool`'s bookkeeping, mirrored on the device as a block table [slots, blocks per
sequence]). Prefill runs the right-padded prompts through every layer at once and writes their
keys/values to their blocks; a decode step feeds one token per slot at its own position, writes
its key/value into the block holding that position and attends to the positions up to it. Shapes
never depend on the data (the block table is a static buffer), so a decode step can be captured
as a CUDA graph. SDPA and matmul attention gather each slot's blocks into a row of the logical
length, masked per slot; flex attention (the compiled CUDA step's) reads the pool in place, only
the blocks each slot's table lists (`paged_block_mask`).

Each layer of a decode step is `decode_head` (norm, q/k/v, rotary, cache write), `decode_attend`
and `block_tail` (o projection, MLP, shared with prefill), the layer's weights passed as arguments
(`LayerWeights.head`, `LayerWeights.tail`).

Under tensor parallelism (the weights' `tp`, `tensor_parallel.py`) a rank computes its own heads
and intermediate slice: the embedding is all-reduced from each rank's vocabulary rows, o_proj's
and down_proj's partial sums are all-reduced, and the logits of each rank's vocabulary shard are
gathered, so every rank holds the same hidden states and full logits. Without tp none of these
ops exist: the code path is the single-device one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rlscale.rollout.weights import DecodeWeights, ModelShape

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# How a decode step attends over the cache: torch SDPA (cuDNN/efficient kernels), two batched
# matmuls, or flex attention (under torch.compile a Triton kernel that reads only the live cache
# blocks: 14.5 µs per layer call against SDPA's 32.5 µs in a 0.5B decode step on an H200, bench/results).
DECODE_ATTENTION = ("sdpa", "matmul", "flex")
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
    """Per layer: keys and values [kv_heads, (num_blocks + 1) × block_size, head_dim], block b at
    positions b·block_size.. of the middle axis; the last block is the scratch block (where
    positions no sequence owns write, `blocks.BlockPool.scratch`). `shape`: the rank's
    (`DecodeWeights.local_shape`), so kv_heads are its own under tensor parallelism."""

    def __init__(self, shape: ModelShape, num_blocks: int, block_size: int, device, dtype):
        size = (shape.num_kv_heads, (num_blocks + 1) * block_size, shape.head_dim)
        # zeroed, not empty: masked-out positions still enter the attention product, and 0 * NaN
        # from uninitialised memory would poison every row
        self.keys = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.num_layers)]
        self.values = [torch.zeros(size, device=device, dtype=dtype) for _ in range(shape.num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def sequence_bytes(shape: ModelShape, positions: int, dtype: torch.dtype) -> int:
        """The bytes of `positions` positions' keys and values, every layer (a block: block_size)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * shape.num_layers * shape.num_kv_heads * positions * shape.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def physical_positions(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where logical `positions` [B, ...] of each row's sequence sit in the pool: its block table
    row [B, blocks] maps position // block_size to a physical block."""
    flat = positions.reshape(positions.shape[0], -1)
    blocks = (flat // block_size).clamp(max=block_table.shape[1] - 1)
    return (block_table.gather(1, blocks) * block_size + flat % block_size).view(positions.shape)


def rotary_table(source_model, max_length: int, device, dtype,
                 rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..max_length-1 from the model's own rotary module (any rope scaling).
    rows (>= max_length): the table's length, the positions past max_length given the last one's
    angles; no live token sits there, and asking the module for them could rescale every angle
    (dynamic rope recomputes its frequencies past the model's trained length)."""
    rotary = source_model.model.rotary_emb
    positions = torch.arange(max_length, device=rotary.inv_freq.device)[None]
    probe = torch.empty(0, device=rotary.inv_freq.device, dtype=dtype)
    cos, sin = (t[0].to(device=device, dtype=dtype) for t in rotary(probe, positions))
    extra = (rows or max_length) - max_length
    if extra < 0:
        raise ValueError(f"rotary table of {rows} rows for max_length {max_length}")
    return torch.cat([cos, cos[-1:].expand(extra, -1)]), torch.cat([sin, sin[-1:].expand(extra, -1)])


FLEX_KV_BLOCK = 128  # cache positions per block of the flex block mask (flex attention's default)
# Triton options of the compiled flex decode kernel on Hopper-class GPUs (compute capability 9.0+,
# where they were measured; elsewhere flex chooses). On an H200 at the Qwen2-0.5B decode shape
# (256 slots, 2 kv heads × 7 grouped queries, head dim 64, live prefixes of 64..320 of 384
# positions) these took 13.6 µs per call where flex's defaults took 17.1 (24 calls in one CUDA
# graph, bench/decode_micro.py); the other BLOCK_N / warps / stages tried, split-KV and
# max-autotune were no faster. Given options replace flex's own candidates, max-autotune's too.
FLEX_DECODE_KERNEL_OPTIONS = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}


def default_flex_kernel_options(device: torch.device) -> dict:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return dict(FLEX_DECODE_KERNEL_OPTIONS)
    return {}


def paged_block_mask(block_table: torch.Tensor, block_logical: torch.Tensor, positions: torch.Tensor,
                     block_size: int, pool_positions: int, queries: int):
    """Flex attention block mask for a decode step over the pool [kv_heads, pool_positions, D]
    read in place: slot b ([B] `positions`, block table row [B, blocks]) sees its own blocks up to
    the one holding positions[b], listed in its table's order. The mask function alone says the
    same (eager flex attention reads only it, the compiled kernel both): a physical position is
    visible to slot b when its block is b's, at its logical index (`block_logical` [pool blocks]:
    each block's index in its owner's table), and its logical position is at most positions[b].
    From tensors only (no host sync): it lives inside the compiled step and the CUDA graph."""
    from torch.nn.attention.flex_attention import BlockMask

    slots, blocks = block_table.shape
    live = (positions // block_size + 1).clamp(max=blocks).view(slots, 1, 1)
    # the compiled kernel wants one column per block of the kv length (the pool's): the table's
    # blocks first, the unlisted rest zero (as torch's PagedAttention pads its converted mask).
    # Every block before a slot's last is full (the kernel skips the mask function there: it costs
    # two gathers a position); only the last, partly written, is masked.
    columns = pool_positions // block_size
    full = torch.zeros(slots, 1, 1, columns, dtype=torch.int32, device=block_table.device)
    full[..., :blocks] = block_table.to(torch.int32).view(slots, 1, 1, blocks)
    last = torch.zeros_like(full)
    last[..., :1] = block_table.gather(1, live.view(slots, 1) - 1).to(torch.int32).view(slots, 1, 1, 1)

    def within_sequence(b, h, q_idx, kv_idx):
        block = kv_idx // block_size
        logical = block_logical[block]
        owned = block_table[b, logical.clamp(max=blocks - 1)] == block
        return owned & (logical * block_size + kv_idx % block_size <= positions[b])

    return BlockMask.from_kv_blocks(torch.ones_like(live, dtype=torch.int32), last, (live - 1).to(torch.int32), full,
                                    BLOCK_SIZE=block_size, mask_mod=within_sequence,
                                    seq_lengths=(queries, pool_positions), compute_q_blocks=False)


class DecoderForward:
    """Prefill and decode over the engine's weights; no Python state between calls besides the cache."""

    def __init__(self, weights: DecodeWeights, cos: torch.Tensor, sin: torch.Tensor, decode_attention: str = "sdpa",
                 flex_kernel_options: dict | None = None):
        # the rank's heads, kv heads and intermediate size (the model's without tensor parallelism)
        self.w, self.s, self.tp = weights, weights.local_shape, weights.tp
        self.vocab_size, self.vocab_start = weights.shape.vocab_size, weights.slices.vocab.start
        self.cos, self.sin = cos, sin
        self.act = ACTIVATIONS[self.s.hidden_act]
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, not {decode_attention!r}")
        self.decode_attention = decode_attention
        # None = the tuned options above where they apply; {} = flex attention's own choice
        if flex_kernel_options is None:
            flex_kernel_options = default_flex_kernel_options(weights.embed.device)
        self.flex_kernel_options = flex_kernel_options

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor | None,
             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None):
        """x [..., hidden] -> q [..., H, D], k and v [..., Hkv, D], rotated at `positions` [...]."""
        s = self.s
        qkv = F.linear(x, qkv, qkv_bias)
        q_width, kv_width = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[..., :q_width].unflatten(-1, (s.num_heads, s.head_dim))
        k = qkv[..., q_width:q_width + kv_width].unflatten(-1, (s.num_kv_heads, s.head_dim))
        v = qkv[..., q_width + kv_width:].unflatten(-1, (s.num_kv_heads, s.head_dim))
        if q_norm is not None:
            q = rms_norm(q, q_norm, s.rms_eps)
            k = rms_norm(k, k_norm, s.rms_eps)
        cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def block_tail(self, h: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, o_bias: torch.Tensor | None,
                   post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """A layer after attention: o projection, residual, post-attention norm, gated MLP, residual.
        The layer's weights come as arguments (`LayerWeights.tail`)."""
        h = h + self._row_parallel(attn, o, o_bias)
        gate, up = F.linear(rms_norm(h, post_norm, self.s.rms_eps), gate_up).chunk(2, dim=-1)
        return h + self._row_parallel(self.act(gate) * up, down, None)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias) where, under tp, weight holds only this rank's input columns:
        the partial sums are all-reduced and the (whole) bias added once, after."""
        if self.tp is None:
            return F.linear(x, weight, bias)
        out = self.tp.all_reduce(F.linear(x, weight))
        return out if bias is None else out + bias

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under tp a lookup in this rank's vocabulary rows (zero for tokens
        outside them), all-reduced."""
        if self.tp is None:
            return F.embedding(tokens, self.w.embed)
        rows = self.w.embed.shape[0]
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= rows)
        h = F.embedding(local.clamp(0, rows - 1), self.w.embed).masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., vocab]; under tp each rank's shard gathered, the padding rows' logits dropped."""
        logits = F.linear(rms_norm(h, self.w.final_norm, self.s.rms_eps), self.w.lm_head)
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[..., :self.vocab_size]

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                block_table: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts [B, T] into the blocks of their slots' block table rows [B, blocks]
        (the padding's keys into the scratch block); returns the logits at each prompt's last token
        [B, vocab]."""
        batch, width = tokens.shape
        positions = torch.arange(width, device=tokens.device).expand(batch, width)
        scratch = cache.num_blocks * cache.block_size
        write_at = torch.where(positions < lengths[:, None],
                               physical_positions(block_table, positions, cache.block_size), scratch).flatten()
        h = self.embed(tokens)
        for i, layer in enumerate(self.w.layers):
            q, k, v = self._qkv(rms_norm(h, layer.input_norm, self.s.rms_eps), positions, *layer.head[1:])
            cache.keys[i][:, write_at] = k.flatten(0, 1).transpose(0, 1)
            cache.values[i][:, write_at] = v.flatten(0, 1).transpose(0, 1)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            # causal attention suffices with right padding: real tokens never see the padding
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, is_causal=True, enable_gqa=self.s.num_heads != self.s.num_kv_heads)
            h = self.block_tail(h, attn.transpose(1, 2).flatten(-2), *layer.tail)
        last = h[torch.arange(batch, device=h.device), lengths - 1]
        return self.logits(last)

    # ------------------------------------------------------------------ decode

    def decode_head(self, h: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, input_norm: torch.Tensor, qkv: torch.Tensor,
                    qkv_bias: torch.Tensor | None, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None) -> torch.Tensor:
        """A decode step's layer up to attention: input norm, q/k/v at `positions` [B], this step's
        key/value written in place into the layer's pool tensors `keys`/`values` at pool positions
        `write_at` [B]; returns q grouped by kv head, [B, Hkv, G, D]. The layer's weights come as
        arguments (`LayerWeights.head`), as in `block_tail`."""
        s = self.s
        q, k, v = self._qkv(rms_norm(h, input_norm, s.rms_eps), positions, qkv, qkv_bias, q_norm, k_norm)
        keys[:, write_at] = k.transpose(0, 1)
        values[:, write_at] = v.transpose(0, 1)
        # the query heads sharing a kv head act as that head's "query positions": no kv repeat
        return q.unflatten(1, (s.num_kv_heads, s.num_heads // s.num_kv_heads))

    def visible(self, positions: torch.Tensor, block_table: torch.Tensor, block_logical: torch.Tensor,
                cache: KVCache) -> tuple[torch.Tensor | BlockMask, torch.Tensor | None]:
        """What slot b may attend to, its positions 0..positions[b]: for flex attention a block
        mask over the pool listing only each slot's live blocks (the kernel reads them in place and
        skips the rest, in one graph for every length), else a mask [B, 1, 1, L] over its blocks
        gathered into a row of L = blocks × block_size positions, and the pool positions to gather [B, L]."""
        if self.decode_attention == "flex":
            return paged_block_mask(block_table, block_logical, positions, cache.block_size,
                                    cache.keys[0].shape[1], self.s.num_heads // self.s.num_kv_heads), None
        span = block_table.shape[1] * cache.block_size
        gather_at = physical_positions(block_table, torch.arange(span, device=positions.device).expand(
            positions.shape[0], span), cache.block_size)
        return (torch.arange(span, device=positions.device) <= positions[:, None])[:, None, None, :], gather_at

    def decode_attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      visible: torch.Tensor | BlockMask, gather_at: torch.Tensor | None) -> torch.Tensor:
        """q [B, Hkv, G, D] over the layer's pool (flex: in place; else each slot's blocks gathered
        from pool positions `gather_at` [B, L]) -> attention output [B, H * D]."""
        if gather_at is None:
            keys, values = keys[None], values[None]  # [1, Hkv, pool, D]: one pool for every slot
        else:
            keys, values = keys[:, gather_at].transpose(0, 1), values[:, gather_at].transpose(0, 1)
        if self.decode_attention == "sdpa":
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        elif self.decode_attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            attn = flex_attention(q, keys, values, block_mask=visible,
                                  kernel_options=(self.flex_kernel_options or None) if q.is_cuda else None)
        else:  # plain batched matmuls; torch.compile, when it covers them, fuses the mask and softmax
            scores = (q @ keys.transpose(-1, -2)).float() * self.s.head_dim ** -0.5
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(values.dtype)
            attn = probs @ values
        return attn.flatten(1)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, block_table: torch.Tensor,
               block_logical: torch.Tensor) -> torch.Tensor:
        """One token per slot [B] at `positions` [B] (each within its block table row [B, blocks])
        -> next-token logits [B, vocab]. block_logical [pool blocks + 1]: each block's index in its
        owner's table (flex attention's mask)."""
        write_at = physical_positions(block_table, positions, cache.block_size)
        visible, gather_at = self.visible(positions, block_table, block_logical, cache)
        h = self.embed(tokens)
        for i, layer in enumerate(self.w.layers):
            keys, values = cache.keys[i], cache.values[i]
            q = self.decode_head(h, positions, write_at, keys, values, *layer.head)
            h = self.block_tail(h, self.decode_attend(q, keys, values, visible, gather_at), *layer.tail)
        return self.logits(h)
