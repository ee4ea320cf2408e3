"""One typed config tree for a GRPO run.

Defaults live here and nowhere else; they describe the built-in default job (the shipped tiny
model on the arithmetic task). Keys follow NeMo-RL's names so its command lines read naturally.
This module is the schema only (classes, defaults, checks, derived sizes); building a config
from defaults, an optional YAML file and dotted `key.sub=value` overrides is
rlscale/config_loading.py, which checks every value before anything heavy is loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlscale.errors import UserError



class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info):
        """pydantic reads true as 1; a boolean where a number belongs is a mistake."""
        annotation = cls.model_fields[info.field_name].annotation
        numeric = annotation in (int, float) or (
            getattr(annotation, "__args__", None) and set(annotation.__args__) <= {int, float, type(None)})
        if isinstance(value, bool) and numeric:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


class GenerationConfig(_Section):
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int | None = Field(None, ge=1, description="keep only the k most likely tokens")
    max_new_tokens: int = Field(16, ge=1, description="longest response, in tokens")
    stop_strings: list[str] = Field(default_factory=list, description="end a response at these strings")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="end a response at these token ids too, besides the tokenizer's eos id and every "
        "eos id of the model's generation_config.json (NeMo-RL's key of the same name)")
    backend: Literal["engine", "hf"] = Field(
        "engine", description="engine: rlscale's rollout engine (KV cache, CUDA graphs; Qwen2/Qwen3/Llama/"
        "Mistral, others fall back to hf); hf: transformers generate")
    cuda_graphs: bool = Field(True, description="engine on CUDA: replay decode steps as captured CUDA graphs")
    share_prompts: bool = Field(True, description="engine: a group's prompt is prefilled once, its other samples "
                                "holding its whole KV cache blocks too (fewer blocks, one prefill per group)")
    compile: bool = Field(True, description="engine on CUDA: fuse the decode step and its sampling with "
                          "torch.compile before capturing it (compiles at the first generation of each "
                          "sampling mode)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="the rollout engine's tensor-parallel size T: groups of T consecutive ranks on one "
        "node generate together, each holding 1/T of the engine's weights (T must divide cluster.gpus_per_node "
        "and the model's attention heads and intermediate size; NeMo-RL's "
        "policy.generation.vllm_cfg.tensor_parallel_size is the same key)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="engine on CUDA: the fraction of the GPU's memory the rollout engine "
        "may fill; its KV cache gets that fraction of the total less all else the memory plan counts in the "
        "generation phase (moments included), in 128-position blocks that sequences take as they grow (the "
        "rest wait, the newest is preempted when the pool runs out); null = no budget, every sample's full "
        "length at once (NeMo-RL's "
        "policy.generation.vllm_cfg.gpu_memory_utilization is the same key)")

    @model_validator(mode="before")
    @classmethod
    def _vllm_cfg_alias(cls, data: Any) -> Any:
        """NeMo-RL's policy.generation.vllm_cfg.tensor_parallel_size and gpu_memory_utilization are
        rlscale's keys of those names; vllm_cfg's other keys configure vLLM, which rlscale does not
        run: refused by name."""
        if not (isinstance(data, dict) and "vllm_cfg" in data):
            return data
        data = dict(data)
        vllm = data.pop("vllm_cfg")
        if vllm is None:
            return data
        if not isinstance(vllm, dict):
            raise ValueError("policy.generation.vllm_cfg must be a mapping (of tensor_parallel_size and "
                             "gpu_memory_utilization only)")
        read = ("tensor_parallel_size", "gpu_memory_utilization")
        for key in vllm:
            if key not in read:
                raise ValueError(f"policy.generation.vllm_cfg.{key} is not an rlscale setting (of vllm_cfg only "
                                 "tensor_parallel_size and gpu_memory_utilization are read, as the "
                                 "policy.generation keys of those names)")
        for key in read:
            if key in vllm:
                value = vllm[key]
                if key in data and data[key] != value:
                    raise ValueError(f"policy.generation.vllm_cfg.{key}={value} and policy.generation.{key}="
                                     f"{data[key]} disagree (they are one setting: give one)")
                data[key] = value
        return data

    @model_validator(mode="before")
    @classmethod
    def _removed_decode_span_bucket(cls, data: Any) -> Any:
        """policy.generation.decode_span_bucket is gone (measured no faster than the compiled decode
        graph). Its old default, null, is what every resolved config.yaml of older runs holds, and
        what the engine does now: dropped, so that those runs still resume and evaluate."""
        if isinstance(data, dict) and "decode_span_bucket" in data:
            data = dict(data)
            if data.pop("decode_span_bucket") is not None:
                raise ValueError("policy.generation.decode_span_bucket was removed: the compiled decode graph "
                                 "replaced it (flex attention reads only each sequence's live cache blocks); "
                                 "drop the key")
        return data


class OptimizerConfig(_Section):
    lr: float = Field(2e-4, gt=0.0, allow_inf_nan=False, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="AdamW weight decay")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.999), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0.0, allow_inf_nan=False, description="AdamW epsilon")


class SchedulerConfig(_Section):
    warmup_steps: int = Field(5, ge=0, description="linear LR warm-up, in optimizer steps; then decay_style")
    warmup_start_lr: float | None = Field(
        None, ge=0.0, allow_inf_nan=False, description="the LR of the first warm-up step, rising linearly to "
        "policy.optimizer.lr at step warmup_steps (Megatron's lr_warmup_init); null = lr / warmup_steps, "
        "reaching lr at the last warm-up step")
    decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant at lr, or linear / cosine decay to min_lr by "
        "decay_steps (Megatron's lr_decay_style)")
    decay_steps: int | None = Field(
        None, ge=1, description="optimizer step at which a linear or cosine decay reaches min_lr (counted from the "
        "start, warm-up included; Megatron's lr_decay_iters); null = the run's last optimizer step")
    min_lr: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                          description="the LR a linear or cosine decay ends at (Megatron's min_lr)")


# the linear layers of a Llama-style decoder block (Qwen2/2.5/3, Llama, Mistral): LoRA's default targets
LORA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """LoRA adapters (PEFT) on a frozen base (NeMo-RL's policy.dtensor_cfg.lora_cfg: dim = rank)."""
    enabled: bool = Field(False, description="train LoRA adapters instead of the whole model: the base stays "
                          "frozen in policy.dtype, the adapters and their AdamW moments train in fp32, and the KL "
                          "reference is the base itself (the adapters switched off: no second copy)")
    rank: int = Field(8, ge=1, description="the adapters' rank r (NeMo-RL's lora_cfg.dim)")
    alpha: float = Field(16.0, gt=0.0, description="scale: the adapters' product is multiplied by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    target_modules: list[str] | None = Field(
        None, description="names of the linear layers that get adapters; null = every linear layer of the "
        f"decoder blocks ({', '.join(LORA_LINEAR_MODULES)}; NeMo-RL's match_all_linear)")

    @model_validator(mode="after")
    def _targets_exist(self) -> LoraConfig:
        if self.target_modules is not None:
            if not self.target_modules:
                raise ValueError("policy.lora.target_modules is empty: name at least one linear layer, or null for all")
            unknown = [m for m in self.target_modules if m not in LORA_LINEAR_MODULES]
            if unknown:
                raise ValueError(f"policy.lora.target_modules: {', '.join(map(repr, unknown))} match no linear "
                                 f"layer of a decoder block (they are {', '.join(LORA_LINEAR_MODULES)})")
        return self


class PolicyConfig(_Section):
    @model_validator(mode="before")
    @classmethod
    def _precision_alias(cls, data: Any) -> Any:
        """NeMo-RL's policy.precision means the compute dtype over fp32 master weights: rlscale's dtype."""
        if isinstance(data, dict) and "precision" in data:
            data = dict(data)
            precision = data.pop("precision")
            if "dtype" in data and data["dtype"] != precision:
                raise ValueError(f"policy.precision={precision} and policy.dtype={data['dtype']} disagree "
                                 "(they are one setting: give one)")
            data["dtype"] = precision
        return data

    model_name: str = Field("builtin:tiny-arith", description="HF hub id, local path, or builtin:NAME")
    tokenizer_name: str | None = Field(None, description="tokenizer id/path; default: model_name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of forward and backward (NeMo-RL's policy.precision is the same "
        "key); auto = bfloat16 on CUDA, float32 on CPU")
    master_weights: Literal["auto", "fp32", "bf16_stochastic", "bf16"] = Field(
        "auto", description="what the optimizer updates when dtype is 16-bit. fp32: fp32 weights and AdamW "
        "moments, compute in dtype, gradients reduced and accumulated in fp32 (16 bytes a parameter); "
        "bf16_stochastic: bf16 weights, fp32 moments, updates rounded stochastically so small ones are kept "
        "on average (12 bytes); bf16: bf16 weights and moments, small updates round away (8 bytes; only when "
        "asked for); auto = fp32 when the memory plan fits it, else bf16_stochastic")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = CUDA when present")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch threads of a worker on CPU; null = half the cores (the rest score rewards)")
    prompt_format: Literal["auto", "chat", "plain"] = Field(
        "auto", description="auto = tokenizer's chat template when it has one, else plain text")
    trust_remote_code: bool = Field(False, description="allow model code from the hub")
    train_global_batch_size: int = Field(128, ge=1, description="samples per optimizer step")
    train_micro_batch_size: int | None = Field(
        None, ge=1, description="samples per micro-batch per worker, setting its token budget (× "
        "max_total_sequence_length) when train_micro_batch_tokens is null; null = largest divisor of the "
        "per-worker batch ≤ 32")
    train_micro_batch_tokens: int | None = Field(
        None, ge=8, description="tokens per packed forward/backward per worker: whole samples are concatenated "
        "into one row (no padding); null = micro-batch samples × max_total_sequence_length")
    logprob_chunk_tokens: int = Field(
        2048, ge=1, description="tokens per chunk of the LM head and log-softmax (full-vocabulary logits exist "
        "for one chunk at a time)")
    fused_head_loss: bool = Field(
        True, description="take the loss's gradient in the LM head's forward, while each chunk's logits exist "
        "(one head matmul per chunk fewer); false = the head's backward recomputes the logits")
    attention_backend: Literal["auto", "varlen", "sdpa"] = Field(
        "auto", description="attention over packed rows: varlen (FlashAttention by sequence lengths, CUDA), "
        "sdpa (one call per sample), auto = varlen where available")
    activation_checkpointing: bool | None = Field(
        None, description="recompute each layer's activations in the backward: less memory, ~1/3 more compute; "
        "null = the memory plan decides (off when the update fits without it)")
    compile: bool | None = Field(
        None, description="torch.compile each decoder layer (fuses norms, rotary, activations; the first "
        "steps pay the compile time); null = on CUDA, except under FSDP2's casts (fp32 master weights or stochastic "
        "rounding over several workers, or fp32 master weights gathered one unit at a time), where compiling "
        "was measured to take minutes")
    shard_reference: bool | None = Field(
        None, description="FSDP2-shard the frozen reference model over the workers (each logprob pass "
        "all-gathers it); false keeps a whole copy per worker; null = shard only when its weights exceed "
        "10% of a GPU's memory")
    keep_gathered: bool | None = Field(
        None, description="FSDP2: keep the whole policy gathered from the generation through the update and "
        "reduce gradients once per optimizer step (fewest collectives; costs the whole model and its "
        "gradients per GPU); false = gather one unit at a time (for the rollout engine's weight sync, the "
        "sharded reference's logprob pass and the update) and reduce every micro-batch's gradients; "
        "null = the memory plan decides (on when it fits)")
    fsdp_layers_per_unit: int = Field(
        6, ge=1, description="decoder layers per FSDP2 unit when sharded over several workers (one "
        "all-gather and one reduce-scatter per unit): more layers, fewer and larger collectives")
    max_total_sequence_length: int = Field(256, ge=8, description="prompt + response tokens")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="gradient clipping; null disables")
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)

    @model_validator(mode="after")
    def _schedule_fits_lr(self) -> PolicyConfig:
        sched, lr = self.scheduler, self.optimizer.lr
        if sched.warmup_start_lr is not None and sched.warmup_start_lr > lr:
            raise ValueError(f"policy.scheduler.warmup_start_lr={sched.warmup_start_lr:g} is above "
                             f"policy.optimizer.lr={lr:g}: a warm-up rises to lr")
        if sched.decay_style != "constant" and sched.min_lr > lr:
            raise ValueError(f"policy.scheduler.min_lr={sched.min_lr:g} is above policy.optimizer.lr={lr:g}: "
                             f"a {sched.decay_style} decay falls from lr to min_lr")
        if sched.decay_style != "constant" and sched.decay_steps is not None \
                and sched.decay_steps <= sched.warmup_steps:
            raise ValueError(f"policy.scheduler.decay_steps={sched.decay_steps} must come after the warm-up "
                             f"(policy.scheduler.warmup_steps={sched.warmup_steps})")
        return self

    @model_validator(mode="after")
    def _lora_precision(self) -> PolicyConfig:
        if self.lora.enabled and self.master_weights in ("bf16", "bf16_stochastic"):
            raise ValueError(f"policy.master_weights={self.master_weights} with policy.lora.enabled=true: the "
                             "base is frozen and the adapters always train in fp32; drop master_weights (or auto)")
        return self

    @model_validator(mode="after")
    def _master_weights_fit_dtype(self) -> PolicyConfig:
        if self.master_weights in ("bf16", "bf16_stochastic") and self.dtype in ("float32", "float16"):
            raise ValueError(f"policy.master_weights={self.master_weights} keeps bf16 weights, but policy.dtype="
                             f"{self.dtype}; use policy.dtype=bfloat16 (or auto), or master_weights=fp32")
        return self


