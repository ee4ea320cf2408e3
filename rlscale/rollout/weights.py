"""The engine's own copy of the policy weights, laid out for decoding.

q/k/v projections are fused into one matrix and gate/up into another, so a decode step runs two
matmuls where Hugging Face's modules run five. The tensors are allocated once; `sync_from`
copies the trainer's current weights into them in place, so captured CUDA graphs stay valid
across updates (weight sync without touching disk). `copy_named` is the same copy for a stream of
(name, full tensor) pairs, one FSDP unit at a time; under tensor parallelism each rank keeps only
its slice of every tensor (`tensor_parallel.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from rlscale.rollout.tensor_parallel import TensorParallel, rank_slices

# Decoder-only families with the Llama block: RMSNorm, rotary attention (optionally q/k norms and
# q/k/v biases), gated MLP. Others fall back to Hugging Face generate.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    hidden_act: str
    tied_embeddings: bool

    @property
    def kv_values_per_token(self) -> int:
        """Keys and values cached per token, over all layers (multiply by the dtype's size for bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def unsupported_reason(config, max_length: int) -> str | None:
    """Why the engine cannot decode this model (None when it can)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (engine supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    if uses_window and window is not None and window < max_length:
        return f"sliding-window attention ({window} tokens < {max_length})"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "hidden_act", "silu") not in ("silu", "gelu", "gelu_pytorch_tanh"):
        return f"activation {config.hidden_act!r}"
    return None


def model_shape(config) -> ModelShape:
    heads = config.num_attention_heads
    return ModelShape(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        rms_eps=config.rms_norm_eps, hidden_act=config.hidden_act,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head's dims
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor

    @property
    def head(self) -> tuple:
        """The arguments of `DecoderForward.decode_head` after the cache tensors (before attention)."""
        return self.input_norm, self.qkv, self.qkv_bias, self.q_norm, self.k_norm

    @property
    def tail(self) -> tuple:
        """The arguments of `DecoderForward.block_tail` after the activations (after attention)."""
        return self.o, self.o_bias, self.post_norm, self.gate_up, self.down


class _Target(NamedTuple):
    """Where one source parameter goes: `tensor` (a view into the engine's tensors) receives the
    slice of the full [`full_shape`] parameter starting at `start` along `dim`, as long as tensor is."""

    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    def cut(self, full) -> torch.Tensor:
        """This rank's slice of `full`: a tensor, or anything with its `shape` and `narrow` that
        makes the slice on request (a LoRA weight merged slice by slice, rlscale.models.lora)."""
        if isinstance(full, torch.Tensor) and tuple(full.shape) == tuple(self.tensor.shape):
            return full
        return full.narrow(self.dim, self.start, self.tensor.shape[self.dim])


class DecodeWeights:
    """Fused weight tensors on the engine's device and dtype, filled by `sync_from` or `copy_named`.

    With `tp`, only this rank's slices (`tensor_parallel.rank_slices`) are allocated: the fused
    q/k/v rows of its query and kv heads (biases alike; q/k norms replicated), o_proj's columns of
    its heads (o_proj's bias whole, added once after the all-reduce), gate/up rows and down columns
    of its intermediate slice, and the embedding / LM head rows of its vocabulary shard (tied ones
    one tensor; rows past the vocabulary are zeros). Norms are replicated. `shape` is the model's,
    `local_shape` this rank's (heads, kv heads, intermediate, vocabulary rows; `shape` without tp).

    `sync`: copy the source's parameters now (`sync_from`); False leaves the tensors unfilled for
    a streamed sync (`copy_named` unit by unit) before the first generation.
    """

    def __init__(self, source_model, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None = None,
                 sync: bool = True):
        self.shape = s = model_shape(source_model.config)
        self.tp = tp
        self.slices = slices = rank_slices(s, tp)
        self.local_shape = local = s if tp is None else replace(
            s, num_heads=len(slices.q_heads), num_kv_heads=len(slices.kv_heads),
            intermediate_size=len(slices.intermediate), vocab_size=len(slices.vocab))
        names = {name for name, _ in source_model.named_parameters()}
        has = lambda suffix: f"model.layers.0.{suffix}" in names  # noqa: E731
        empty = lambda *size: torch.empty(*size, device=device, dtype=dtype)  # noqa: E731
        qkv_rows = (local.num_heads + 2 * local.num_kv_heads) * s.head_dim
        self.embed = empty(local.vocab_size, s.hidden_size)
        self.final_norm = empty(s.hidden_size)
        self.lm_head = self.embed if s.tied_embeddings else empty(local.vocab_size, s.hidden_size)
        # padding rows (tp): never copied into; zero embeddings, and logits the forward drops
        self.embed[self._real_vocab_rows():].zero_()
        self.lm_head[self._real_vocab_rows():].zero_()
        self.layers = [
            LayerWeights(
                input_norm=empty(s.hidden_size),
                qkv=empty(qkv_rows, s.hidden_size),
                qkv_bias=empty(qkv_rows) if has("self_attn.q_proj.bias") else None,
                q_norm=empty(s.head_dim) if has("self_attn.q_norm.weight") else None,
                k_norm=empty(s.head_dim) if has("self_attn.k_norm.weight") else None,
                o=empty(s.hidden_size, local.num_heads * s.head_dim),
                o_bias=empty(s.hidden_size) if has("self_attn.o_proj.bias") else None,
                post_norm=empty(s.hidden_size),
                gate_up=empty(2 * local.intermediate_size, s.hidden_size),
                down=empty(s.hidden_size, local.intermediate_size))
            for _ in range(s.num_layers)]
        self.targets = self._targets()
        if sync:
            self.sync_from(source_model)

    def _real_vocab_rows(self) -> int:
        """This rank's vocabulary rows that are real tokens (the rest are padding)."""
        return max(0, min(self.slices.vocab.stop, self.shape.vocab_size) - self.slices.vocab.start)

    def _targets(self) -> dict[str, _Target]:
        """Source parameter name -> where this rank's slice of it goes (fused tensors are cut into
        views; without tp every slice is the whole parameter)."""
        s, local, cut = self.shape, self.local_shape, self.slices
        d, hidden = s.head_dim, s.hidden_size
        q, kv = local.num_heads * d, local.num_kv_heads * d
        vocab = _Target(self.embed[:self._real_vocab_rows()], (s.vocab_size, hidden), 0, cut.vocab.start)
        out = {"model.embed_tokens.weight": vocab, "model.norm.weight": _Target(self.final_norm, (hidden,))}
        if not s.tied_embeddings:
            out["lm_head.weight"] = vocab._replace(tensor=self.lm_head[:self._real_vocab_rows()])
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = _Target(w.input_norm, (hidden,))
            out[p + "post_attention_layernorm.weight"] = _Target(w.post_norm, (hidden,))
            for kind, fused in (("weight", w.qkv), ("bias", w.qkv_bias)):
                if fused is not None:
                    rest = tuple(fused.shape[1:])  # (hidden,) for the weight, () for the bias
                    out[p + f"self_attn.q_proj.{kind}"] = _Target(fused[:q], (s.num_heads * d, *rest), 0,
                                                                  cut.q_heads.start * d)
                    for j, proj in enumerate(("k_proj", "v_proj")):
                        out[p + f"self_attn.{proj}.{kind}"] = _Target(
                            fused[q + j * kv:q + (j + 1) * kv], (s.num_kv_heads * d, *rest), 0, cut.kv_heads.start * d)
            out[p + "self_attn.o_proj.weight"] = _Target(w.o, (hidden, s.num_heads * d), 1, cut.q_heads.start * d)
            for name, tensor in (("q_norm", w.q_norm), ("k_norm", w.k_norm)):
                if tensor is not None:
                    out[p + f"self_attn.{name}.weight"] = _Target(tensor, (d,))
            if w.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = _Target(w.o_bias, (hidden,))
            rows = local.intermediate_size
            for j, proj in enumerate(("gate_proj", "up_proj")):
                out[p + f"mlp.{proj}.weight"] = _Target(w.gate_up[j * rows:(j + 1) * rows],
                                                        (s.intermediate_size, hidden), 0, cut.intermediate.start)
            out[p + "mlp.down_proj.weight"] = _Target(w.down, (hidden, s.intermediate_size), 1, cut.intermediate.start)
        return out

    def _skipped(self, name: str) -> bool:
        """A source parameter with no target of its own: the LM head tied to the embedding."""
        return name == "lm_head.weight" and self.shape.tied_embeddings

    @torch.no_grad()
    def copy_named(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy this rank's slice of each FULL source tensor (name, tensor) into place, in one
        foreach copy; returns the target names filled (a tied LM head is skipped). Raises on a
        name the engine does not know or a tensor that is not the full parameter, before copying.

        The streamed weight sync: call it once per FSDP unit while that unit is gathered (the unit
        may be released when it returns: the copies are queued on the current stream before any
        later free), collect the returned names, and check `missing_after(names)` at the end."""
        targets, values, filled = [], [], []
        for name, value in pairs:
            if self._skipped(name):
                continue
            target = self.targets.get(name)
            if target is None:
                raise ValueError(f"rollout engine: unexpected parameter {name!r}")
            if tuple(value.shape) != target.full_shape:
                raise ValueError(f"rollout engine: {name} has shape {tuple(value.shape)}, "
                                 f"expected {target.full_shape} (is the model still sharded?)")
            targets.append(target.tensor)
            values.append(target.cut(value.detach()))
            filled.append(name)
        if targets:
            torch._foreach_copy_(targets, values, non_blocking=True)
        return filled

    def missing_after(self, names: Iterable[str]) -> list[str]:
        """The targets that `names` (what one sync's `copy_named` calls returned, all together)
        leaves unfilled, sorted: a complete sync gives []."""
        return sorted(set(self.targets).difference(names))

    @torch.no_grad()
    def sync_from(self, source_model) -> None:
        """Copy the source model's current parameters in place (gathered when FSDP2-sharded), all
        in one foreach copy: ~170 separate copies cost more in launches than in bytes. Every
        gathered tensor is held until the copy: for a model gathered already, or a small one; a
        model too large for that syncs unit by unit through `copy_named`."""
        params = list(source_model.named_parameters())
        missing = self.missing_after(name for name, _ in params)
        if missing:
            raise ValueError(f"rollout engine: parameters missing from the model: {missing[:3]}")
        self.copy_named((name, param.full_tensor() if hasattr(param, "full_tensor") else param)
                        for name, param in params)
