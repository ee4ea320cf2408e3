"""The memory plan: per-GPU bytes of each phase of a GRPO step, from the model's config.json alone.

Made before any weight loads. It counts what the code allocates, per worker (one per GPU, W of them):
- FSDP2 (W > 1, and W = 1 for fp32 master weights under 16-bit compute gathered one unit at a
  time, see rlscale.workers.precision) shards the optimizer's weights, gradients and AdamW moments
  over W; one worker with fp32 master weights kept gathered holds them beside a whole bf16 copy
  (rlscale.workers.compute_copy) and accumulates fp32 gradients;
- with policy.keep_gathered the policy is gathered whole in the compute dtype for the generation's
  weight sync and stays gathered until the update's last backward, and gradients are reduced once
  per optimizer step; with keep_gathered=false every pass gathers one FSDP2 unit at a time: the
  weight sync (the root unit, then one unit of layers at a time, each copied into the engine and
  freed), the sharded reference's pass and the update, which reduces every micro-batch's gradients;
- the rollout engine keeps its own fused copy (compute dtype), its KV cache (slots × length) and
  its CUDA-graph pool for the whole run; at policy.generation.tensor_parallel_size T, a group of T
  GPUs generates its T ranks' samples together: each GPU holds 1/T of the engine's weights (the
  norms replicated, the embedding and the LM head split by vocabulary), the KV cache of its
  kv heads / T (one when T exceeds them: replicated) for the group's slots, and the full-vocabulary
  logits of every slot (each rank gathers them to sample); under
  policy.generation.gpu_memory_utilization U (on GPUs) the KV cache is the engine's budget, U × the
  GPU's memory less all else the generation phase holds, at most slots × length, and a budget
  that holds no sequence of max_total_sequence_length is refused;
- the KL reference is whole per GPU unless sharded, and then gathered whole for its pass
  (keep_gathered) or one unit at a time;
- with several micro-batches and keep_gathered, FSDP2 accumulates unsharded gradients (in fp32
  under its MixedPrecisionPolicy) until the last micro-batch's reduce-scatter.
Figures are upper bounds: every sample policy.max_total_sequence_length long, every sample
trained. The coefficients are derived from the code (and the saved tensors counted on CPU for a
small Qwen2); each is one named constant, to be calibrated against H200 measurements.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

from rlscale.config import LORA_LINEAR_MODULES, Config, derive_sizes, prompts_per_generation

GB = 1e9
RESERVE_BYTES = 2e9  # CUDA context, cuBLAS and NCCL workspaces: outside what torch allocates
RESERVE_FRACTION = 0.03  # the caching allocator's fragmentation, of the device's memory


@dataclass(frozen=True)
class LayerBytes:
    """Bytes per token of one decoder layer at 16-bit compute, per unit of each width (fp32: twice)."""

    hidden: float
    q: float  # per unit of heads × head_dim
    kv: float  # per unit of kv_heads × head_dim
    intermediate: float

    def per_token(self, shape: ModelShape, scale: float) -> float:
        return scale * (self.hidden * shape.hidden_size + self.q * shape.q_width + self.kv * shape.kv_width
                        + self.intermediate * shape.intermediate_size)


# Saved for backward by an eager decoder layer: each RMSNorm its fp32 input copy and bf16 output
# (2 × (4 + 2) per hidden); q and the attention output (varlen's contiguous q, its out = o_proj's
# input); k and v; gate, up, silu(gate) and their product (4 × 2). Rotary saves cos/sin only.
SAVED_EAGER = LayerBytes(hidden=12, q=4, kv=4, intermediate=8)
# Under torch.compile (policy.compile, default on CUDA) the norms' fp32 math and silu are
# recomputed: the layer input and both norms' bf16 outputs stay (3 × 2), and gate, up, product (3 × 2).
SAVED_COMPILED = LayerBytes(hidden=6, q=4, kv=4, intermediate=6)
# In flight in one layer of a no-grad forward (logprob passes, the engine's prefill), at its MLP:
# residual, norm temporaries and output; gate, up, silu, product (attention's tensors are freed by then)
FORWARD_ONLY = LayerBytes(hidden=12, q=0, kv=0, intermediate=8)
CHECKPOINT_BYTES_PER_HIDDEN = 2  # activation checkpointing keeps each layer's bf16 input only
OUTSIDE_LAYERS_BYTES_PER_HIDDEN = 12  # embedding output, final norm (fp32 copy, output), head rows, their gradient
LOGITS_BYTES_EAGER = 16  # per [chunk, vocab] element: bf16 logits, fp32 copy, fp32 softmax temporaries, bf16 gradient
LOGITS_BYTES_COMPILED = 4  # the compiled chunk kernels read the bf16 logits, write the bf16 gradient
HEAD_GRAD_FP32_COPIES = 2  # the head's fp32 [vocab, hidden] gradient accumulator and addmm's new sum (CUDA)
DECODE_LOGITS_BYTES = 16  # per slot × vocab: a step's logits, fp32 log-softmax, sampling temporaries
STOCHASTIC_STEP_BYTES = 24  # StochasticRoundingAdamW per element of a parameter: fp32 grad, denom, update, noise
PLAIN_STEP_BYTES = 12  # torch's unfused AdamW (CPU) per element of a parameter; fused on CUDA: none
ENGINE_PREFILL_TOKENS = 16384  # RolloutEngine's prefill_tokens: prompt rows × width per prefill chunk
EVAL_CHUNK = 256  # rlscale.evaluate generates the held-out prompts 256 at a time
ENGINE_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")  # rlscale.rollout.weights.SUPPORTED_MODEL_TYPES
COLUMNS = {"weight sync": "sync", "generation": "generate", "optimizer step": "optimizer"}  # table headings
MICRO_BATCH_HALVINGS = 2  # the plan shrinks policy.train_micro_batch_tokens to a quarter at most
PICKED_KEYS = ("master_weights", "train_micro_batch_tokens", "shard_reference", "activation_checkpointing",
               "keep_gathered")


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a Qwen2/Qwen3/Llama/Mistral-style decoder's config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = True  # Qwen2: q/k/v projections with bias, o_proj without
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k
    model_type: str = "qwen2"
    hidden_act: str = "silu"
    sliding_window: int | None = None  # only when in use

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        heads, kind = config["num_attention_heads"], config.get("model_type", "qwen2")
        bias = bool(config.get("attention_bias", False))  # Llama, Qwen3, ...: q/k/v and o alike
        window = config.get("sliding_window")
        if not config.get("use_sliding_window", window is not None):
            window = None
        return cls(config["hidden_size"], config["num_hidden_layers"], heads,
                   config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads,
                   config["intermediate_size"], config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=kind == "qwen2" or bias, o_bias=kind != "qwen2" and bias,
                   mlp_bias=bool(config.get("mlp_bias", False)), qk_norm=kind == "qwen3", model_type=kind,
                   hidden_act=config.get("hidden_act", "silu"), sliding_window=window)

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_parameters(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        attention = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        mlp = 3 * h * i + self.mlp_bias * (2 * i + h)
        return attention + mlp + 2 * h + self.qk_norm * 2 * self.head_dim

    def outside_parameters(self) -> int:
        """Embedding, final norm and an untied LM head: FSDP2's root unit."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def parameter_count(self) -> int:
        return self.num_hidden_layers * self.layer_parameters() + self.outside_parameters()

    def lora_parameters(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """LoRA's A (r × in) and B (out × r) on each target linear layer of every block."""
        h, q, kv, i = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        sides = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                 "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        return self.num_hidden_layers * rank * sum(sides[t] for t in targets)

    def engine_supported(self, max_length: int) -> bool:
        return self.engine_unsupported_reason(max_length) is None

    def engine_unsupported_reason(self, max_length: int) -> str | None:
        """rlscale.rollout.weights.unsupported_reason, on the config's values."""
        if self.model_type not in ENGINE_MODEL_TYPES:
            return f"model type {self.model_type!r}"
        if self.sliding_window is not None and self.sliding_window < max_length:
            return f"sliding-window attention ({self.sliding_window} tokens < {max_length})"
        if self.mlp_bias:
            return "MLP biases"
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            return f"activation {self.hidden_act!r}"
        return None

    def tensor_parallel_problem(self, size: int, name: str = "the model") -> str | None:
        """Why the rollout engine cannot split this shape over `size` GPUs (None when it can): each
        rank takes heads / T query heads, kv heads / T kv heads (or one of them, replicated, when
        T is a multiple of the kv heads) and intermediate / T of the MLP."""
        key = f"policy.generation.tensor_parallel_size={size}"
        if self.num_attention_heads % size:
            return f"{key} must divide the attention heads of {name} (num_attention_heads={self.num_attention_heads})"
        kv = self.num_key_value_heads
        if kv % size and size % kv:
            return (f"{key} and the KV heads of {name} (num_key_value_heads={kv}) must divide one another (each "
                    "rank holds kv heads / T of them, or one of them replicated)")
        if self.intermediate_size % size:
            return f"{key} must divide the intermediate size of {name} (intermediate_size={self.intermediate_size})"
        return None

    def tensor_parallel_shard(self, size: int) -> ModelShape:
        """What one rank of a T-way tensor-parallel engine holds, as a shape: heads / T, max(1,
        kv heads / T), intermediate / T, vocabulary / T (rounded up) for the embedding and the LM
        head; hidden size, norms and the o_proj / down_proj biases whole (replicated)."""
        if size == 1:
            return self
        return replace(self, num_attention_heads=self.num_attention_heads // size,
                       num_key_value_heads=max(1, self.num_key_value_heads // size),
                       intermediate_size=self.intermediate_size // size, vocab_size=-(-self.vocab_size // size))


def _qwen(h, layers, heads, kv, i, vocab, tied) -> ModelShape:
    return ModelShape(h, layers, heads, kv, h // heads, i, vocab, tied)


# Qwen2 / Qwen2.5 config.json values (each -Instruct model has its base's shape), for hub ids not
# in the cache: a plan needs no download.
KNOWN_SHAPES = {
    **{f"qwen/{family}-{size}": shape for family in ("qwen2", "qwen2.5") for size, shape in {
        "0.5b": _qwen(896, 24, 14, 2, 4864, 151936, True), "1.5b": _qwen(1536, 28, 12, 2, 8960, 151936, True),
        "7b": _qwen(3584, 28, 28, 4, 18944, 152064, False), "72b": _qwen(8192, 80, 64, 8, 29568, 152064, False),
    }.items()},
    "qwen/qwen2.5-3b": _qwen(2048, 36, 16, 2, 11008, 151936, True),
    "qwen/qwen2.5-14b": _qwen(5120, 48, 40, 8, 13824, 152064, False),
    "qwen/qwen2.5-32b": _qwen(5120, 64, 40, 8, 27648, 152064, False),
}


def load_shape(model_name: str) -> ModelShape | None:
    """From config.json (builtin:NAME, a local directory, the HF cache), else the known shapes;
    None when nothing has it."""
    path = _config_path(model_name)
    if path is not None:
        try:
            return ModelShape.from_config(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            return None
    name = model_name.lower()
    return KNOWN_SHAPES.get(name.removesuffix("-instruct"))


def cache_length(cfg: Config) -> int:
    """The rollout engine's cache length: policy.max_total_sequence_length rounded up to 64.
    rlscale.workers.policy builds the engine with it, so the plan counts the cache the engine holds."""
    return -(-cfg.policy.max_total_sequence_length // 64) * 64


def check_tensor_parallel(cfg: Config, shape: ModelShape | None) -> None:
    """policy.generation.tensor_parallel_size against the model's shape (config.json, no weights):
    a UserError (one line) when the rollout engine cannot split it; nothing to check without a shape.
    (The cluster's and the backend's checks are rlscale.config.check_tensor_parallel's.)"""
    from rlscale.errors import UserError

    size, p = cfg.policy.generation.tensor_parallel_size, cfg.policy
    if size == 1 or shape is None:
        return
    reason = shape.engine_unsupported_reason(cache_length(cfg))
    if reason:
        raise UserError(f"policy.generation.tensor_parallel_size={size} needs the rollout engine, which does not "
                        f"run {p.model_name} ({reason}; it would fall back to transformers generate)")
    problem = shape.tensor_parallel_problem(size, p.model_name)
    if problem:
        raise UserError(problem)


def _config_path(model_name: str) -> Path | None:
    if model_name.startswith("builtin:"):
        from rlscale.errors import UserError
        from rlscale.models.loading import resolve_model_path

        try:
            return Path(resolve_model_path(model_name)) / "config.json"
        except UserError:
            return None
    local = Path(model_name).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_name, "config.json")
    except Exception:  # not a valid repo id, or no huggingface_hub: nothing cached
        return None
    return Path(found) if isinstance(found, str) else None


def budget_bytes(cfg: Config) -> int | None:
    """cluster.gpu_memory_gb, else the memory of this machine's GPU 0, else None (no verdict)."""
    if cfg.cluster.gpu_memory_gb is not None:
        return int(cfg.cluster.gpu_memory_gb * GB)
    if cfg.policy.device == "cpu":
        return None
    if "torch" in sys.modules:  # a run: torch is loaded anyway
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return _nvidia_smi_memory()  # a dry run: no torch import (it takes seconds, and no model loads)


def _nvidia_smi_memory() -> int | None:
    """GPU 0's memory as the driver reports it (MiB), without torch; None without an NVIDIA GPU."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
        return int(done.stdout.split()[0]) * 2**20 if done.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def usable_bytes(budget: int) -> float:
    return budget * (1 - RESERVE_FRACTION) - RESERVE_BYTES


@dataclass(frozen=True)
class Settings:
    """The settings the plan controls, in PICKED_KEYS order: the last is given up first."""

    master_weights: str
    train_micro_batch_tokens: int
    shard_reference: bool
    activation_checkpointing: bool
    keep_gathered: bool


@dataclass(frozen=True)
class Phase:
    name: str
    components: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass(frozen=True)
class Pick:
    key: str  # under policy.
    value: object
    why: str


def _compute_bytes(cfg: Config, gpu: bool, master: str) -> int:
    """The size of rlscale.workers.precision.compute_dtype."""
    if cfg.policy.dtype == "auto":
        return 2 if gpu or master in ("bf16", "bf16_stochastic") else 4
    return 4 if cfg.policy.dtype == "float32" else 2


def micro_batching(cfg: Config, world: int, budget: int) -> tuple[int, int]:
    """(micro-batches per optimizer step, tokens in the largest) with every sample
    max_total_sequence_length long (rlscale.workers.packing.plan_packs)."""
    length = cfg.policy.max_total_sequence_length
    per_worker = -(-cfg.policy.train_global_batch_size // world)
    return -(-per_worker // max(1, budget // length)), min(budget, per_worker * length)


def kv_limited(cfg: Config, shape: ModelShape, gpu: bool, budget: int | None) -> bool:
    """Whether the rollout engine's KV cache has a budget: policy.generation.gpu_memory_utilization
    set, the engine running on GPUs (rlscale.workers.policy gives it one on CUDA only), the GPU's
    memory known."""
    gen = cfg.policy.generation
    return (gen.gpu_memory_utilization is not None and gen.backend == "engine" and gpu and budget is not None
            and shape.engine_supported(cache_length(cfg)))


def sequence_kv_bytes(cfg: Config, shape: ModelShape, gpu: bool, master: str) -> int:
    """One sequence's KV cache on one GPU of the engine: max_total_sequence_length rounded up to
    64 (the engine's cache length) × keys and values × layers × this rank's kv width × compute bytes."""
    length = cache_length(cfg)
    local = shape.tensor_parallel_shard(cfg.policy.generation.tensor_parallel_size)
    return length * 2 * shape.num_hidden_layers * local.kv_width * _compute_bytes(cfg, gpu, master)


def _phases(cfg: Config, shape: ModelShape, s: Settings, world: int, gpu: bool, budget: int | None) -> list[Phase]:
    """budget: the GPU's memory (None: unknown), for the KV budget of gpu_memory_utilization."""
    p, g = cfg.policy, cfg.grpo
    params, layers, vocab, hidden = (shape.parameter_count(), shape.num_hidden_layers, shape.vocab_size,
                                     shape.hidden_size)
    c = _compute_bytes(cfg, gpu, s.master_weights)
    master = s.master_weights if c == 2 else "fp32"  # fp32 compute trains fp32 weights
    casts = c == 2 and master in ("fp32", "bf16_stochastic")  # FSDP2 MixedPrecisionPolicy, fp32 reduction
    # one worker (rlscale.workers.precision.Precision.one_worker_layout): fp32 master weights kept
    # gathered are a whole bf16 compute copy beside them, and gathered one unit at a time an FSDP2
    # group of one; stochastic rounding is a plain bf16 model
    copy = world == 1 and casts and master == "fp32" and s.keep_gathered
    if world == 1:
        casts = casts and master == "fp32" and not s.keep_gathered
    sharded = world > 1 or casts
    share = world if sharded else 1
    w = 4 if master == "fp32" else 2
    moments = 8 if master in ("fp32", "bf16_stochastic") else 2 * w
    # LoRA: the frozen base in the compute dtype is the reference too (no copy); the adapters, their
    # gradients and moments are fp32 (rlscale.models.lora); over several workers FSDP2 shards both
    # and gathers each in its own dtype (no MixedPrecisionPolicy)
    adapters = shape.lora_parameters(p.lora.rank, p.lora.target_modules or LORA_LINEAR_MODULES) \
        if p.lora.enabled else 0
    if adapters:
        casts, copy, sharded = False, False, world > 1
        share, w, moments = world if sharded else 1, c, 0
    unit = max(min(p.fsdp_layers_per_unit, layers) * shape.layer_parameters(), shape.outside_parameters())
    compiled = p.compile if p.compile is not None else gpu and not casts  # workers.model_setup.auto_compile
    scale = c / 2

    # the rollout engine: its KV cache is kept from one generation to the next (validation's too)
    length = cache_length(cfg)
    engine = p.generation.backend == "engine" and shape.engine_supported(length)
    tp = p.generation.tensor_parallel_size if engine else 1
    local = shape.tensor_parallel_shard(tp)  # what one GPU of the engine's group holds
    groups = max(1, world // tp)  # each generates its tp ranks' samples together
    validates = g.val_at_start or g.val_at_end or g.val_period > 0
    count = max(-(-prompts_per_generation(cfg) * g.num_generations_per_prompt // groups),  # one round's
                -(-min(g.max_val_samples, EVAL_CHUNK) // groups) if validates else 0)
    slots = max(8, 1 << (count - 1).bit_length()) if engine and gpu and p.generation.cuda_graphs else count
    kv_token = 2 * layers * local.kv_width * c
    prompt = p.max_total_sequence_length - p.generation.max_new_tokens
    prefill = max(min(ENGINE_PREFILL_TOKENS, count * prompt), prompt) if engine else count * prompt

    reference = cfg.loss.reference_policy_kl_penalty > 0
    ref_sharded = reference and world > 1 and s.shard_reference
    base = {"training weights": 0 if sharded else params * w, "master weights": params * w / share if sharded else 0,
            # gradients are freed after each optimizer step (their memory is the generation's)
            "gradients": 0, "moments": params * moments / share,
            "reference": params * c / (world if ref_sharded else 1) if reference else 0,
            "rollout-engine weights": local.parameter_count() * c if engine else 0,
            "KV cache": slots * length * kv_token if engine else 0,
            "decode buffers": slots * (vocab * DECODE_LOGITS_BYTES + p.generation.max_new_tokens * 12) if engine else 0}
    if copy:  # the fp32 master weights, and their bf16 copy as the training weights
        base.update({"training weights": params * c, "master weights": params * 4})
    whole = params * c if sharded else 0  # the gathered policy: at the weight sync, and kept through the update
    gathered = whole if s.keep_gathered else 0
    gather = unit * c * (1 + 1 / world)  # one unit's all-gather output beside its parameters, and its input
    streamed = sharded and engine and not s.keep_gathered  # the weight sync one FSDP2 unit at a time
    layer_unit = min(p.fsdp_layers_per_unit, layers) * shape.layer_parameters()
    # streamed: the root unit (embedding, final norm, LM head) gathered for the sync, and one unit of
    # layers in flight (its all-gather output and input), copied into the engine and freed
    sync_gather = (shape.outside_parameters() * c + layer_unit * c * (1 + 1 / world) if streamed
                   else gather if sharded else 0)

    def phase(name, extra: dict, held: float = gathered) -> Phase:
        parts = dict(base)
        for key, value in {"training weights": held, **extra}.items():
            parts[key] = parts.get(key, 0) + value
        return Phase(name, parts)

    micro_batches, tokens = micro_batching(cfg, world, s.train_micro_batch_tokens)
    logits = min(p.logprob_chunk_tokens, tokens) * vocab * scale * (
        LOGITS_BYTES_COMPILED if compiled else LOGITS_BYTES_EAGER)
    outside = tokens * OUTSIDE_LAYERS_BYTES_PER_HIDDEN * hidden * scale
    forward_only = FORWARD_ONLY.per_token(shape, scale)
    engine_forward = FORWARD_ONLY.per_token(local, scale)  # the MLP's intermediate split over the group
    saved = (SAVED_COMPILED if compiled else SAVED_EAGER).per_token(shape, scale)
    if s.activation_checkpointing:  # checkpoints, one layer recomputed, its backward's temporaries
        activations = tokens * (layers * CHECKPOINT_BYTES_PER_HIDDEN * hidden * scale + 2 * saved) + outside
    else:  # every layer's saved tensors, one layer's backward temporaries
        activations = tokens * (layers + 1) * saved + outside
    # fp32 gradient reduction (rlscale.workers.precision.Precision.fsdp_policy): for fp32 master
    # weights, and for stochastic rounding over several workers
    reduce_bytes = 4 if casts and (master == "fp32" or world > 1) else c
    reduce = unit * reduce_bytes * (1 + 1 / world) if sharded else 0  # reduce-scatter input and output
    # The update starts with zero_grad(set_to_none): the step's gradients grow in the backward as the
    # activations shrink, so at the peak only those accumulated over earlier micro-batches exist.
    if micro_batches > 1 and (s.keep_gathered or not sharded):
        # FSDP2: accumulated unsharded (fp32 under casts) until the last reduce-scatter
        grads = params * reduce_bytes + unit * c if sharded else params * w
    else:  # reduce-scattered unit by unit (into the sharded gradients of earlier micro-batches)
        earlier = params * w / share if micro_batches > 1 else 0
        grads = earlier + 2 * unit * c if sharded else shape.layer_parameters() * w
    if adapters:  # only the adapters have gradients; the whole step's exist (unsharded) by the last backward
        # the base (its shard when sharded; `gathered` adds the whole while it is held gathered)
        base.update({"training weights": params * c / share, "master weights": adapters * 4 / share,
                     "moments": adapters * 8 / share, "reference": 0})
        grads = adapters * 4
        # a unit's adapter gradients reduce-scattered in fp32; one unit of the base gathered in
        # flight when the policy is not held gathered
        reduce = (adapters * min(p.fsdp_layers_per_unit, layers) / layers * 4 * (1 + 1 / world)
                  + (0 if s.keep_gathered else gather)) if sharded else 0
    # the LM head's weight gradient (none under LoRA: the head stays frozen, only its input's flows)
    head = 0 if adapters else vocab * hidden * (4 * (HEAD_GRAD_FP32_COPIES if gpu and c == 2 else 1) + (c if c != 4 else 0))
    largest = max(vocab * hidden, shape.intermediate_size * hidden) / share
    step = largest * (STOCHASTIC_STEP_BYTES if master == "bf16_stochastic" else 0 if gpu else PLAIN_STEP_BYTES)

    generation = {"activations": prefill * engine_forward} if engine else {
        # transformers generate: its cache and logits live for the call only
        "activations": prefill * forward_only, "decode buffers": count * vocab * DECODE_LOGITS_BYTES,
        "KV cache": count * p.max_total_sequence_length * kv_token}
    if kv_limited(cfg, shape, gpu, budget):
        # the engine may fill gpu_memory_utilization of the GPU: its cache gets what the rest of the
        # generation phase leaves of that (all of it is allocated by the second generation, moments
        # included), and never more than one slot per sample takes (the engine allocates no more)
        others = phase("generation", generation).total - base["KV cache"]
        base["KV cache"] = min(base["KV cache"], max(0.0, p.generation.gpu_memory_utilization * budget - others))
    phases = [phase("weight sync", {"transient gathers": sync_gather}, held=0 if streamed else whole),
              phase("generation", generation)]
    optimizer_steps = g.num_prompts_per_step * g.num_generations_per_prompt // p.train_global_batch_size
    if reference or optimizer_steps > 1:  # the reference's and pi_old's logprob passes
        phases.append(phase("logprobs", {  # the sharded reference gathered whole, or one unit at a time
            "reference": params * c if ref_sharded and s.keep_gathered else 0,
            # LoRA: the base's passes are the sharded policy's, gathered as the update's are
            "transient gathers": gather if ref_sharded or (adapters and sharded and not s.keep_gathered) else 0,
            "activations": tokens * forward_only + outside, "logits chunk": logits}))
    phases.append(phase("update", {"gradients": grads, "transient gathers": reduce,
                                   "activations": activations, "logits chunk": logits, "head gradient": head}))
    phases.append(Phase("optimizer step", {**base, "gradients": (adapters * 4 or params * w) / share,  # resharded
                                           "optimizer temporaries": step}))
    return phases


def _peak(phases) -> Phase:
    return max(phases, key=lambda ph: ph.total)


def _options(cfg: Config, shape: ModelShape, world: int, gpu: bool, budget: int | None,
             free: bool = False) -> dict[str, list]:
    """Per controlled key, the values to try, preferred first. A key the user set keeps its value
    (free: every key is open, bf16 master included, for the refusal's advice); without a budget,
    what an unplanned worker does (fp32 master, no checkpointing, a whole reference)."""
    p, plan = cfg.policy, budget is not None
    auto = {key: free or getattr(p, key) in (None, "auto") for key in PICKED_KEYS}
    tokens = [derive_sizes(cfg).micro_batch_tokens]
    # halved at most twice: micro-batches a quarter of the size already cost GPU efficiency, and a
    # quarter is where giving up fp32 master weights (the next option) becomes the better trade
    while plan and auto["train_micro_batch_tokens"] and tokens[-1] > p.max_total_sequence_length \
            and len(tokens) < MICRO_BATCH_HALVINGS + 1:
        tokens.append(max(p.max_total_sequence_length, tokens[-1] // 2))
    masters = ["fp32"]
    if p.lora.enabled:  # the adapters always train in fp32 (rlscale.workers.precision)
        pass
    elif not auto["master_weights"]:
        masters = [p.master_weights]
    elif plan and p.dtype != "float16" and _compute_bytes(cfg, gpu, "fp32") == 2:  # stochastic rounding is bf16
        masters = ["fp32", "bf16_stochastic", "bf16"] if free else ["fp32", "bf16_stochastic"]
    references = [False]  # none, or a worker alone (it shards only when W > 1)
    if cfg.loss.reference_policy_kl_penalty > 0 and world > 1 and not p.lora.enabled:  # LoRA: the base is it
        if not auto["shard_reference"]:
            references = [p.shard_reference]
        elif plan and not free and shape.parameter_count() * _compute_bytes(cfg, gpu, "fp32") > 0.1 * budget:
            references = [True]  # distributed.shard_reference's own rule: above 10% of the GPU's memory
        elif plan:
            references = [False, True]
    checkpointing = [bool(p.activation_checkpointing)] if not auto["activation_checkpointing"] \
        else [False, True] if plan else [False]
    # unsharded (no FSDP2: plain bf16 at one worker) the setting changes nothing: left as it is
    gathered = [p.keep_gathered is not False] if not auto["keep_gathered"] else [True, False] if plan else [True]
    options = dict(zip(PICKED_KEYS, (masters, tokens, references, checkpointing, gathered)))
    for key, values in options.items():  # free: the user's own values first, so that the fewest change
        user = getattr(p, key)
        if free and user in values:
            values.sort(key=lambda value: value != user)
    return options


def _search(cfg, shape, world, gpu, budget, options) -> tuple[Settings, list[Phase], bool]:
    """The first settings in order of preference that fit; else those of the smallest peak.
    Without a budget (None): the first."""
    usable, tried = None if budget is None else usable_bytes(budget), []
    for values in product(*options.values()):
        settings = Settings(*values)
        phases = _phases(cfg, shape, settings, world, gpu, budget)
        if usable is None or _peak(phases).total <= usable:
            return settings, phases, usable is not None
        tried.append((settings, phases))
    return *min(tried, key=lambda t: _peak(t[1]).total), False


# ------------------------------------------------------------------ a save, per node (the preemption promise)

# what a rank saves beside its tensors: RNG states (CPU and device generators), the optimizer's and
# scheduler's counters, the loader position, its part of the manifest; well under this
SMALL_STATE_BYTES_PER_RANK = 64 * 1024


@dataclass(frozen=True)
class SaveFigures:
    """A checkpoint's bytes per node and the time a node needs to write them at
    checkpointing.node_write_gbps, against checkpointing.preemption_grace_s. Each rank writes the
    shards it holds (total / world), so a node writes gpus_per_node ranks' shares: its master
    weights (the dtype they train in; engine weights are never saved), its AdamW moments and
    SMALL_STATE_BYTES_PER_RANK per rank."""

    nodes: int
    ranks_per_node: int
    master_dtype: str  # "fp32" or "bf16"
    weights_bytes: int  # per node
    moments_bytes: int  # per node
    rest_bytes: int  # per node
    node_write_gbps: float
    grace_s: float
    save_period: int

    @property
    def node_bytes(self) -> int:
        return self.weights_bytes + self.moments_bytes + self.rest_bytes

    @property
    def write_s(self) -> float:
        return self.node_bytes / (self.node_write_gbps * GB)

    @property
    def fits_grace(self) -> bool:
        return self.write_s <= self.grace_s

    def line(self) -> str:
        figures = (f"save per node ({self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}, "
                   f"{self.nodes} node{'s' if self.nodes > 1 else ''}): {self.node_bytes / GB:.1f} GB = "
                   f"{self.master_dtype} master weights {self.weights_bytes / GB:.1f} + AdamW moments "
                   f"{self.moments_bytes / GB:.1f} + the rest {self.rest_bytes / GB:.3f}; "
                   f"{self.write_s:.1f} s at checkpointing.node_write_gbps={self.node_write_gbps:g} GB/s")
        if self.fits_grace:
            return (f"{figures}, within checkpointing.preemption_grace_s={self.grace_s:g} s: "
                    "a preemption takes an emergency save")
        return (f"{figures}, more than checkpointing.preemption_grace_s={self.grace_s:g} s: "
                f"no emergency save fits, a preemption loses at most checkpointing.save_period={self.save_period} steps")

    def as_dict(self) -> dict:
        return {"nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "master_dtype": self.master_dtype,
                "node_bytes": self.node_bytes, "weights_bytes": self.weights_bytes,
                "moments_bytes": self.moments_bytes, "rest_bytes": self.rest_bytes,
                "node_write_gbps": self.node_write_gbps, "write_s": self.write_s,
                "preemption_grace_s": self.grace_s, "fits_grace": self.fits_grace, "save_period": self.save_period}


def save_figures(cfg: Config, shape: ModelShape, s: Settings, gpu: bool) -> SaveFigures:
    """The bytes one node writes per save under settings `s` (see SaveFigures)."""
    c = _compute_bytes(cfg, gpu, s.master_weights)
    master = s.master_weights if c == 2 else "fp32"  # fp32 compute trains fp32 weights (as _phases)
    w = 4 if master == "fp32" else 2
    moments = 8 if master in ("fp32", "bf16_stochastic") else 2 * w
    nodes, per_node = cfg.cluster.num_nodes, cfg.cluster.gpus_per_node
    params = shape.parameter_count()
    if cfg.policy.lora.enabled:  # a LoRA step holds the fp32 adapters and their moments alone
        lora = cfg.policy.lora
        params, w, moments = shape.lora_parameters(lora.rank, lora.target_modules or LORA_LINEAR_MODULES), 4, 8
    ck = cfg.checkpointing
    return SaveFigures(nodes, per_node, "fp32" if w == 4 else "bf16", math.ceil(params * w / nodes),
                       math.ceil(params * moments / nodes), per_node * SMALL_STATE_BYTES_PER_RANK,
                       ck.node_write_gbps, ck.preemption_grace_s, ck.save_period)


@dataclass(frozen=True)
class MemoryPlan:
    model_name: str
    shape: ModelShape | None
    world: int
    budget: int | None
    phases: tuple[Phase, ...] = ()
    settings: Settings | None = None
    picks: tuple[Pick, ...] = ()
    fits: bool | None = None  # None: no verdict (no budget, or no shape)
    hint: str | None = None  # what would make it fit
    notes: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # policy.generation.tensor_parallel_size
    # the rollout engine's KV budget per GPU under policy.generation.gpu_memory_utilization (what
    # rlscale.workers.policy gives the engine; None: no budget, one slot per sample)
    kv_budget_bytes: int | None = None
    kv_refusal: str | None = None  # when that budget holds no sequence
    save: SaveFigures | None = None  # a checkpoint's bytes and write time per node (the preemption promise)

    @property
    def peak(self) -> Phase | None:
        return _peak(self.phases) if self.phases else None

    def apply(self, cfg: Config) -> Config:
        """cfg with the plan's picks set (a key the user set is never among them)."""
        if not self.picks:
            return cfg
        return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={p.key: p.value for p in self.picks})})

    def as_dict(self) -> dict:
        """The plan as JSON for the run's directory (memory_plan.json): GB per GPU by phase and component."""
        return {"model": self.model_name, "world": self.world, "tensor_parallel_size": self.tensor_parallel_size,
                "budget_gb": None if self.budget is None else self.budget / GB, "fits": self.fits,
                "kv_budget_bytes": self.kv_budget_bytes,
                "picks": {f"policy.{p.key}": p.value for p in self.picks},
                "phases": {ph.name: {"total_gb": ph.total / GB,
                                     "components_gb": {k: v / GB for k, v in ph.components.items() if v}}
                           for ph in self.phases},
                **({"save": self.save.as_dict()} if self.save else {})}

    def refusal(self) -> str | None:
        """One line when the run cannot fit: the phase, its bytes, the budget, what would fit (or
        the rollout engine's KV budget, when it holds no sequence)."""
        if self.kv_refusal:
            return self.kv_refusal
        if self.fits is not False:
            return None
        return (f"memory plan: the {self.peak.name} phase needs {self.peak.total / GB:.1f} GB per GPU, more than the "
                f"{usable_bytes(self.budget) / GB:.1f} GB usable of {self.budget / GB:.1f} GB: {self.hint}")

    def lines(self) -> list[str]:
        if self.shape is None:
            return [f"memory plan: no figures: the shape of {self.model_name} is unknown (no config.json here or in "
                    "the Hugging Face cache, not a known shape)"]
        out = [f"memory plan: {self.model_name}, {self.shape.parameter_count() / 1e9:.2f}B parameters, {self.world} "
               f"GPU{'s' if self.world > 1 else ''}; GB (1e9 bytes) per GPU", *(f"  {n}" for n in self.notes),
               f"  {'':24s}" + "".join(f"{COLUMNS.get(ph.name, ph.name):>10s}" for ph in self.phases)]
        for key in dict.fromkeys(key for ph in self.phases for key in ph.components):
            values = [ph.components.get(key, 0) for ph in self.phases]
            if max(values) >= 0.05 * GB:
                out.append(f"  {key:24s}" + "".join(f"{v / GB:10.1f}" for v in values))
        out.append(f"  {'total':24s}" + "".join(f"{ph.total / GB:10.1f}" for ph in self.phases))
        if self.budget is None:
            verdict = "no verdict: no GPU here and cluster.gpu_memory_gb is not set"
        else:
            verdict = (f"budget {self.budget / GB:.1f} GB, {usable_bytes(self.budget) / GB:.1f} usable after "
                       f"{RESERVE_BYTES / GB:g} GB + {RESERVE_FRACTION:.0%} reserved: "
                       + ("refused: the rollout engine's KV budget holds no sequence" if self.kv_refusal
                          else "fits" if self.fits else f"does not fit; {self.hint}"))
        out += [f"  {self.save.line()}"] * bool(self.save)  # a save per node against the spot grace
        out.append(f"  peak: {self.peak.name} {self.peak.total / GB:.1f} GB; {verdict}")
        return out + [f"  picked policy.{p.key}={json.dumps(p.value)}: {p.why}" for p in self.picks]


def plan_memory(cfg: Config, shape: ModelShape | None, budget_bytes: int | None, gpu: bool | None = None) -> MemoryPlan:
    """cfg's plan per GPU, picking the settings the user left open. gpu: whether the workers
    compute on GPUs (default: policy.device cuda, or auto with a budget: a GPU here or
    cluster.gpu_memory_gb)."""
    p, world = cfg.policy, cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    if shape is None:
        return MemoryPlan(p.model_name, None, world, budget_bytes)
    if gpu is None:
        gpu = p.device == "cuda" or (p.device == "auto" and budget_bytes is not None)
    usable = None if budget_bytes is None else usable_bytes(budget_bytes)
    options = _options(cfg, shape, world, gpu, budget_bytes)
    s, phases, fits = _search(cfg, shape, world, gpu, budget_bytes, options)
    sixteen = _compute_bytes(cfg, gpu, s.master_weights) == 2
    micro_batches, tokens = micro_batching(cfg, world, s.train_micro_batch_tokens)
    reference = ("none" if cfg.loss.reference_policy_kl_penalty == 0 else
                 "the base (adapters off)" if p.lora.enabled else
                 "sharded" if world > 1 and s.shard_reference else "whole per GPU")
    master = (f"LoRA rank {p.lora.rank}, frozen base, adapters fp32" if p.lora.enabled else
              f"master weights {s.master_weights if sixteen else 'fp32'}")
    notes = (f"{'bf16' if sixteen else 'fp32'} compute{'' if gpu else ' (CPU workers)'}, {master}, "
             "activation checkpointing "
             f"{'on' if s.activation_checkpointing else 'off'}, policy "
             f"{'kept gathered through the update' if s.keep_gathered else 'gathered one unit at a time'}, "
             f"reference {reference}, {micro_batches} "
             f"micro-batch{'es' if micro_batches > 1 else ''} of {tokens} tokens per optimizer step",)
    tp = p.generation.tensor_parallel_size
    if tp > 1:
        notes += (f"rollout engine tensor-parallel over {tp} GPUs: each holds 1/{tp} of its weights, the KV cache of "
                  f"{shape.tensor_parallel_shard(tp).num_key_value_heads} of {shape.num_key_value_heads} kv heads for "
                  f"its group's samples",)
    kv_budget, kv_note, kv_refusal = _kv_budget(cfg, shape, s, world, gpu, budget_bytes, phases)
    notes += (kv_note,) * bool(kv_note)
    save = save_figures(cfg, shape, s, gpu)
    if usable is None:
        return MemoryPlan(p.model_name, shape, world, None, tuple(phases), s, notes=notes, tensor_parallel_size=tp,
                          save=save)
    picks = tuple(_picks(cfg, shape, world, gpu, budget_bytes, options, s)) if fits else ()
    hint = None if fits else _hint(cfg, shape, world, gpu, budget_bytes, s)
    return MemoryPlan(p.model_name, shape, world, budget_bytes, tuple(phases), s, picks, fits, hint, notes, tp,
                      kv_budget, kv_refusal, save)


def _size(nbytes: int) -> str:
    """Exact bytes, and GB (MB when small) to read them by."""
    if nbytes == 0:
        return "0 bytes"
    return f"{nbytes} bytes ({nbytes / GB:.2f} GB)" if nbytes >= 0.01 * GB else \
        f"{nbytes} bytes ({nbytes / 1e6:.2f} MB)"


def _kv_budget(cfg, shape, s: Settings, world, gpu, budget, phases) -> tuple[int | None, str | None, str | None]:
    """(the engine's KV budget per GPU, a note on it for the table, a refusal when it holds no
    sequence) under policy.generation.gpu_memory_utilization; (None, a note or None, None) without one."""
    gen, length = cfg.policy.generation, cache_length(cfg)
    util = gen.gpu_memory_utilization
    if not kv_limited(cfg, shape, gpu, budget):
        if util is None or gen.backend != "engine":
            return None, None, None
        why = ("no GPU here and cluster.gpu_memory_gb is not set" if budget is None else
               "CPU workers: the engine has one on CUDA only" if not gpu else "the engine does not run this model")
        return None, f"KV cache counted without policy.generation.gpu_memory_utilization={util} (slots × length): " \
                     f"{why}", None
    kv, sequence, unlimited = _kv_sequences(cfg, shape, s, world, gpu, phases)
    others = next(ph for ph in phases if ph.name == "generation").total - kv
    given = f"{util} × {budget / GB:.1f} GB less the {others / GB:.1f} GB the rest of the generation phase holds"
    note = f"KV budget (policy.generation.gpu_memory_utilization={util}): {given}: "
    if kv < sequence:
        # the smallest utilization (to 0.01) that leaves room for one sequence beside the rest
        needed = math.ceil((others + sequence) / budget * 100) / 100
        larger = (f"policy.generation.gpu_memory_utilization={needed:.2f} or more" if needed <= 1 else
                  "no policy.generation.gpu_memory_utilization up to 1 leaves room")
        return kv, note + f"no sequence of {length} positions fits", (
            f"memory plan: policy.generation.gpu_memory_utilization={util} leaves the rollout engine's KV cache "
            f"{_size(kv)} per GPU ({given}), less than the {_size(sequence)} one sequence of "
            f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length} needs ({length} positions): "
            f"it fits with {larger}, a shorter policy.max_total_sequence_length or a larger "
            f"policy.generation.tensor_parallel_size (now {gen.tensor_parallel_size})")
    return kv, note + (f"the cache takes {kv / GB:.2f} GB, {kv // sequence} of the {unlimited // sequence} "
                       f"sequences of {length} positions at once"), None


def _kv_sequences(cfg, shape, s: Settings, world, gpu, phases) -> tuple[int, int, int]:
    """(the KV cache of `phases` per GPU, one sequence's, the cache of one slot per sample) in bytes."""
    kv = int(next(ph for ph in phases if ph.name == "generation").components["KV cache"])
    unlimited = next(ph for ph in _phases(cfg, shape, s, world, gpu, None) if ph.name == "generation"
                     ).components["KV cache"]
    return kv, sequence_kv_bytes(cfg, shape, gpu, s.master_weights), int(unlimited)


def _with_generation(cfg: Config, **settings) -> Config:
    """cfg with these policy.generation settings."""
    generation = cfg.policy.generation.model_copy(update=settings)
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"generation": generation})})


def _picks(cfg, shape, world, gpu, budget, options, chosen: Settings):
    """The open keys' values, each with why."""
    usable = usable_bytes(budget)
    for key, tried in options.items():
        value = getattr(chosen, key)
        if getattr(cfg.policy, key) not in (None, "auto"):
            continue  # the user's
        if key == "master_weights" and len(tried) == 1 or key == "train_micro_batch_tokens" and value == tried[0]:
            continue  # nothing to choose (fp32 compute, fp16), or the derived budget kept as it is
        if key == "shard_reference" and (cfg.loss.reference_policy_kl_penalty == 0 or world == 1
                                         or cfg.policy.lora.enabled):  # LoRA: the reference is the base
            continue
        if key == "keep_gathered" and world == 1 and (cfg.policy.lora.enabled
                                                      or chosen.master_weights in ("bf16", "bf16_stochastic")
                                                      or _compute_bytes(cfg, gpu, chosen.master_weights) == 4):
            continue  # a plain model at one worker there (LoRA, bf16 weights, fp32 compute): nothing to gather
        if len(tried) == 1:
            why = "its weights exceed 10% of the GPU's memory (the default rule)"
        elif value == tried[0]:
            why = f"fits (peak {_peak(_phases(cfg, shape, chosen, world, gpu, budget)).total / GB:.1f} GB)"
        else:
            worse = _peak(_phases(cfg, shape, replace(chosen, **{key: tried[0]}), world, gpu, budget))
            why = f"with {json.dumps(tried[0])} the {worse.name} needs {worse.total / GB:.1f} GB > " \
                  f"{usable / GB:.1f} usable"
        yield Pick(key, value, why)


def _hint(cfg, shape, world, gpu, budget, best: Settings) -> str:
    """What would make it fit: nothing short of a larger tensor-parallel size (a T it fits at)
    below a floor that more GPUs do not lower; else other values of the user's settings, a larger
    T, more GPUs, or less work per GPU."""
    usable, c = usable_bytes(budget), _compute_bytes(cfg, gpu, best.master_weights)
    tp = cfg.policy.generation.tensor_parallel_size
    engine = any(ph.components["rollout-engine weights"] for ph in _phases(cfg, shape, best, world, gpu, budget))
    # what no GPU count shrinks: the engine's copy (1/T of it), and the gathered policy where the
    # user keeps it gathered for the sync (else streamed) or transformers generate gathers it
    gathered = not engine or cfg.policy.keep_gathered is True
    floor = (shape.tensor_parallel_shard(tp).parameter_count() * c if engine else 0) \
        + (shape.parameter_count() * c if gathered else 0)
    free = _options(cfg, shape, world, gpu, budget, free=True)
    no_bf16 = [m for m in free["master_weights"] if m != "bf16" or cfg.policy.master_weights == m]
    keep_master = {**free, "master_weights": no_bf16}
    if floor > usable:
        dtype = "bf16" if c == 2 else "fp32"
        copy = f"whole {dtype} copy" if tp == 1 else f"{dtype} shard (1/{tp} of its weights)"
        what = (f"the rollout engine's {copy}{' and the gathered policy' if gathered else ''}" if engine
                else f"the gathered {dtype} policy (transformers generate gathers it)")
        why = f"{what} alone take{'' if engine and gathered else 's'} {floor / GB:.1f} GB per GPU at any GPU count"
        larger = _larger_tensor_parallel(cfg, shape, world, gpu, budget, keep_master, best)
        return f"{why}: {larger}" if larger else (
            f"{why}, and at no policy.generation.tensor_parallel_size up to cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node} that the model allows it fits")

    def fitting(masters):
        return _search(cfg, shape, world, gpu, budget, {**free, "master_weights": masters})

    s, phases, fits = fitting(no_bf16)
    if not fits:
        larger = _larger_tensor_parallel(cfg, shape, world, gpu, budget, keep_master, best) \
            or _kv_budget_hint(cfg, shape, world, gpu, budget, keep_master, best)
        if larger:
            return larger
        more = next((n for n in (world * 2 ** k for k in range(1, 14)) if cfg.policy.train_global_batch_size % n == 0
                     and _search(cfg, shape, n, gpu, budget, _options(cfg, shape, n, gpu, budget))[2]), None)
        if more:
            return f"it fits on {more} GPUs (cluster.num_nodes × cluster.gpus_per_node, now {world})"
        if "bf16" in free["master_weights"] and cfg.policy.master_weights != "bf16":  # the last resort
            s, phases, fits = fitting(["bf16"])
    if fits:
        caveat = " (whose AdamW rounds small updates away)" if "bf16" == s.master_weights != best.master_weights else ""
        return f"it fits with {_changed(cfg, s, best)}{caveat}, peak {_peak(phases).total / GB:.1f} GB"
    samples = -(-prompts_per_generation(cfg) * cfg.grpo.num_generations_per_prompt // world)
    return (f"shorten policy.max_total_sequence_length (now {cfg.policy.max_total_sequence_length}) or generate fewer "
            f"samples per GPU (now {samples})")


def _changed(cfg, s: Settings, best: Settings, first: str = "") -> str:
    """The settings to set for `s` (the user's that differ from `best`; the plan does the rest)."""
    changed = [key for key in PICKED_KEYS if getattr(s, key) != getattr(best, key)]
    users = [key for key in changed if getattr(cfg.policy, key) not in (None, "auto")]
    return ", ".join([first] * bool(first) + [f"policy.{key}={json.dumps(getattr(s, key))}"
                                              for key in users or ([] if first else changed)])


def _larger_tensor_parallel(cfg, shape, world, gpu, budget, options, best: Settings) -> str | None:
    """'it fits with policy.generation.tensor_parallel_size=T ...' for the smallest T above the
    current one (from 1 under backend=hf: 'policy.generation.backend=engine' then) that the node
    (a divisor of cluster.gpus_per_node) and the model's shape allow and at which the run fits, the
    plan picking the settings the user left open; None when none does or the engine cannot run it."""
    gen, per_node = cfg.policy.generation, cfg.cluster.gpus_per_node
    if not shape.engine_supported(cache_length(cfg)):
        return None
    switch = gen.backend != "engine"
    for size in range(1 if switch else gen.tensor_parallel_size + 1, per_node + 1):
        if per_node % size or shape.tensor_parallel_problem(size):
            continue
        s, phases, fits = _search(_with_generation(cfg, tensor_parallel_size=size, backend="engine"), shape, world,
                                  gpu, budget, options)
        if fits:
            keys = (["policy.generation.backend=engine"] * switch
                    + [f"policy.generation.tensor_parallel_size={size}"] * (size != gen.tensor_parallel_size))
            return f"it fits with {_changed(cfg, s, best, ', '.join(keys))}, peak {_peak(phases).total / GB:.1f} GB"
    return None


def _kv_budget_hint(cfg, shape, world, gpu, budget, options, best: Settings) -> str | None:
    """'it fits with policy.generation.gpu_memory_utilization=U ...' for the largest U (to 0.01;
    below the user's own) at which the run fits with a KV cache that holds one sequence at least:
    the engine then generates its samples in waves of what the cache holds, on the GPUs there are;
    None when no U does, or the engine runs without a KV budget here (CPU, backend=hf)."""
    util = cfg.policy.generation.gpu_memory_utilization
    top = 99 if util is None else math.ceil(util * 100) - 1
    if top < 1 or not kv_limited(_with_generation(cfg, gpu_memory_utilization=top / 100), shape, gpu, budget):
        return None

    def at(percent: int):
        return _search(_with_generation(cfg, gpu_memory_utilization=percent / 100), shape, world, gpu, budget, options)

    # a lower U only shrinks the cache (every phase holds it), so whether the run fits is monotone in U
    low, high = 0, top + 1  # at(low) fits (or low is 0), at(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if at(middle)[2] else (low, middle)
    if low == 0:
        return None
    s, phases, _ = at(low)
    kv, sequence, unlimited = _kv_sequences(cfg, shape, s, world, gpu, phases)
    if kv < sequence:
        return None
    return (f"it fits with {_changed(cfg, s, best, f'policy.generation.gpu_memory_utilization={low / 100:g}')} "
            f"(the rollout engine then holds {kv // sequence} of its {unlimited // sequence} sequences "
            f"at once, generating in waves), peak {_peak(phases).total / GB:.1f} GB")


def plan_for(cfg: Config) -> MemoryPlan:
    """The plan of cfg's run on this machine's GPU (or cluster.gpu_memory_gb); a UserError (one
    line) first when the model's shape cannot be split at policy.generation.tensor_parallel_size."""
    shape = load_shape(cfg.policy.model_name)
    check_tensor_parallel(cfg, shape)
    return plan_memory(cfg, shape, budget_bytes(cfg))


def resolve(cfg: Config) -> tuple[Config, MemoryPlan]:
    """cfg with the plan's picks, and the plan; a UserError (one line) when the run cannot fit."""
    from rlscale.errors import UserError

    plan = plan_for(cfg)
    refusal = plan.refusal()
    if refusal:
        raise UserError(refusal)
    return plan.apply(cfg), plan


def summary_line(plan: MemoryPlan) -> str:
    """One line for a run's start: the peak, the verdict and what was picked."""
    if plan.peak is None:
        return plan.lines()[0]
    verdict = ("no verdict (no GPU here, cluster.gpu_memory_gb not set)" if plan.budget is None
               else f"fits {usable_bytes(plan.budget) / GB:.1f} GB usable")
    picked = "; picked " + ", ".join(f"policy.{p.key}={json.dumps(p.value)}" for p in plan.picks) if plan.picks else ""
    return f"memory plan: peak {plan.peak.total / GB:.1f} GB per GPU ({plan.peak.name}), {verdict}{picked}"