class LossConfig(_Section):
    ratio_clip_min: float = Field(0.2, ge=0.0, lt=1.0, description="clip ratio below at 1 - this")
    ratio_clip_max: float = Field(0.2, ge=0.0, description="clip ratio above at 1 + this")
    reference_policy_kl_penalty: float = Field(
        0.01, ge=0.0, description="k3 KL weight (beta); 0 drops the reference model")
    token_level_loss: bool = Field(
        True, description="mean over all tokens of the global batch; false: a mean per sequence, then over the "
        "sequences (loss_agg_mode says the same, by verl's names)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = Field(
        None, description="verl's names: token-mean (token_level_loss=true), seq-mean-token-mean "
        "(token_level_loss=false), seq-mean-token-sum-norm (Dr. GRPO: each sequence's token sum over the "
        "constant loss_scale_factor, then the mean over sequences; pair with grpo.normalize_rewards=false); "
        "null = from token_level_loss")
    loss_scale_factor: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="Dr. GRPO's constant normaliser of seq-mean-token-sum-norm "
        "(verl's key); null = policy.generation.max_new_tokens")
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = Field(
        "k3", description="KL estimator on the sampled tokens, r = log(pi_ref / pi): k1 = -r, k2 = r^2 / 2, "
        "k3 = exp(r) - r - 1 (NeMo-RL's key)")
    kl_input_clamp_value: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="clamp the KL's log-ratio r to [-c, c] first; null = "
        "no clamp (NeMo-RL's key; its recipes use 20)")
    kl_output_clamp_value: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="clamp the KL estimate to [-c, c]; null = no clamp "
        "(NeMo-RL's key; its recipes use 10)")
    sequence_level_importance_ratios: bool = Field(
        False, description="GSPO: one ratio per sequence, exp of the mean token log-ratio, clipped to "
        "[1 - sequence_ratio_clip_min, 1 + sequence_ratio_clip_max]; needs token_level_loss=false (NeMo-RL's key)")
    sequence_ratio_clip_min: float | None = Field(
        None, description="GSPO's clip below, in (0, 1) (the paper: 3e-4); null = ratio_clip_min")
    sequence_ratio_clip_max: float | None = Field(
        None, description="GSPO's clip above, in (0, 1) (the paper: 4e-4); null = ratio_clip_max")
    use_importance_sampling_correction: bool = Field(
        False, description="weight each token's policy-gradient term by pi_old / pi_sampler, the rollout "
        "engine's logprobs (sampler/trainer mismatch; needs policy.generation.backend=engine; NeMo-RL's key)")
    truncated_importance_sampling_ratio: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="upper bound of the importance weight; null = not "
        "truncated (NeMo-RL's key)")
    truncated_importance_sampling_ratio_min: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="lower bound for icepop and seq-mask-tis (NeMo-RL's key)")
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = Field(
        None, description="tis: clamp weights to the ratio; icepop: zero tokens whose weight is outside "
        "[ratio_min, ratio]; seq-mask-tis: zero sequences whose geometric-mean weight is outside it (NeMo-RL's key)")
    use_kl_in_reward: bool = Field(
        False, description="the KL penalty in the reward instead of the loss (REINFORCE++; verl's key): each "
        "sample's reward minus reference_policy_kl_penalty × its summed per-token KL of the sampling policy to the "
        "reference, before the advantages; the loss then has no KL term")
    skip_zero_advantage: bool = Field(
        True, description="leave samples with a zero advantage (their group's rewards all agree) out of the "
                          "update's forward and backward: with reference_policy_kl_penalty=0 their gradient is "
                          "exactly 0; with a KL penalty every sample is trained")

    @property
    def kl_in_loss(self) -> float:
        """The KL term's weight in the loss: 0 when the KL goes into the reward (use_kl_in_reward)."""
        return 0.0 if self.use_kl_in_reward else self.reference_policy_kl_penalty

    @model_validator(mode="after")
    def _check_variants(self) -> LossConfig:
        """The loss variants' keys against each other (rlscale.grpo.loss; docs/training.md)."""
        if self.use_kl_in_reward and self.reference_policy_kl_penalty == 0:
            raise ValueError("loss.use_kl_in_reward=true needs loss.reference_policy_kl_penalty > 0, the KL's "
                             "weight in the reward (0 here: no reference model)")
        mode, explicit = self.loss_agg_mode, "token_level_loss" in self.model_fields_set
        if mode in ("token-mean", "seq-mean-token-mean") and explicit \
                and self.token_level_loss != (mode == "token-mean"):
            raise ValueError(f"loss.loss_agg_mode={mode} and loss.token_level_loss="
                             f"{str(self.token_level_loss).lower()} disagree: set one of them")
        if mode == "seq-mean-token-sum-norm" and explicit:
            raise ValueError("loss.loss_agg_mode=seq-mean-token-sum-norm replaces loss.token_level_loss: "
                             "set one of them")
        if self.loss_scale_factor is not None and mode != "seq-mean-token-sum-norm":
            raise ValueError(f"loss.loss_scale_factor={self.loss_scale_factor:g} is only read by "
                             "loss.loss_agg_mode=seq-mean-token-sum-norm")
        gspo = self.sequence_level_importance_ratios
        for key in ("sequence_ratio_clip_min", "sequence_ratio_clip_max"):
            value = getattr(self, key)
            if value is not None and not gspo:
                raise ValueError(f"loss.{key}={value:g} needs loss.sequence_level_importance_ratios=true (GSPO)")
        if gspo:
            if self.aggregation != "seq-mean-token-mean":
                raise ValueError("loss.sequence_level_importance_ratios=true (GSPO) needs a mean per sequence: "
                                 "loss.token_level_loss=false (NeMo-RL's rule)")
            for key, value in (("sequence_ratio_clip_min", self.sequence_clip[0]),
                               ("sequence_ratio_clip_max", self.sequence_clip[1])):
                if not 0.0 < value < 1.0:
                    raise ValueError(f"loss.{key}={value:g} (GSPO's clip range) must be in (0, 1)")
        kind, top, low = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                          self.truncated_importance_sampling_ratio_min)
        if top is not None and not self.use_importance_sampling_correction:
            raise ValueError("loss.truncated_importance_sampling_ratio needs "
                             "loss.use_importance_sampling_correction=true")
        if top is None and (kind is not None or low is not None):
            raise ValueError("loss.truncated_importance_sampling_type and _ratio_min need "
                             "loss.truncated_importance_sampling_ratio (the upper bound) set")
        if top is not None and kind is None:
            raise ValueError("loss.truncated_importance_sampling_ratio needs loss.truncated_importance_sampling_type "
                             "(tis, icepop or seq-mask-tis)")
        if kind in ("icepop", "seq-mask-tis") and (low is None or low > top):
            raise ValueError(f"loss.truncated_importance_sampling_type={kind} needs "
                             f"loss.truncated_importance_sampling_ratio_min at most the ratio ({top:g})")
        if kind == "tis" and low is not None:
            raise ValueError("loss.truncated_importance_sampling_ratio_min is not read by tis "
                             "(icepop and seq-mask-tis)")
        if kind == "seq-mask-tis" and gspo:
            raise ValueError("loss.truncated_importance_sampling_type=seq-mask-tis (token weights, sequence masks) "
                             "and loss.sequence_level_importance_ratios=true do not combine (NeMo-RL's rule)")
        return self

    @property
    def aggregation(self) -> str:
        """loss_agg_mode, or the mode token_level_loss means."""
        return self.loss_agg_mode or ("token-mean" if self.token_level_loss else "seq-mean-token-mean")

    @property
    def sequence_clip(self) -> tuple[float, float]:
        """GSPO's (clip_low, clip_high)."""
        low, high = self.sequence_ratio_clip_min, self.sequence_ratio_clip_max
        return (self.ratio_clip_min if low is None else low, self.ratio_clip_max if high is None else high)

    @property
    def whole_sequences(self) -> bool:
        """The loss of a token depends on its sequence's other tokens (GSPO, seq-mask-tis)."""
        return self.sequence_level_importance_ratios or (
            self.use_importance_sampling_correction and self.truncated_importance_sampling_type == "seq-mask-tis")


