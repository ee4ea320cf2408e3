"""The engine's own copy of the policy weights, laid out for decoding.

q/k/v projections are fused into one matrix and gate/up into another, so a decode step runs two
matmuls where Hugging Face's modules run five. The tensors are allocated once; `sync_from`
copies the trainer's current weights into them in place, so captured CUDA graphs stay valid
across updates (weight sync without touching disk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


class DecodeWeights:
    """Fused weight tensors on the engine's device and dtype, filled by `sync_from`."""

    def __init__(self, source_model, device: torch.device, dtype: torch.dtype):
        self.shape = s = model_shape(source_model.config)
        names = {name for name, _ in source_model.named_parameters()}
        has = lambda suffix: f"model.layers.0.{suffix}" in names  # noqa: E731
        empty = lambda *size: torch.empty(*size, device=device, dtype=dtype)  # noqa: E731
        qkv_rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.embed = empty(s.vocab_size, s.hidden_size)
        self.final_norm = empty(s.hidden_size)
        self.lm_head = self.embed if s.tied_embeddings else empty(s.vocab_size, s.hidden_size)
        self.layers = [
            LayerWeights(
                input_norm=empty(s.hidden_size),
                qkv=empty(qkv_rows, s.hidden_size),
                qkv_bias=empty(qkv_rows) if has("self_attn.q_proj.bias") else None,
                q_norm=empty(s.head_dim) if has("self_attn.q_norm.weight") else None,
                k_norm=empty(s.head_dim) if has("self_attn.k_norm.weight") else None,
                o=empty(s.hidden_size, s.num_heads * s.head_dim),
                o_bias=empty(s.hidden_size) if has("self_attn.o_proj.bias") else None,
                post_norm=empty(s.hidden_size),
                gate_up=empty(2 * s.intermediate_size, s.hidden_size),
                down=empty(s.hidden_size, s.intermediate_size))
            for _ in range(s.num_layers)]
        self.targets = self._targets()
        self.sync_from(source_model)

    def _targets(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Source parameter name -> engine tensor (or the slices a fused tensor is cut into)."""
        s = self.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        out: dict = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        if not s.tied_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = w.input_norm
            out[p + "post_attention_layernorm.weight"] = w.post_norm
            for kind, fused in (("weight", w.qkv), ("bias", w.qkv_bias)):
                if fused is not None:
                    out[p + f"self_attn.q_proj.{kind}"] = fused[:q]
                    out[p + f"self_attn.k_proj.{kind}"] = fused[q:q + kv]
                    out[p + f"self_attn.v_proj.{kind}"] = fused[q + kv:]
            out[p + "self_attn.o_proj.weight"] = w.o
            for name, tensor in (("q_norm", w.q_norm), ("k_norm", w.k_norm)):
                if tensor is not None:
                    out[p + f"self_attn.{name}.weight"] = tensor
            if w.o_bias is not None:
                out[p + "self_attn.o_proj.bias"] = w.o_bias
            out[p + "mlp.gate_proj.weight"] = w.gate_up[:s.intermediate_size]
            out[p + "mlp.up_proj.weight"] = w.gate_up[s.intermediate_size:]
            out[p + "mlp.down_proj.weight"] = w.down
        return out

    @torch.no_grad()
    def sync_from(self, source_model) -> None:
        """Copy the source model's current parameters in place (gathered when FSDP2-sharded),
        all in one foreach copy: ~170 separate copies cost more in launches than in bytes."""
        targets, values, seen = [], [], set()
        for name, param in source_model.named_parameters():
            if name not in self.targets:
                if name == "lm_head.weight" and self.shape.tied_embeddings:
                    continue
                raise ValueError(f"rollout engine: unexpected parameter {name!r}")
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            target = self.targets[name]
            if target.shape != value.shape:
                raise ValueError(f"rollout engine: {name} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(target.shape)} (is the model still sharded?)")
            targets.append(target)
            values.append(value.detach())
            seen.add(name)
        missing = set(self.targets) - seen
        if missing:
            raise ValueError(f"rollout engine: parameters missing from the model: {sorted(missing)[:3]}")
        torch._foreach_copy_(targets, values, non_blocking=True)
