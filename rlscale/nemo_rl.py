"""NeMo-RL's GRPO recipes, read as rlscale settings: the mapping table.

A recipe (NeMo-RL's examples/configs/grpo_math_*.yaml, v0.3 to v0.5) arrives here merged and
resolved (rlscale/config_loading.py does `defaults:` and `${...}`). `translate` turns it into an
rlscale tree: a key rlscale has passes unchanged, a NeMo-RL key with a counterpart is moved to it
(`loss_fn.*` to `loss.*`, the Megatron optimizer and scheduler of the active training backend to
`policy.optimizer.*`, `policy.scheduler.*` and `policy.master_weights`, ...), and a NeMo-RL key
that rlscale does not act on is dropped and listed once, with what rlscale does instead. A key
that changes the algorithm (dual-clip, async GRPO, ...) is dropped only at its
neutral value; any other value is refused, since the run would not be the recipe's. A key known
to neither, also inside a section rlscale ignores, is an error naming the key and its file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rlscale.errors import UserError
from rlscale.errors import _capped as capped

_ANY = object()  # an ignored key's every value is faithful
COMMAND_LINE = "on the command line"  # what `where(key)` says of an override


@dataclass(frozen=True)
class Ignored:
    """A NeMo-RL key rlscale does not act on: why (what rlscale does instead), and the values at
    which dropping it keeps the recipe's run (_ANY: all)."""
    reason: str
    neutral: Any = _ANY


FSDP2 = "rlscale trains with FSDP2 over all GPUs"
MEGATRON_OFF = "policy.megatron_cfg.enabled is false: NeMo-RL does not read this either"
DTENSOR_OFF = "policy.dtensor_cfg.enabled is false: NeMo-RL does not read this either"
FSDP_OPT_OFF = ("policy.megatron_cfg is enabled: NeMo-RL trains with megatron_cfg.optimizer/scheduler, mapped "
                "to policy.optimizer.* and policy.scheduler.*")
ENGINE = "rlscale's rollout engine generates in vLLM's place (paged KV cache, CUDA graphs)"
PACKING = "rlscale always packs whole samples into micro-batches of policy.train_micro_batch_tokens"

# NeMo-RL sections rlscale has no section for: a key under one that is not in IGNORED (or mapped)
# is a typo, refused by name.
NEMO_ONLY_SECTIONS = (
    "policy.megatron_cfg.", "policy.dtensor_cfg.", "policy.sequence_packing.", "policy.dynamic_batching.",
    "policy.generation.vllm_cfg.", "policy.generation.colocated.", "policy.tokenizer.", "policy.optimizer.kwargs.",
    "grpo.reward_scaling.", "grpo.async_grpo.", "env.", "logger.gpu_monitoring.",
    "logger.swanlab.", "logger.tensorboard.",
)

# Keys whose value is free-form (a mapping of anything): one entry covers all below it.
# A free-form section whose IGNORED entry has a neutral value ({} or null) is refused when it holds keys.
OPEN_SECTIONS = ("policy.generation.vllm_kwargs", "policy.hf_config_overrides", "policy.megatron_cfg.env_vars",
                 "policy.tokenizer.chat_template_kwargs", "logger.tensorboard",
                 "policy.dtensor_cfg.custom_parallel_plan",
                 "policy.dtensor_cfg.automodel_kwargs")

# NeMo-RL's names that are rlscale's too, under a section rlscale otherwise does not have
# (rlscale.config.GenerationConfig reads them, and checks they agree with policy.generation's own)
PASSTHROUGH = ("policy.generation.vllm_cfg.tensor_parallel_size", "policy.generation.vllm_cfg.gpu_memory_utilization")