def check_loss(cfg: Config) -> None:
    """The loss's keys that depend on other sections."""
    if cfg.loss.use_importance_sampling_correction and cfg.policy.generation.backend != "engine":
        raise ValueError(f"loss.use_importance_sampling_correction=true needs the sampler's logprobs, which "
                         f"policy.generation.backend={cfg.policy.generation.backend} does not return (use engine)")


class RewardShapingConfig(_Section):
    enabled: bool = Field(False, description="add DAPO's overlong soft penalty to each reward: 0 up to "
                          "max_response_length - overlong_buffer_length tokens, then falling linearly to "
                          "-overlong_buffer_penalty at max_response_length (NeMo-RL's keys)")
    overlong_buffer_length: int | None = Field(
        None, ge=1, description="tokens before max_response_length over which the penalty grows; null = a fifth "
        "of max_response_length (DAPO's 4096 of 20480; NeMo-RL requires a number)")
    overlong_buffer_penalty: float | None = Field(1.0, ge=0.0, allow_inf_nan=False,
                                                  description="the penalty at max_response_length (DAPO: 1.0)")
    max_response_length: int | None = Field(None, ge=1, description="response length of the full penalty; "
                                            "null = policy.generation.max_new_tokens")


def check_overlong(cfg: Config) -> None:
    """grpo.reward_shaping against the generation's length; grpo.overlong_filtering against the loss."""
    if cfg.grpo.overlong_filtering and cfg.loss.aggregation != "token-mean":
        # NeMo-RL drops a filtered sample from the sequence count too; the workers' per-sequence
        # normaliser is the optimizer step's sample count (policy.train_global_batch_size)
        raise ValueError(f"grpo.overlong_filtering=true takes truncated samples out of the token-mean loss only; "
                         f"with loss.loss_agg_mode={cfg.loss.aggregation} (a mean over sequences) they would "
                         "still count as sequences, unlike NeMo-RL: use loss.token_level_loss=true")
    shaping = cfg.grpo.reward_shaping
    if not shaping.enabled:
        return
    if shaping.overlong_buffer_penalty is None:
        raise ValueError("grpo.reward_shaping.enabled=true needs grpo.reward_shaping.overlong_buffer_penalty "
                         "(null here)")
    longest, buffer = overlong_lengths(cfg)
    if buffer >= longest:
        raise ValueError(f"grpo.reward_shaping.overlong_buffer_length={buffer} is not shorter "
                         f"than max_response_length={longest}: every response would be penalised (shorten the "
                         "buffer or raise grpo.reward_shaping.max_response_length)")


def overlong_lengths(cfg: Config) -> tuple[int, int]:
    """grpo.reward_shaping's (max_response_length, overlong_buffer_length), nulls resolved."""
    shaping = cfg.grpo.reward_shaping
    longest = shaping.max_response_length or cfg.policy.generation.max_new_tokens
    return longest, shaping.overlong_buffer_length or max(1, longest // 5)


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(32, ge=1, description="prompts sampled per GRPO step")
    num_generations_per_prompt: int = Field(8, ge=2, description="group size")
    max_num_steps: int = Field(200, ge=1, description="GRPO steps in the run")
    normalize_rewards: bool = Field(True, description="divide advantages by the group std where non-zero")
    use_leave_one_out_baseline: bool = Field(True, description="baseline = mean of the other samples")
    advantage_std: Literal["baseline_samples", "group"] = Field(
        "baseline_samples", description="the std normalize_rewards divides by: of the samples the baseline "
        "averages (NeMo-RL's rule: under leave-one-out each sample's std of the others) or of the whole group")
    overlong_filtering: bool = Field(
        False, description="truncated samples (max_new_tokens reached without a stop) get no loss and leave the "
        "loss's normaliser, but keep their reward in their group's baseline (DAPO; NeMo-RL's key)")
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig,
                                                description="DAPO's overlong soft penalty (NeMo-RL's keys)")
    use_dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling: drop groups whose rewards all agree and generate more "
        "prompts until the step holds num_prompts_per_step informative groups (surplus ones are dropped); "
        "NeMo-RL's key")
    batch_multiplier: float = Field(
        1.0, ge=1.0, allow_inf_nan=False, description="with dynamic sampling, a generation round draws "
        "ceil(num_prompts_per_step × this) prompts (NeMo-RL's key)")
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1, description="with dynamic sampling, the most generation rounds a step may take before the run "
        "stops for want of informative groups (NeMo-RL's key)")
    val_period: int = Field(50, ge=0, description="validate every N steps; 0 = only at start/end")
    val_at_start: bool = Field(True, description="validate before the first step")
    val_at_end: bool = Field(True, description="validate after the last step")
    max_val_samples: int = Field(256, ge=1, description="held-out problems per validation")
    val_temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                                   description="validation sampling temperature (0 = greedy)")
    seed: int = Field(42, ge=-(2**62), le=2**62, description="seeds data order, sampling and initialisation")

    @model_validator(mode="after")
    def _check_dynamic_sampling(self) -> GRPOConfig:
        if not self.use_dynamic_sampling and self.batch_multiplier != 1:
            raise ValueError(f"grpo.batch_multiplier={self.batch_multiplier:g} is only read with "
                             "grpo.use_dynamic_sampling=true: set both, or drop batch_multiplier")
        return self