IGNORED: dict[str, Ignored] = {
    # grpo
    "grpo.max_rollout_turns": Ignored("rlscale's math task is one turn (prompt, answer)", 1),
    "grpo.max_num_epochs": Ignored("rlscale runs grpo.max_num_steps steps, passing over the data as often as needed"),
    "grpo.val_batch_size": Ignored("rlscale generates all grpo.max_val_samples problems of a validation together"),
    # grpo.use_dynamic_sampling, batch_multiplier and dynamic_sampling_max_gen_batches are rlscale's keys too
    # (rlscale.grpo.dynamic_sampling)
    # grpo.overlong_filtering and grpo.reward_shaping.{enabled, overlong_buffer_length, overlong_buffer_penalty,
    # max_response_length} are rlscale's keys too (rlscale.grpo.shaping); newer NeMo-RL's other shaping is not
    "grpo.reward_shaping.stop_properly_penalty_coef": Ignored(
        "rlscale's reward shaping is DAPO's overlong penalty (grpo.reward_shaping.overlong_*)", None),
    "grpo.reward_scaling.enabled": Ignored("rlscale's reward is the verifier's (rewards.function)", False),
    "grpo.reward_scaling.source_min": Ignored("reward scaling is off"),
    "grpo.reward_scaling.source_max": Ignored("reward scaling is off"),
    "grpo.reward_scaling.target_min": Ignored("reward scaling is off"),
    "grpo.reward_scaling.target_max": Ignored("reward scaling is off"),
    "grpo.async_grpo.enabled": Ignored("rlscale's GRPO is synchronous (on-policy); a checkpoint persists during "
                                       "the next rollout (checkpointing.async_save)", False),
    "grpo.async_grpo.max_trajectory_age_steps": Ignored("async GRPO is off"),
    "grpo.async_grpo.in_flight_weight_updates": Ignored("async GRPO is off"),
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": Ignored("async GRPO is off"),
    # loss_fn (the rest of loss_fn are rlscale's loss.* keys)
    "loss_fn.ratio_clip_c": Ignored("rlscale's policy loss is the two-sided clip of loss.ratio_clip_min/max "
                                    "(no dual clip)", None),
    "loss_fn.use_on_policy_kl_approximation": Ignored("rlscale's KL is the k3 estimate on the sampled tokens", False),
    # loss_fn.use_importance_sampling_correction, truncated_importance_sampling_ratio(_min, _type),
    # sequence_level_importance_ratios, reference_policy_kl_type, kl_input/output_clamp_value: rlscale's
    # loss.* keys of the same names (rlscale.grpo.loss)
    "loss_fn.force_on_policy_ratio": Ignored("rlscale takes the ratio against the rollout's logprobs", False),
    # checkpointing
    "checkpointing.model_save_format": Ignored("rlscale saves safetensors (rlscale ckpt export writes a HF model "
                                               "directory)"),
    "checkpointing.save_consolidated": Ignored("rlscale ckpt export STEP OUT consolidates a step on demand"),
    "checkpointing.save_optimizer": Ignored("rlscale always saves the optimizer state (for exact resume)", True),
    # policy
    "policy.generation_batch_size": Ignored("rlscale's engine generates every prompt of the step at once, within "
                                            "policy.generation.gpu_memory_utilization"),
    "policy.logprob_batch_size": Ignored("logprob passes take packed micro-batches of policy.train_micro_batch_tokens "
                                         "(LM head in chunks of policy.logprob_chunk_tokens)"),
    "policy.make_sequence_length_divisible_by": Ignored("rlscale packs samples and pads only what its kernels need"),
    "policy.hf_config_overrides": Ignored("rlscale builds the model from its config.json as published", {}),
    "policy.offload_optimizer_for_logprob": Ignored("rlscale keeps the optimizer state on the GPU; the memory plan "
                                                    "checks it fits"),
    "policy.fsdp_offload_enabled": Ignored("rlscale keeps parameters on the GPU; the memory plan checks they fit",
                                           False),
    "policy.activation_checkpointing_enabled": Ignored("see policy.activation_checkpointing (null = the memory plan "
                                                       "decides)"),
    "policy.tokenizer.chat_template_kwargs": Ignored("rlscale applies the tokenizer's chat template as it is "
                                                     "(policy.prompt_format)", None),
    "policy.sequence_packing.enabled": Ignored(PACKING),
    "policy.sequence_packing.logprob_mb_tokens": Ignored("logprob passes use policy.train_micro_batch_tokens too"),
    "policy.sequence_packing.algorithm": Ignored("rlscale packs samples in its own order (rlscale.workers.packing)"),
    "policy.sequence_packing.sequence_length_round": Ignored("rlscale pads only what its kernels need"),
    "policy.dynamic_batching.enabled": Ignored(PACKING),
    "policy.dynamic_batching.logprob_mb_tokens": Ignored("logprob passes use policy.train_micro_batch_tokens too"),
    "policy.dynamic_batching.sequence_length_round": Ignored("rlscale pads only what its kernels need"),
    "policy.optimizer.kwargs.foreach": Ignored("rlscale picks the AdamW implementation for its precision"),
    "policy.optimizer.kwargs.fused": Ignored("rlscale picks the AdamW implementation for its precision"),
    # generation
    "policy.generation.colocated.enabled": Ignored("rlscale's rollout engine always shares the training GPUs", True),
    "policy.generation.colocated.resources.gpus_per_node": Ignored("generation is colocated", None),
    "policy.generation.colocated.resources.num_nodes": Ignored("generation is colocated", None),
    "policy.generation.vllm_kwargs": Ignored(f"{ENGINE}: no vLLM arguments"),
    "policy.generation.vllm_cfg.async_engine": Ignored(ENGINE, False),
    "policy.generation.vllm_cfg.precision": Ignored("the rollout engine generates in policy.dtype (policy.precision)"),
    "policy.generation.vllm_cfg.pipeline_parallel_size": Ignored(
        "the rollout engine is tensor-parallel only (policy.generation.vllm_cfg.tensor_parallel_size)", 1),
    "policy.generation.vllm_cfg.expert_parallel_size": Ignored("rlscale's models are dense", 1),
    "policy.generation.vllm_cfg.max_model_len": Ignored("the engine holds policy.max_total_sequence_length positions "
                                                        "a sequence"),
    "policy.generation.vllm_cfg.enforce_eager": Ignored(f"{ENGINE}; policy.generation.cuda_graphs=false runs it eager"),
    "policy.generation.vllm_cfg.use_deep_gemm": Ignored(ENGINE),
    "policy.generation.vllm_cfg.num_last_layers_in_bf16": Ignored("the engine generates every layer in policy.dtype"),
    "policy.generation.vllm_cfg.num_first_layers_in_bf16": Ignored("the engine generates every layer in policy.dtype"),
    "policy.generation.vllm_cfg.kv_cache_dtype": Ignored("the engine's KV cache is in policy.dtype", "auto"),
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger": Ignored("rlscale logs the engine's generation metrics "
                                                                     "itself"),
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval": Ignored("rlscale logs generation metrics per step"),
    "policy.generation.vllm_cfg.use_tqdm": Ignored("rlscale shows its own progress (logger.progress)"),
    # dtensor_cfg (NeMo-RL's FSDP2 path)
    "policy.dtensor_cfg.enabled": Ignored(FSDP2),
    "policy.dtensor_cfg.lora_cfg.match_all_linear": Ignored(
        "policy.lora.target_modules=null already takes every linear layer of the decoder blocks", True),
    "policy.dtensor_cfg._v2": Ignored(FSDP2),
    "policy.dtensor_cfg.cpu_offload": Ignored(f"{FSDP2}, on the GPU; the memory plan checks it fits", False),
    "policy.dtensor_cfg.sequence_parallel": Ignored(f"{FSDP2}, no sequence parallelism"),
    "policy.dtensor_cfg.tensor_parallel_size": Ignored(f"{FSDP2}, no training tensor parallelism; generation TP "
                                                       "comes from policy.generation.vllm_cfg.tensor_parallel_size"),
    "policy.dtensor_cfg.context_parallel_size": Ignored(f"{FSDP2}, no context parallelism", 1),
    "policy.dtensor_cfg.custom_parallel_plan": Ignored(FSDP2, None),
    "policy.dtensor_cfg.automodel_kwargs": Ignored(FSDP2),
    # megatron_cfg (NeMo-RL's Megatron path): its optimizer and scheduler map when enabled (below)
    "policy.megatron_cfg.enabled": Ignored(f"{FSDP2} in Megatron's place"),
    "policy.megatron_cfg.converter_type": Ignored("rlscale loads the Hugging Face checkpoint as it is (the "
                                                  "architecture from its config.json): no conversion"),
    "policy.megatron_cfg.tensor_model_parallel_size": Ignored(
        f"{FSDP2}; megatron_cfg.tensor_model_parallel_size is not used; generation TP comes from "
        "policy.generation.vllm_cfg.tensor_parallel_size"),
    "policy.megatron_cfg.pipeline_model_parallel_size": Ignored(f"{FSDP2}: no pipeline stages, every GPU holds a "
                                                                "shard of every layer"),
    "policy.megatron_cfg.num_layers_in_first_pipeline_stage": Ignored(f"{FSDP2}: no pipeline stages"),
    "policy.megatron_cfg.num_layers_in_last_pipeline_stage": Ignored(f"{FSDP2}: no pipeline stages"),
    "policy.megatron_cfg.pipeline_dtype": Ignored(f"{FSDP2}: no pipeline stages; compute in policy.dtype"),
    "policy.megatron_cfg.context_parallel_size": Ignored(f"{FSDP2}, no context parallelism", 1),
    "policy.megatron_cfg.expert_tensor_parallel_size": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.expert_model_parallel_size": Ignored("rlscale's models are dense", 1),
    "policy.megatron_cfg.sequence_parallel": Ignored(f"{FSDP2}, no sequence parallelism"),
    "policy.megatron_cfg.empty_unused_memory_level": Ignored("rlscale frees memory between phases as its memory plan "
                                                             "counts it"),
    "policy.megatron_cfg.freeze_moe_router": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.moe_router_dtype": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.moe_router_load_balancing_type": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.moe_router_bias_update_rate": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.moe_permute_fusion": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.moe_per_layer_logging": Ignored("rlscale's models are dense"),
    "policy.megatron_cfg.apply_rope_fusion": Ignored("policy.compile fuses the rotary embedding"),
    "policy.megatron_cfg.bias_activation_fusion": Ignored("policy.compile fuses the activations"),
    "policy.megatron_cfg.defer_fp32_logits": Ignored("rlscale takes logprobs in fp32 chunk by chunk "
                                                     "(policy.logprob_chunk_tokens)"),
    "policy.megatron_cfg.env_vars": Ignored("rlscale sets no Megatron environment; put variables in the job's "
                                            "runtime env", None),
    "policy.megatron_cfg.fp8_cfg": Ignored("rlscale trains in policy.dtype, no FP8", None),
    "policy.megatron_cfg.fp8_cfg.enabled": Ignored("rlscale trains in policy.dtype, no FP8", False),
    "policy.megatron_cfg.fp8_cfg.fp8": Ignored("FP8 is off"),
    "policy.megatron_cfg.fp8_cfg.fp8_recipe": Ignored("FP8 is off"),
    "policy.megatron_cfg.fp8_cfg.fp8_param": Ignored("FP8 is off"),
    "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32": Ignored(
        "policy.master_weights decides: fp32 reduces gradients in fp32"),
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce": Ignored(FSDP2),
    "policy.megatron_cfg.distributed_data_parallel_config.overlap_param_gather": Ignored(FSDP2),
    "policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp": Ignored(FSDP2),
    "policy.megatron_cfg.distributed_data_parallel_config.data_parallel_sharding_strategy": Ignored(
        f"{FSDP2}, sharding parameters, gradients and optimizer state"),
    "policy.megatron_cfg.distributed_data_parallel_config.average_in_collective": Ignored(FSDP2),
    "policy.megatron_cfg.optimizer.bf16": Ignored("compute dtype is policy.dtype (policy.precision)"),
    "policy.megatron_cfg.optimizer.fp16": Ignored("compute dtype is policy.dtype (policy.precision)", False),
    "policy.megatron_cfg.optimizer.sgd_momentum": Ignored("rlscale's optimizer is AdamW"),
    "policy.megatron_cfg.optimizer.use_distributed_optimizer": Ignored(f"{FSDP2}: optimizer state is sharded"),
    "policy.megatron_cfg.optimizer.use_precision_aware_optimizer": Ignored("policy.master_weights sets the "
                                                                           "optimizer's precision"),
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload": Ignored("optimizer state stays on the GPU; the memory "
                                                                   "plan checks it fits", False),
    "policy.megatron_cfg.optimizer.optimizer_offload_fraction": Ignored("optimizer state stays on the GPU", 0.0),
    "policy.megatron_cfg.scheduler.weight_decay_incr_style": Ignored(
        "rlscale's weight decay is constant (policy.optimizer.weight_decay)", "constant"),
    # data, env, logger
    "data.prompt_file": Ignored("rlscale formats prompts by the dataset preset (data.prompt_template, "
                                "policy.prompt_format)"),
    "data.system_prompt_file": Ignored("rlscale formats prompts by the dataset preset (data.prompt_template)", None),
    "data.max_input_seq_length": Ignored("prompts are cut to policy.max_total_sequence_length - "
                                         "policy.generation.max_new_tokens tokens"),
    "data.num_workers": Ignored("rlscale reads and formats data in the controller"),
    "env.math.math_verify_impl": Ignored("rlscale's math reward is math-verify on the \\boxed{} answer "
                                         "(rewards.function=math)", "hf_math_verify"),
    "env.dapo.num_workers": Ignored("the DAPO environment is not used by a math recipe"),
    "env.dapo.math_verify_impl": Ignored("the DAPO environment is not used by a math recipe"),
    "logger.num_val_samples_to_print": Ignored("rlscale prints validation metrics (val/*), not samples"),
    "logger.swanlab_enabled": Ignored("rlscale logs to TensorBoard, W&B, MLflow and Prometheus, not SwanLab", False),
    "logger.swanlab.project": Ignored("SwanLab is not supported"),
    "logger.swanlab.name": Ignored("SwanLab is not supported"),
    "logger.monitor_gpus": Ignored("rlscale records GPU memory per phase with every step"),
    "logger.gpu_monitoring.collection_interval": Ignored("rlscale records GPU memory per phase with every step"),
    "logger.gpu_monitoring.flush_interval": Ignored("rlscale records GPU memory per phase with every step"),
    "logger.tensorboard": Ignored("TensorBoard takes no settings (logger.tensorboard_enabled)"),
    "logger.mlflow.run_name": Ignored("the MLflow run is named after logger.log_dir"),
}