def prompts_per_round(num_prompts: int, batch_multiplier: float) -> int:
    """Prompts a dynamic-sampling round draws: ceil(num_prompts × batch_multiplier) (NeMo-RL's
    rule), the product rounded to 9 decimals first (10 × 1.1 is 11.000000000000002 in floats)."""
    return max(num_prompts, math.ceil(round(num_prompts * batch_multiplier, 9)))


def prompts_per_generation(cfg: Config) -> int:
    """The prompts one generation round of a step draws: num_prompts_per_step, or more with
    dynamic sampling's grpo.batch_multiplier (rlscale.grpo.dynamic_sampling)."""
    g = cfg.grpo
    return prompts_per_round(g.num_prompts_per_step, g.batch_multiplier) if g.use_dynamic_sampling \
        else g.num_prompts_per_step


class ArithmeticConfig(_Section):
    max_operand: int = Field(99, ge=1, description="operands are drawn from 0..max_operand")
    operations: str = Field("+", pattern=r"^[+\-*]+$", description="operators to draw from")
    num_val_problems: int = Field(256, ge=1, description="held-out problems, never used for training")
    seed: int = Field(1234, ge=-(2**62), le=2**62,
                      description="seeds the problem stream and the held-out set (fixed across runs)")


class DataConfig(_Section):
    dataset_name: str = Field(
        "arithmetic",
        description="arithmetic, DeepScaler, gsm8k, OpenMathInstruct-2, jsonl, parquet or huggingface")
    train_path: str | None = Field(None, description="jsonl/parquet training file")
    val_path: str | None = Field(None, description="jsonl/parquet held-out file")
    hf_name: str | None = Field(None, description="dataset id for dataset_name=huggingface")
    hf_subset: str | None = Field(None, description="dataset config name")
    train_split: str = Field("train", description="split used for training")
    val_split: str | None = Field(None, description="held-out split; default: carve val_size off train")
    val_size: int = Field(256, ge=1, description="problems carved off train when no held-out set exists")
    prompt_key: str | None = Field(None, description="field holding the problem; default per preset")
    answer_key: str | None = Field(None, description="field holding the answer; default per preset")
    prompt_template: str | None = Field(None, description="'{problem}' template; default per preset")
    shuffle: bool = Field(True, description="reshuffle every epoch")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)


class RewardsConfig(_Section):
    function: str = Field("math", description="'math' (math-verify on \\boxed{}) or 'module:function'")
    timeout_s: float = Field(5.0, gt=0.0, allow_inf_nan=False, description="per-sample time limit for scoring")
    num_workers: int = Field(2, ge=1, description="scoring processes (per Ray actor when ray_actors > 0)")
    ray_actors: int = Field(0, ge=0, description="score in this many Ray actors across the cluster; "
                            "0 = a process pool beside the controller")


class ClusterConfig(_Section):
    num_nodes: int = Field(1, ge=1, description="nodes")
    gpus_per_node: int = Field(1, ge=1, description="workers per node: one per GPU (or per CPU slot without GPUs)")
    backend: Literal["auto", "local", "ray"] = Field(
        "auto", description="auto = in-process for one worker without cluster.address, else Ray")
    address: str | None = Field(None, description="Ray cluster to join ('auto', 'ray://host:10001'); default: "
                                "RAY_ADDRESS, else a local Ray")
    use_gpus: bool | None = Field(
        None, description="one GPU per worker; null = when the Ray cluster has GPUs and policy.device allows")
    cpus_per_worker: int = Field(1, ge=1, description="CPUs reserved per worker")
    placement_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False,
                                       description="wait this long for the workers' resources")
    collective_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False,
                                        description="torch.distributed collective timeout")
    gpu_memory_gb: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="memory of one GPU, in GB (1e9 bytes), that the memory plan checks a run against; null = "
        "the device's own when a GPU is visible (no verdict on a machine without one)")


class CheckpointingConfig(_Section):
    enabled: bool = Field(True, description="save checkpoints")
    checkpoint_dir: str | None = Field(None, description="default: <logger.log_dir>/checkpoints")
    save_period: int = Field(20, ge=1, description="save every N steps (and at the end)")
    keep_top_k: int | None = Field(2, ge=1, description="best checkpoints kept; newest is always kept")
    metric_name: str | None = Field(None, description="metric ranking checkpoints; null = recency")
    higher_is_better: bool = Field(True, description="direction of metric_name")
    resume: str = Field(
        "auto", description="auto = the newest intact step in checkpoint_dir (damaged newer steps are skipped, "
        "and said so); never = start fresh (refused while checkpoint_dir holds committed steps: nothing is "
        "deleted); a step_N path = resume from that step (verified). YAML true/false = auto/never")
    preemption_grace_s: float = Field(
        15.0, gt=0.0, allow_inf_nan=False,
        description="on SIGTERM/SIGINT: take an emergency save only if the last save's durable time fits "
        "in this many seconds since the signal (a GKE spot node gives non-system pods 15)")
    checkpoint_must_save_by: str | None = Field(
        None, description="wall-clock budget from the start, DD:HH:MM:SS (as in NeMo-RL): save and exit "
        "(code 75) before one more step and its save would pass it; null = no deadline")
    claim_wait_s: float = Field(
        300.0, ge=0.0, allow_inf_nan=False,
        description="a run holds checkpoint_dir while it runs; when another node holds it (perhaps a node "
        "that died, whose lock on NFS/Lustre lasts until its lease ends) wait this long before refusing. "
        "A holder on this node is refused at once")
    async_save: bool = Field(
        True, description="persist in the background while the next rollout runs; false = wait for the commit")
    staging_budget_gb: float = Field(
        32.0, gt=0.0, description="host memory per worker for checkpoint staging buffers (pinned on CUDA); "
        "state beyond it is written during the snapshot, stalling the loop longer")
    writers_per_rank: int = Field(4, ge=1, le=64, description="files and writer (and reader) threads per worker")
    verify_checksums: bool = Field(False, description="check file checksums when resuming (reads every byte)")
    lustre_stripe_count: int | Literal["ranks"] | None = Field(
        None, description="with `lfs` on PATH: `lfs setstripe -c` on each step dir (-1 = all targets; ranks = "
        "the worker count, resolved at load)")
    lustre_stripe_size: str | None = Field(
        None, pattern=r"^[0-9]+[KMG]?$", description="with lustre_stripe_count: `lfs setstripe -S`, e.g. 4M")
    node_write_gbps: float = Field(
        2.0, gt=0.0, allow_inf_nan=False,
        description="GB/s (1e9 bytes) one node sustains writing checkpoint_dir: the memory plan's save time per "
        "node against preemption_grace_s (measure yours with `rlscale bench io`)")


    @field_validator("lustre_stripe_count")
    @classmethod
    def _stripe_count(cls, value: Any) -> Any:
        if isinstance(value, int) and value < -1:
            raise ValueError("expected -1 (every storage target), a count of 0 or more, or ranks")
        return value

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_mode(cls, value: Any) -> str:
        """Older configs said resume: true/false; they mean auto/never."""
        if isinstance(value, bool):
            return "auto" if value else "never"
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return "auto" if value.strip().lower() == "true" else "never"
        if not isinstance(value, str) or not value.strip():
            raise ValueError("expected auto, never or the path of a step_N directory")
        value = value.strip()
        return value.lower() if value.lower() in ("auto", "never") else value

    @field_validator("checkpoint_must_save_by", mode="before")
    @classmethod
    def _deadline_format(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str):  # YAML reads an unquoted 00:03:30:00 as a base-60 number
            raise ValueError(f'expected a quoted "DD:HH:MM:SS" string, got {value!r}')
        parse_duration(value)
        return value.strip()

    def must_save_by_s(self) -> float | None:
        """checkpoint_must_save_by in seconds, or None."""
        return None if self.checkpoint_must_save_by is None else parse_duration(self.checkpoint_must_save_by)


_DURATION_RE = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_duration(text: str) -> float:
    """'DD:HH:MM:SS' -> seconds; ValueError (a one-line message) when malformed."""
    match = _DURATION_RE.match(text.strip())
    if match is None:
        raise ValueError(f'expected "DD:HH:MM:SS" (e.g. "00:03:45:00"), got {text!r}')
    days, hours, minutes, seconds = map(int, match.groups())
    if hours >= 24 or minutes >= 60 or seconds >= 60:
        raise ValueError(f"{text!r}: hours must be < 24, minutes and seconds < 60")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total == 0:
        raise ValueError(f"{text!r} leaves no time to train")
    return float(total)