# NeMo-RL's key -> rlscale's, same value
RENAMED = {
    "env.math.num_workers": "rewards.num_workers",
    "logger.mlflow.experiment_name": "logger.mlflow.experiment",
    # LoRA (NeMo-RL's dtensor_cfg.lora_cfg): the same settings under policy.lora
    "policy.dtensor_cfg.lora_cfg.enabled": "policy.lora.enabled",
    "policy.dtensor_cfg.lora_cfg.dim": "policy.lora.rank",
    "policy.dtensor_cfg.lora_cfg.alpha": "policy.lora.alpha",
    "policy.dtensor_cfg.lora_cfg.dropout": "policy.lora.dropout",
    "policy.dtensor_cfg.lora_cfg.target_modules": "policy.lora.target_modules",
}

# checkpointing.metric_name: NeMo-RL's "val:NAME" / "train:NAME" (and older "val_reward") -> rlscale's metric
METRIC_NAMES = {
    "val_reward": "val/accuracy", "val:accuracy": "val/accuracy", "val:avg_length": "val/response_length",
    "val:pass_at_1": "val/pass_at_1", "val:reward": "val/reward_mean",
    "train:loss": "train/loss", "train:reward": "reward/mean", "train:grad_norm": "train/grad_norm",
    "train:kl": "train/kl", "train:lr": "train/lr",
}