class WandbConfig(_Section):
    project: str = Field("rlscale", min_length=1, description="Weights & Biases project")
    name: str | None = Field(None, description="W&B run name; null = the log dir's name")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode; null = online when WANDB_API_KEY is set, else offline "
                          "(a WANDB_MODE environment variable wins over null)")


class MlflowConfig(_Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; null = a file store under <log_dir>/mlruns")
    experiment: str = Field(
        "rlscale", min_length=1, description="MLflow experiment name (run name = the log dir's name)")


class LoggerConfig(_Section):
    log_dir: str = Field("runs/default", min_length=1, description="run directory: config, metrics, summary")
    tensorboard_enabled: bool = Field(False, description="write TensorBoard events to <log_dir>/tensorboard")
    wandb_enabled: bool = Field(
        False, description="log to Weights & Biases (pip install 'rlscale[wandb]'); a resumed run "
                           "continues the same W&B run")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases settings")
    mlflow_enabled: bool = Field(
        False, description="log params and metrics to MLflow (pip install 'rlscale[mlflow]'); a resumed "
                           "run continues the same MLflow run")
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig, description="MLflow settings")
    progress: bool = Field(True, description="live progress display on the terminal")
    prometheus_port: int | None = Field(
        None, ge=0, le=65535, description="serve step and checkpoint metrics for Prometheus on this port; null = off")


class Config(_Section):
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)

    @model_validator(mode="after")
    def _check_sizes(self) -> Config:
        derive_sizes(self)  # raises ValueError on impossible combinations
        if self.checkpointing.lustre_stripe_count == "ranks":  # rlscale/lustre.py: one target per rank
            from rlscale.lustre import stripe_count

            self.checkpointing.lustre_stripe_count = stripe_count(
                "ranks", self.cluster.num_nodes * self.cluster.gpus_per_node)
        check_tensor_parallel(self)
        check_loss(self)
        check_overlong(self)
        ckpt = self.checkpointing
        if not ckpt.enabled and ckpt.resume not in ("auto", "never"):
            raise ValueError(f"checkpointing.resume={ckpt.resume} needs checkpointing.enabled=true "
                             "(with checkpointing off nothing is loaded: the run would start fresh)")
        return self

    @property
    def checkpoint_dir(self) -> Path:
        if self.checkpointing.checkpoint_dir:
            return Path(self.checkpointing.checkpoint_dir)
        return Path(self.logger.log_dir) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def digest(self) -> str:
        """Short hash of the resolved config, recorded with every checkpoint."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class DerivedSizes:
    world_size: int
    samples_per_step: int
    optimizer_steps_per_grpo_step: int
    samples_per_worker_per_optimizer_step: int
    micro_batch_size: int
    micro_batches_per_optimizer_step: int  # when every sample is max_total_sequence_length long
    micro_batch_tokens: int  # token budget of a packed micro-batch

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# The metrics a checkpoint's manifest records, i.e. what checkpointing.metric_name can rank by
# (val/* only at validated steps); a test keeps this list equal to what a run writes.
RANKABLE_METRICS = (
    "accuracy", "grpo/overlong_filtered_fraction", "grpo/overlong_penalty_mean", "grpo/zero_std_groups",
    "prompt/cut_fraction", "response/length_mean", "response/truncated_fraction",
    "reward/errors", "reward/mean", "reward/std", "reward/timeouts", "train/clip_fraction", "train/entropy",
    "train/grad_norm", "train/kl", "train/loss", "train/lr", "train/skipped_fraction", "train/token_mult_prob_error",
    "val/accuracy", "val/pass_at_1", "val/response_length", "val/reward_mean",
)


# With weights ~N(0, 0.02) and AdamW's per-step update of about lr, the share of bf16 weights that a
# step changes (bf16_update_kept_fraction; tests/workers/test_precision.py records it): lr 3e-4:
# 100%, 1e-4: 88%, 5e-5: 57%, 3e-5: 30%, 1e-5: 16%, 1e-6: 2.0%, 3e-7: 0.5%.
BF16_VANISHING_LR = 5e-5  # below it, half or more of the updates are rounded away


def _bf16(value: float) -> int:
    """The bf16 value nearest a float (ties to even), as its 16 bits (torch-free, for a start-up note)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def bf16_update_kept_fraction(lr: float, std: float = 0.02, samples: int = 20_000, seed: int = 0) -> float:
    """The share of bf16 weights ~N(0, std) that change when lr is subtracted (AdamW's update size)."""
    rng = random.Random(seed)
    kept = 0
    for _ in range(samples):
        weight = _bf16(rng.gauss(0.0, std))
        as_float = struct.unpack("<f", struct.pack("<I", weight << 16))[0]
        kept += _bf16(as_float - lr) != weight
    return kept / samples


def config_notes(cfg: Config) -> list[str]:
    """Settings that are valid but probably not what was meant, as lines for the user."""
    ckpt, grpo = cfg.checkpointing, cfg.grpo
    notes = []
    lr = cfg.policy.optimizer.lr
    if cfg.policy.master_weights == "bf16" and lr < BF16_VANISHING_LR:
        notes.append(f"warning: policy.master_weights=bf16 at policy.optimizer.lr={lr:g}: an AdamW step changes only "
                     f"~{bf16_update_kept_fraction(lr):.0%} of bf16 weights of scale 0.02 (the rest round away); use "
                     "master_weights=fp32 or bf16_stochastic (auto, the default, picks one of them)")
    most, (full, buffer) = cfg.policy.generation.max_new_tokens, overlong_lengths(cfg)
    if grpo.reward_shaping.enabled and full - buffer >= most:
        notes.append(f"note: grpo.reward_shaping penalises responses longer than {full - buffer} tokens "
                     f"(max_response_length - overlong_buffer_length), but policy.generation.max_new_tokens={most} "
                     "stops them sooner: no response is penalised")
    if ckpt.enabled and ckpt.metric_name and ckpt.metric_name not in RANKABLE_METRICS:
        notes.append(f"note: checkpointing.metric_name={ckpt.metric_name} is not a metric a checkpoint records, so "
                     f"checkpoints are kept by recency; it can be one of {', '.join(RANKABLE_METRICS)}")
    elif ckpt.enabled and ckpt.metric_name and ckpt.metric_name.startswith("val/") \
            and (grpo.val_period == 0 or ckpt.save_period % grpo.val_period):
        why = ("grpo.val_period=0 validates no saved step, so all rank alike (the newest kept)"
               if grpo.val_period == 0 else
               f"only saves at multiples of both checkpointing.save_period={ckpt.save_period} and "
               f"grpo.val_period={grpo.val_period} are validated; the others rank last (make save_period a "
               "multiple of val_period)")
        notes.append(f"note: checkpointing.metric_name={ckpt.metric_name} ranks checkpoints by a held-out metric, "
                     f"but {why}")
    return notes


def derive_sizes(cfg: Config) -> DerivedSizes:
    """Batch arithmetic, computed once; raises ValueError naming the key at fault."""
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs = cfg.policy.train_global_batch_size
    mbs = cfg.policy.train_micro_batch_size
    if samples % gbs:
        raise ValueError(
            f"policy.train_global_batch_size={gbs} must divide grpo.num_prompts_per_step × "
            f"grpo.num_generations_per_prompt = {samples}")
    if gbs % world:
        raise ValueError(
            f"policy.train_global_batch_size={gbs} must be a multiple of the worker count "
            f"cluster.num_nodes × cluster.gpus_per_node = {world}")
    per_worker = gbs // world
    if mbs is None:
        mbs = max(d for d in range(1, min(per_worker, 32) + 1) if per_worker % d == 0)
    if per_worker % mbs:
        raise ValueError(
            f"policy.train_micro_batch_size={mbs} must divide the per-worker batch "
            f"train_global_batch_size / workers = {per_worker}")
    if cfg.policy.generation.max_new_tokens >= cfg.policy.max_total_sequence_length:
        raise ValueError(
            f"policy.generation.max_new_tokens={cfg.policy.generation.max_new_tokens} leaves no room "
            f"for the prompt in policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}")
    tokens = cfg.policy.train_micro_batch_tokens
    if tokens is not None and tokens < cfg.policy.max_total_sequence_length:
        raise ValueError(
            f"policy.train_micro_batch_tokens={tokens} must hold the longest sample, "
            f"policy.max_total_sequence_length={cfg.policy.max_total_sequence_length}")
    if cfg.checkpointing.metric_name is not None and cfg.checkpointing.keep_top_k is None:
        raise ValueError("checkpointing.metric_name needs checkpointing.keep_top_k to rank by")
    return DerivedSizes(
        world_size=world,
        samples_per_step=samples,
        optimizer_steps_per_grpo_step=samples // gbs,
        samples_per_worker_per_optimizer_step=per_worker,
        micro_batch_size=mbs,
        micro_batches_per_optimizer_step=per_worker // mbs,
        micro_batch_tokens=token_budget(cfg.policy, mbs),
    )


def check_tensor_parallel(cfg: Config) -> None:
    """policy.generation.tensor_parallel_size against the cluster and the generation backend; the
    checks that need the model's shape (heads, intermediate size) are the memory plan's
    (rlscale.memory_plan.check_tensor_parallel), made from config.json without the weights."""
    gen, cluster = cfg.policy.generation, cfg.cluster
    size = gen.tensor_parallel_size
    if size == 1:
        return
    if gen.backend != "engine":
        raise ValueError(f"policy.generation.tensor_parallel_size={size} needs policy.generation.backend=engine "
                         f"(backend={gen.backend}: transformers generate holds the whole model on each GPU)")
    world = cluster.num_nodes * cluster.gpus_per_node
    if cluster.gpus_per_node % size or world % size:
        raise ValueError(f"policy.generation.tensor_parallel_size={size} must divide cluster.gpus_per_node="
                         f"{cluster.gpus_per_node} (a group of {size} consecutive ranks generates together on "
                         "one node, never across nodes)")


def flat_dict(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested settings by dotted key (an empty mapping is a value)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flat_dict(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def token_budget(policy: PolicyConfig, micro_batch_size: int) -> int:
    """Tokens per packed micro-batch: policy.train_micro_batch_tokens, else micro-batch samples ×
    the longest sample (the memory a padded micro-batch took)."""
    return policy.train_micro_batch_tokens or micro_batch_size * policy.max_total_sequence_length


def check_reward_spec(spec) -> tuple[str, str]:
    """rewards.function 'package.module:function' -> (module, attribute path), without importing
    anything (load_config in rlscale/config_loading.py checks it, so a dry run does); 'math' -> ('', 'math')."""
    if spec == "math":
        return "", "math"
    module_name, sep, attr_path = (spec if isinstance(spec, str) else "").partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise UserError(f"rewards.function {spec!r} must be 'math' or 'package.module:function'")
    return module_name, attr_path


def iter_reference(model: type[BaseModel] = Config, prefix: str = ""):
    """Yield (dotted key, default, description) for every leaf key: docs/configuration.md's reference."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        key = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from iter_reference(annotation, key + ".")
        else:
            default = field.get_default(call_default_factory=True)
            yield key, default, field.description or ""


def reference_table() -> str:
    """docs/configuration.md's config reference, generated from the config classes."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, description in iter_reference():
        shown = json.dumps(default) if not isinstance(default, tuple) else json.dumps(list(default))
        lines.append(f"| `{key}` | `{shown}` | {description.replace('|', '/')} |")
    return "\n".join(lines)