_MEGATRON_DECAY = ("constant", "linear", "cosine")


@dataclass
class Translation:
    tree: dict[str, Any]  # rlscale's, for Config.model_validate
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (NeMo-RL key, what rlscale does instead)
    notes: list[str] = field(default_factory=list)  # values changed to fit rlscale, said once


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for name in sections:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


class _Translator:
    def __init__(self, flat: dict[str, Any], raw: dict[str, Any], where: Callable[[str], str]):
        self.flat, self.raw, self.where = flat, raw, where
        self.out: dict[str, tuple[Any, str]] = {}  # rlscale key -> (value, the key that set it)
        self.result = Translation({})
        # a backend is off only where the config says enabled: false; Megatron trains (its optimizer is
        # the one) where it says enabled: true, or names Megatron's optimizer without saying either
        enabled = flat.get("policy.megatron_cfg.enabled")
        self.megatron_off = enabled is False
        self.megatron = enabled is True or (enabled is None and any(
            k.startswith(("policy.megatron_cfg.optimizer.", "policy.megatron_cfg.scheduler.")) for k in flat))
        self.dtensor_off = flat.get("policy.dtensor_cfg.enabled") is False

    # ---- helpers
    def put(self, key: str, value: Any, source: str) -> None:
        if key in self.out and self.out[key][0] != value:
            other, by = self.out[key]
            ours, theirs = self.where(source) == COMMAND_LINE, self.where(by) == COMMAND_LINE
            if ours != theirs:  # the command line's setting beats the file's
                if ours:
                    self.out[key] = (value, source)
                return
            raise UserError(f"config: {source}={_shown(value)} and {by}={_shown(other)} disagree: both set "
                            f"rlscale's {key} (give one)")
        self.out[key] = (value, source)

    def ignore(self, key: str, reason: str) -> None:
        self.result.ignored.append((key, reason))

    def unknown(self, key: str) -> UserError:
        return UserError(f"unknown config key {capped(key)!r} ({self.where(key)}): neither an rlscale key nor one "
                         "of NeMo-RL's GRPO recipe keys")

    def refuse(self, key: str, value: Any, why: str) -> None:
        shown = _shown(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise UserError(f"config key {capped(key)!r} ({self.where(key)}): {capped(key)}={shown}: {why}")

    # ---- the walk
    def run(self) -> Translation:
        for key, value in self.flat.items():
            self.one(key, value)
        for key, (value, _) in self.out.items():
            _set(self.result.tree, key, value)
        return self.result

    def one(self, key: str, value: Any) -> None:
        open_section = next((s for s in OPEN_SECTIONS if key == s or key.startswith(s + ".")), None)
        if open_section is not None and open_section != key:
            entry = IGNORED[open_section]
            if entry.neutral is not _ANY and not self.inactive(key):
                self.refuse(key, value, f"rlscale does not do this ({entry.reason}); leave "
                                        f"{open_section} {_shown(entry.neutral) if entry.neutral is None else 'empty'}")
            if not any(k == open_section for k, _ in self.result.ignored):
                self.ignore(open_section, entry.reason)  # free-form below: listed once
            return
        if key in PASSTHROUGH:
            return self.put(key, value, key)
        if key.startswith("loss_fn."):
            rest = key[len("loss_fn."):]
            if key in IGNORED:
                return self.ignored_key(key, value)
            return self.put(f"loss.{rest}", value, key)
        handler = getattr(self, "map_" + key.replace(".", "__"), None)
        if handler is not None:
            return handler(key, value)
        if key.startswith("policy.megatron_cfg.optimizer.") or key.startswith("policy.megatron_cfg.scheduler."):
            return self.megatron_optimizer(key, value)
        if key in RENAMED:
            return self.put(RENAMED[key], value, key)
        if key in IGNORED:
            return self.ignored_key(key, value)
        if key + "." in NEMO_ONLY_SECTIONS and value in (None, {}):
            return self.ignore(key, f"{_shown(value) if value is None else 'empty'}: nothing to act on")
        if any(key.startswith(section) for section in NEMO_ONLY_SECTIONS):
            raise self.unknown(key)
        self.put(key, value, key)  # rlscale's own key (or a typo, which the schema names)

    def inactive(self, key: str) -> bool:
        """A key of the training backend the recipe does not use (NeMo-RL reads none of it)."""
        return (key.startswith("policy.megatron_cfg.") and self.megatron_off
                and key != "policy.megatron_cfg.enabled") or \
               (key.startswith("policy.dtensor_cfg.") and self.dtensor_off and key != "policy.dtensor_cfg.enabled")

    def ignored_key(self, key: str, value: Any) -> None:
        entry = IGNORED[key]
        inactive = self.inactive(key)
        if entry.neutral is not _ANY and value != entry.neutral and not inactive \
                and not (isinstance(entry.neutral, dict) and not value):
            self.refuse(key, value, f"rlscale does not do this ({entry.reason}), so the run would not be the "
                                    f"recipe's; set it to {_shown(entry.neutral)} or drop it")
        if inactive:
            return self.ignore(key, MEGATRON_OFF if key.startswith("policy.megatron_cfg.") else DTENSOR_OFF)
        self.ignore(key, entry.reason)

    # ---- keys with a counterpart that needs more than a rename
    def map_policy__tokenizer__name(self, key: str, value: Any) -> None:
        if value != self.flat.get("policy.model_name"):
            self.put("policy.tokenizer_name", value, key)  # the same as the model's: rlscale's null

    def map_policy__generation__backend(self, key: str, value: Any) -> None:
        if value in ("vllm", "megatron"):
            self.ignore(key, f"{_shown(value)}: {ENGINE} (policy.generation.backend=engine)")
            value = "engine"
        self.put("policy.generation.backend", value, key)

    def map_policy__generation__stop_strings(self, key: str, value: Any) -> None:
        self.put("policy.generation.stop_strings", [] if value is None else value, key)

    def map_policy__generation__max_new_tokens(self, key: str, value: Any) -> None:
        total = self.flat.get("policy.max_total_sequence_length")
        raw = self.raw.get(key)
        if isinstance(raw, str) and "${" in raw and isinstance(value, int) and isinstance(total, int) \
                and value >= total:
            # NeMo-RL's recipes write max_new_tokens: ${policy.max_total_sequence_length}: prompt and
            # response share vLLM's max_model_len. rlscale gives the prompt its own room.
            prompt = self.flat.get("data.max_input_seq_length")
            prompt = prompt if isinstance(prompt, int) and 0 < prompt < total else max(1, total // 8)
            self.result.notes.append(
                f"note: policy.generation.max_new_tokens={raw} is {value}, the whole of policy.max_total_sequence_"
                f"length (NeMo-RL lets prompt and response share it); rlscale keeps {prompt} tokens for the "
                f"prompt: max_new_tokens={total - prompt} (set policy.generation.max_new_tokens to choose)")
            value = total - prompt
        self.put(key, value, key)

    def map_policy__logprob_chunk_size(self, key: str, value: Any) -> None:
        if value is None:
            return self.ignore(key, "null: rlscale's LM head runs in chunks of policy.logprob_chunk_tokens")
        self.put("policy.logprob_chunk_tokens", value, key)

    def map_policy__optimizer(self, key: str, value: Any) -> None:
        if value is not None and value != {}:
            self.refuse(key, value, "expected a mapping of optimizer settings or null")

    def map_policy__scheduler(self, key: str, value: Any) -> None:
        if value is None or value == {}:
            return
        if not isinstance(value, list):
            self.refuse(key, value, "expected rlscale's mapping, NeMo-RL's list of torch schedulers, or null")
        if self.megatron:
            return self.ignore(key, FSDP_OPT_OFF)
        self.torch_schedulers(key, value)

    def map_policy__optimizer__name(self, key: str, value: Any) -> None:
        if self.megatron:
            return self.ignore(key, FSDP_OPT_OFF)
        if value not in ("torch.optim.AdamW", "AdamW"):
            self.refuse(key, value, "rlscale's optimizer is AdamW (torch.optim.AdamW)")

    def _fsdp_kwarg(self, key: str, value: Any) -> None:
        if self.megatron:
            return self.ignore(key, FSDP_OPT_OFF)
        self.put("policy.optimizer." + key.rsplit(".", 1)[1], value, key)

    map_policy__optimizer__kwargs__lr = map_policy__optimizer__kwargs__weight_decay = _fsdp_kwarg
    map_policy__optimizer__kwargs__betas = map_policy__optimizer__kwargs__eps = _fsdp_kwarg

    def _train_mb_tokens(self, key: str, value: Any) -> None:
        section = key.rsplit(".", 1)[0]
        if self.flat.get(f"{section}.enabled") is True:
            self.put("policy.train_micro_batch_tokens", value, key)
        else:
            self.ignore(key, f"{section}.enabled is false; rlscale packs micro-batches of "
                             "policy.train_micro_batch_tokens (null = micro-batch size × max_total_sequence_length)")

    map_policy__sequence_packing__train_mb_tokens = map_policy__dynamic_batching__train_mb_tokens = _train_mb_tokens

    def _activation_checkpointing(self, key: str, value: Any) -> None:
        if "megatron_cfg" in key and self.megatron_off:
            return self.ignore(key, MEGATRON_OFF)
        if "dtensor_cfg" in key and (self.dtensor_off or self.megatron):
            return self.ignore(key, DTENSOR_OFF if self.dtensor_off else "policy.megatron_cfg is enabled: NeMo-RL "
                               "trains with Megatron, not this")
        if value is True:
            return self.put("policy.activation_checkpointing", True, key)
        self.ignore(key, f"{_shown(value)}: not forced off; rlscale's memory plan decides "
                         "(policy.activation_checkpointing=null; set it to false to force)")

    map_policy__megatron_cfg__activation_checkpointing = _activation_checkpointing
    map_policy__dtensor_cfg__activation_checkpointing = _activation_checkpointing

    def map_checkpointing__metric_name(self, key: str, value: Any) -> None:
        if isinstance(value, str) and (value in METRIC_NAMES or value.startswith(("val:", "train:"))):
            prefix, _, name = value.partition(":")
            value = METRIC_NAMES.get(value, f"{prefix}/{name}")
        self.put(key, value, key)

    # ---- Megatron's optimizer and scheduler
    def megatron_optimizer(self, key: str, value: Any) -> None:
        name = key.rsplit(".", 1)[1]
        if key in IGNORED:
            return self.ignored_key(key, value)
        if not _megatron_key(key):
            raise self.unknown(key)
        if not self.megatron:
            return self.ignore(key, MEGATRON_OFF)
        simple = {"lr": "policy.optimizer.lr", "weight_decay": "policy.optimizer.weight_decay",
                  "adam_eps": "policy.optimizer.eps", "clip_grad": "policy.max_grad_norm",
                  "min_lr": "policy.scheduler.min_lr", "lr_warmup_iters": "policy.scheduler.warmup_steps",
                  "lr_warmup_init": "policy.scheduler.warmup_start_lr",
                  "lr_decay_iters": "policy.scheduler.decay_steps"}
        if name in simple:
            return self.put(simple[name], value, key)
        if name in ("adam_beta1", "adam_beta2"):
            beta1 = self.flat.get("policy.megatron_cfg.optimizer.adam_beta1", 0.9)
            beta2 = self.flat.get("policy.megatron_cfg.optimizer.adam_beta2", 0.999)
            return self.put("policy.optimizer.betas", [beta1, beta2], key)
        if name == "optimizer":
            if value != "adam":
                self.refuse(key, value, "rlscale's optimizer is AdamW (Megatron's adam, decoupled weight decay)")
            return
        if name == "params_dtype":
            master = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}.get(value)
            if master is None:
                self.refuse(key, value, "rlscale keeps master weights in float32 or bfloat16")
            return self.put("policy.master_weights", master, key)
        if name == "lr_decay_style":
            if value not in _MEGATRON_DECAY:
                self.refuse(key, value, f"rlscale's LR decays are {', '.join(_MEGATRON_DECAY)}")
            return self.put("policy.scheduler.decay_style", value, key)
        if name in ("start_weight_decay", "end_weight_decay"):
            decay = self.flat.get("policy.megatron_cfg.optimizer.weight_decay")
            if value != decay:
                self.refuse(key, value, f"rlscale's weight decay is constant, policy.optimizer.weight_decay "
                                        f"({_shown(decay)} here)")
            return self.ignore(key, "equal to megatron_cfg.optimizer.weight_decay: rlscale's constant "
                                    "policy.optimizer.weight_decay")

    # ---- NeMo-RL's FSDP scheduler list
    def torch_schedulers(self, key: str, entries: list) -> None:
        """[LinearLR warm-up, ConstantLR or CosineAnnealingLR, {milestones: [N]}] -> policy.scheduler.*"""
        lr = self.flat.get("policy.optimizer.kwargs.lr", self.flat.get("policy.optimizer.lr"))
        steps = [e for e in entries if isinstance(e, dict) and "name" in e]
        names = [str(e["name"]).rsplit(".", 1)[-1] for e in steps]
        if not steps or len(steps) > 2 or any(not isinstance(e, dict) for e in entries):
            self.refuse(key, entries, "rlscale reads a LinearLR warm-up, optionally followed by ConstantLR or "
                                      "CosineAnnealingLR")
        first = steps[0].get("kwargs") or {}
        if names[0] == "LinearLR" and first.get("end_factor", 1.0) == 1.0:
            self.put("policy.scheduler.warmup_steps", int(first.get("total_iters", 5)), key)
            if isinstance(lr, (int, float)):
                self.put("policy.scheduler.warmup_start_lr", lr * float(first.get("start_factor", 1 / 3)), key)
            rest = names[1:]
        else:
            self.put("policy.scheduler.warmup_steps", 0, key)
            rest = names
        if rest == ["CosineAnnealingLR"]:
            cosine = steps[-1].get("kwargs") or {}
            self.put("policy.scheduler.decay_style", "cosine", key)
            self.put("policy.scheduler.min_lr", float(cosine.get("eta_min", 0.0)), key)
            warmup = self.out["policy.scheduler.warmup_steps"][0]
            if "T_max" in cosine:
                self.put("policy.scheduler.decay_steps", warmup + int(cosine["T_max"]), key)
        elif rest not in ([], ["ConstantLR"]) or (rest == ["ConstantLR"]
                                                   and (steps[-1].get("kwargs") or {}).get("factor", 1.0) != 1.0):
            self.refuse(key, entries, "rlscale reads a LinearLR warm-up, optionally followed by ConstantLR "
                                      "(factor 1) or CosineAnnealingLR")


_MEGATRON_OPTIMIZER_KEYS = {
    "optimizer", "lr", "min_lr", "weight_decay", "bf16", "fp16", "params_dtype", "adam_beta1", "adam_beta2",
    "adam_eps", "sgd_momentum", "use_distributed_optimizer", "use_precision_aware_optimizer", "clip_grad",
    "optimizer_cpu_offload", "optimizer_offload_fraction"}
_MEGATRON_SCHEDULER_KEYS = {"start_weight_decay", "end_weight_decay", "weight_decay_incr_style", "lr_decay_style",
                            "lr_decay_iters", "lr_warmup_iters", "lr_warmup_init"}


def _megatron_key(key: str) -> bool:
    """True when `key` is one of NeMo-RL's policy.megatron_cfg keys."""
    if key.startswith("policy.megatron_cfg.optimizer."):
        return key.rsplit(".", 1)[1] in _MEGATRON_OPTIMIZER_KEYS
    if key.startswith("policy.megatron_cfg.scheduler."):
        return key.rsplit(".", 1)[1] in _MEGATRON_SCHEDULER_KEYS
    return key in IGNORED or key == "policy.megatron_cfg.activation_checkpointing" \
        or any(key == s or key.startswith(s + ".") for s in OPEN_SECTIONS)


def translate(flat: dict[str, Any], raw: dict[str, Any], where: Callable[[str], str]) -> Translation:
    """NeMo-RL's keys in `flat` (dotted key -> resolved value) as rlscale's tree; `raw` holds the
    values before interpolation, `where(key)` names the file (or the command line) that set a key."""
    return _Translator(flat, raw, where).run()
