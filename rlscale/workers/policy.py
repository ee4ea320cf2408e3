"""The policy worker: a plain class holding the model, its optimizer and the frozen reference.

It knows nothing of Ray or of the GRPO loop; the controller calls its methods through a worker
group, in this process or in a Ray actor (one per GPU). The models are built in
rlscale.workers.model_setup, their logprobs come from rlscale.models.logprob_head, and
generation goes through the rollout engine (rlscale.rollout) or, for the model families it does
not cover, transformers generate (rlscale.workers.hf_generate).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import warnings

import torch

from rlscale import memory_plan
from rlscale.config import Config, derive_sizes, token_budget
from rlscale.errors import UserError
from rlscale.grpo.loss import grpo_token_loss, importance_weights, kl_estimate, loss_weights
from rlscale.models import PromptRenderer, load_tokenizer, pick_device, stop_token_ids
from rlscale.models.logprob_head import packed_logprobs
from rlscale.models.lora import BaseNamesView, adapters_disabled, merged_by_layer, merged_pairs
from rlscale.models.prompts import decode_responses
from rlscale.workers.batch import Rollouts, TrainBatch
from rlscale.rollout import (RolloutEngine, SamplingParams, StopStrings, TensorParallel,
                             unsupported_reason)
from rlscale.telemetry.memory import PhasePeaks
from rlscale.telemetry.torch_profile import CallProfiler
from rlscale.workers.compute_copy import ComputeCopy
from rlscale.workers.hf_generate import hf_generate
from rlscale.workers.model_setup import auto_compile, build_policy, build_reference
from rlscale.workers.packing import PackedMicroBatch, filler_pack, pack_batch, to_device
from rlscale.workers import distributed, precision, state_io


# train metrics averaged over the trained tokens (not over every response token: a sample left out
# of the update, see rlscale.grpo.carries_gradient, has no forward to measure them on)
TRAINED_TOKEN_MEANS = ("entropy", "token_mult_prob_error", "is_ratio_mean", "is_weight_mean", "is_kept_fraction")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier: linear warm-up over `warmup_steps` optimizer steps, then constant."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def lr_factor(step: int, scheduler, lr: float, total_steps: int) -> float:
    """LR multiplier at optimizer step `step` (from 0) for policy.scheduler: the warm-up (from
    warmup_start_lr when set, as Megatron's lr_warmup_init), then constant or a linear / cosine
    decay to min_lr by decay_steps (default: the run's last step, `total_steps`)."""
    warmup = scheduler.warmup_steps
    if warmup > 0 and step < warmup:
        if scheduler.warmup_start_lr is None:
            return warmup_factor(step, warmup)
        start = scheduler.warmup_start_lr / lr
        return start + (1.0 - start) * step / warmup
    if scheduler.decay_style == "constant":
        return 1.0
    end = scheduler.decay_steps or max(total_steps, warmup + 1)
    done = min(1.0, max(0.0, (step - warmup) / max(1, end - warmup)))
    keep = 1.0 - done if scheduler.decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    floor = scheduler.min_lr / lr
    return floor + keep * (1.0 - floor)


class PolicyWorker(state_io.CheckpointableWorker):
    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1, distributed_group: bool | None = None):
        """distributed_group: join torch.distributed and shard with FSDP2 (default: when world_size > 1);
        False builds a plain replica, as tests of rank-aware code in one process do."""
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.profiler = CallProfiler(rank)
        policy = cfg.policy
        torch.manual_seed(cfg.grpo.seed + rank)
        random.seed(cfg.grpo.seed + rank)
        self.device = pick_device(policy.device)
        self.precision = precision.resolve_precision(policy, self.device)
        self.dtype = self.precision.compute  # of forward passes, the reference and the rollout engine
        if self.device.type == "cpu":
            # OpenMP threads spin-wait: with every core taken, one busy core (the reward pool, a
            # second worker) makes each small matmul wait for a descheduled thread.
            torch.set_num_threads(policy.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
        # null (no memory plan was made): keep the policy gathered, the fastest way when it fits
        self.keep_gathered = policy.keep_gathered is not False
        # FSDP2 over the workers; at one worker, fp32 master weights gathered one unit at a time
        # are an FSDP2 group of one, and kept gathered a bf16 compute copy (precision.one_worker_layout)
        layout = self.precision.one_worker_layout(self.keep_gathered)
        self.sharded = (world_size > 1 or layout == "fsdp") if distributed_group is None else distributed_group
        if self.sharded:
            if self.device.type == "cuda":
                torch.cuda.set_device(distributed.local_gpu_index())
            distributed.init_process_group(rank, world_size, self.device, cfg.cluster.collective_timeout_s)
        # tensor-parallel generation: the T consecutive ranks of a group generate one batch together
        self.tp = self._tensor_parallel(policy.generation.tensor_parallel_size)
        self.tokenizer = load_tokenizer(policy.tokenizer_name or policy.model_name, policy.trust_remote_code,
                                        "policy.tokenizer_name" if policy.tokenizer_name else "policy.model_name")
        # every id that ends a response: policy.generation.stop_token_ids, the tokenizer's and the model's eos
        self.stop_ids = stop_token_ids(policy.model_name, self.tokenizer, policy.generation.stop_token_ids,
                                       policy.trust_remote_code)
        self.renderer = PromptRenderer(
            self.tokenizer, policy.prompt_format,
            max_prompt_tokens=policy.max_total_sequence_length - policy.generation.max_new_tokens)
        self.compiled = policy.compile if policy.compile is not None else \
            auto_compile(self.device, self.precision, self.sharded)
        self.model = build_policy(policy, self.precision, self.device, self.sharded, world_size, self.compiled,
                                  seed=cfg.grpo.seed)
        self.compute_copy = ComputeCopy(self.model, self.dtype) \
            if not self.sharded and layout == "compute_copy" else None
        self._rollout: RolloutEngine | None = None
        self._rollout_unsupported = False
        self.last_generation_timings: dict[str, float] = {}
        self.reference, self.reference_sharded = None, False
        self.lora = policy.lora.enabled
        if cfg.loss.reference_policy_kl_penalty > 0 and self.lora:
            # the policy itself with its adapters switched off (self._as_reference), sharded as it is
            self.reference, self.reference_sharded = self.model, self.sharded
        elif cfg.loss.reference_policy_kl_penalty > 0:
            self.reference, self.reference_sharded = build_reference(policy, self.dtype, self.device, world_size,
                                                                     self.compiled)
        self.memory = PhasePeaks(self.device)  # measured per phase, reported with each update
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = precision.make_optimizer(trained, policy.optimizer, self.precision,
                                                  self.device, seed=cfg.grpo.seed * 1009 + rank)
        sched, lr = policy.scheduler, policy.optimizer.lr
        total = cfg.grpo.max_num_steps * derive_sizes(cfg).optimizer_steps_per_grpo_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, sched, lr, total))

    def _tensor_parallel(self, size: int) -> TensorParallel | None:
        """This rank's tensor-parallel group for the rollout engine; None without tensor parallelism."""
        if size == 1:
            return None
        if not self.sharded or self.world_size % size:
            raise UserError(f"policy.generation.tensor_parallel_size={size} needs a multiple of {size} workers "
                            f"in one torch.distributed group; this run has {self.world_size}"
                            + ("" if self.sharded else " (not distributed)"))
        group, rank = distributed.tensor_parallel_groups(size)
        return TensorParallel(rank=rank, size=size, group=group)

    def ready(self) -> dict:
        """Small facts the controller needs; also tells a worker group the worker is up."""
        return {"pad_token_id": self.tokenizer.pad_token_id, "device": str(self.device), "rank": self.rank}

    def hostname(self) -> str:
        """The machine (a pod's name on Kubernetes) this worker runs on: its pod's stop requests
        are this run's to obey (rlscale.preemption.StopRequests)."""
        import socket

        return socket.gethostname()

    # ------------------------------------------------------------------ generation

    def generate(self, texts: list[str], params: SamplingParams, update_follows: bool = False,
                 sample_ids: list[int] | None = None) -> Rollouts:
        """Sample one response per prompt text (repeat texts for groups).

        update_follows: the next call is `train` on these samples, with the same weights, so
        FSDP2 parameters gathered for the engine stay gathered for the update's first forward
        (one all-gather of the model per step instead of two).
        sample_ids: each text's index in the controller's whole request; with params.seed they key
        the engine's sampling, so that a sample's tokens do not depend on how the request is split
        over the workers or tensor-parallel groups (rlscale.controller.generate_rollouts)."""
        if sample_ids is not None and len(sample_ids) != len(texts):
            raise ValueError(f"generate: {len(sample_ids)} sample ids for {len(texts)} texts")
        with self.profiler.around("generate"), torch.no_grad(), self.computing():
            rollouts = self._generate(texts, params, update_follows, sample_ids)
        self.memory.end("generation")
        return rollouts

    def _generate(self, texts: list[str], params: SamplingParams, update_follows: bool,
                  sample_ids: list[int] | None) -> Rollouts:
        prompt_ids, prompt_cut = self.renderer.render_all(texts)
        engine = self._rollout_engine()
        if engine is None:
            rollouts = hf_generate(self.model, self.tokenizer, prompt_ids, params, self.device, self.sharded,
                                   self.stop_ids)
            return dataclasses.replace(rollouts, prompt_cut=prompt_cut)
        tok = self.tokenizer
        self._sync_engine(engine, keep=update_follows and self.keep_gathered)
        self.profiler.mark("gather and sync weights")
        self.memory.end("weight sync")  # the engine's first build and capture included
        # a tensor-parallel group generates its ranks' prompts as one batch, each rank keeping its share
        prompts, ids, mine = self._tensor_parallel_batch(prompt_ids, sample_ids)
        if prompts:
            out = engine.generate(
                prompts, params.max_new_tokens, params.mode,
                eos_ids=self.stop_ids, pad_id=tok.pad_token_id,
                stop_check=StopStrings(tok, params.stop_strings) if params.stop_strings else None,
                seed=params.seed, sample_ids=ids)
            tokens, logprobs, stopped = out.tokens[mine], out.logprobs[mine], out.stopped[mine]
            self.last_generation_timings = out.timings
        else:  # nothing to generate in this group (fewer prompts than workers)
            tokens, logprobs, stopped = [], [], []
        self.profiler.mark("engine generate")
        decoded = decode_responses(tok, tokens)
        return Rollouts(prompt_ids=prompt_ids, response_ids=tokens, texts=decoded,
                        truncated=[not s for s in stopped], logprobs=logprobs, prompt_cut=prompt_cut)

    def _sync_engine(self, engine: RolloutEngine, keep: bool) -> None:
        """The policy's current weights into the engine, in place, device to device (the engine
        then decodes alone). With policy.keep_gathered the whole model is gathered (and kept so
        for the update when `keep`); otherwise one FSDP2 unit at a time (the transient memory of
        one unit: what the memory plan counts on when the gathered model does not fit)."""
        if self.lora:  # base + adapters merged afresh (this rank's tensor-parallel slice only)
            if self.sharded and not self.keep_gathered:  # one FSDP2 unit gathered at a time
                filled = distributed.streamed_sync(
                    self.model, lambda pairs: engine.weights.copy_named(merged_pairs(self.model, pairs)))
            else:  # one decoder layer at a time, of the model gathered whole
                with distributed.gathered(self.model, self.sharded, keep=keep):
                    filled = [name for layer in merged_by_layer(self.model) for name in engine.weights.copy_named(layer)]
            missing = engine.weights.missing_after(filled)
            if missing:
                raise ValueError(f"rollout engine: the merged sync left {missing[:3]} unfilled")
            return
        if self.sharded and not self.keep_gathered:
            filled = distributed.streamed_sync(self.model, engine.weights.copy_named)
            missing = engine.weights.missing_after(filled)
            if missing:
                raise ValueError(f"rollout engine: the streamed sync left {missing[:3]} unfilled")
            return
        with distributed.gathered(self.model, self.sharded, keep=keep):
            engine.sync_weights(self.model)

    def _tensor_parallel_batch(self, prompt_ids: list[list[int]], sample_ids: list[int] | None):
        """The batch this rank's engine generates: its own prompts without tensor parallelism;
        with it, the prompts of every rank of its group, in group rank order (all_gather_object).
        Returns (prompts, their sample ids or None, the slice of the result that is this rank's)."""
        if self.tp is None:
            return prompt_ids, sample_ids, slice(None)
        import torch.distributed as dist

        shares: list = [None] * self.tp.size
        dist.all_gather_object(shares, (prompt_ids, sample_ids), group=self.tp.group)
        start = sum(len(prompts) for prompts, _ in shares[:self.tp.rank])
        prompts = [p for share, _ in shares for p in share]
        ids = None if any(i is None for _, i in shares) else [i for _, share in shares for i in share]
        return prompts, ids, slice(start, start + len(prompt_ids))

    def _rollout_engine(self) -> RolloutEngine | None:
        """Built at the first generation; None when configured off or the model is not supported."""
        gen = self.cfg.policy.generation
        if gen.backend != "engine" or self._rollout_unsupported:
            return None
        if self._rollout is None:
            max_length = memory_plan.cache_length(self.cfg)  # the length the plan counts
            reason = unsupported_reason(self.model.config, max_length)
            if reason:
                self._rollout_unsupported = True
                warnings.warn(f"policy.generation.backend=engine does not support {reason}; "
                              "using transformers generate", stacklevel=2)
                return None
            # built unfilled, from the model's config and parameter names (nothing gathered): the
            # sync before each generation, `_sync_engine`, fills it
            source = BaseNamesView(self.model) if self.lora else self.model
            self._rollout = RolloutEngine(source, self.device, self.dtype, max_length,
                                         use_cuda_graphs=gen.cuda_graphs and self.device.type == "cuda",
                                         compile_decode=gen.compile and self.device.type == "cuda",
                                         tp=self.tp, sync=False, share_prompts=gen.share_prompts)
            if gen.gpu_memory_utilization is not None and self.device.type == "cuda":
                self._rollout.kv_budget_bytes = self._kv_budget(gen.gpu_memory_utilization)
        return self._rollout

    def _kv_budget(self, utilization: float) -> int:
        """The engine's KV budget: vLLM's reading, the engine may fill this fraction of the GPU, less
        all else the generation phase holds. The memory plan's figure (rlscale.memory_plan, made again
        here from the model's config and the run's settings: arithmetic only), not the fraction less
        what is allocated now: the engine is built at the first generation, before the optimizer's
        moments exist, and such a budget would overshoot once they do."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        gb = self.cfg.cluster.gpu_memory_gb  # the plan's budget where the user gave one (memory_plan.budget_bytes)
        shape = memory_plan.ModelShape.from_config(self.model.config.to_dict())
        plan = memory_plan.plan_memory(self.cfg, shape, total if gb is None else int(gb * memory_plan.GB), gpu=True)
        if plan.kv_budget_bytes is not None:
            return plan.kv_budget_bytes
        # no figure (the plan does not take the engine to run this model's shape): what is allocated now
        return max(0, int(utilization * total) - torch.cuda.memory_allocated(self.device))

    # ------------------------------------------------------------------ training

    def _token_budget(self, micro_batch_size: int | None) -> int:
        policy = self.cfg.policy
        return token_budget(policy, micro_batch_size or policy.train_micro_batch_size or 1)

    def _logprobs(self, model, mb: PackedMicroBatch, with_entropy: bool = False, token_loss=None):
        policy = self.cfg.policy
        return packed_logprobs(model, mb, with_entropy, policy.logprob_chunk_tokens, self.compiled, token_loss)

    def compute_logprobs(self, batch: TrainBatch, reference: bool = False,
                         micro_batch_size: int | None = None) -> torch.Tensor:
        """Logprobs of the response targets, [B, L-1] like batch.response_mask (0 elsewhere)."""
        packs = pack_batch(batch, self._token_budget(micro_batch_size))
        model, sharded = (self.reference, self.reference_sharded) if reference else (self.model, self.sharded)
        with self._as_reference(reference):
            pieces = self._pack_logprobs(model, packs, sharded, keep_gathered=False)
        out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
        if pieces:  # one copy back at the end: no stall between the micro-batches' forwards
            rows, cols = torch.cat([mb.rows for mb in packs]), torch.cat([mb.cols for mb in packs])
            out[rows, cols] = torch.cat(pieces).float().cpu()
        return out

    def train(self, steps: list[TrainBatch], global_tokens: list[float], global_samples: int,
              micro_batch_size: int, trained_tokens: list[float] | None = None) -> dict[str, float]:
        """One GRPO update: an optimizer step per batch in `steps` (this worker's share of it).

        global_tokens[i]: response tokens in optimizer step i summed over all workers, so that the
        loss is a token-level mean over the global batch whatever the sharding; global_samples:
        sequences per optimizer step over all workers (for the per-sequence mean).
        micro_batch_size: samples per micro-batch, used for the token budget when
        policy.train_micro_batch_tokens is not set.
        trained_tokens[i]: the response tokens of the samples the workers train on in step i (the
        controller leaves out those without a gradient; default: all of global_tokens); the entropy
        and the sampler/trainer agreement are averaged over all of them (TRAINED_TOKEN_MEANS).
        """
        trained_tokens = global_tokens if trained_tokens is None else trained_tokens
        if not len(steps) == len(global_tokens) == len(trained_tokens):
            raise ValueError(f"{len(steps)} optimizer steps, but {len(global_tokens)} global and "
                             f"{len(trained_tokens)} trained token counts")
        with self.profiler.around("train"):
            stats = self._train(steps, global_tokens, global_samples, micro_batch_size, trained_tokens)
        return {**stats, **self.memory.pop()}  # this step's peaks, its generation's included

    def _train(self, steps: list[TrainBatch], global_tokens: list[float], global_samples: int,
               micro_batch_size: int, trained_tokens: list[float]) -> dict[str, float]:
        budget = self._token_budget(micro_batch_size)
        # one packing per optimizer step, shared by its logprob passes and its update
        packs = [self._micro_batches(batch, budget) for batch in steps]
        self.profiler.mark("pack micro-batches")
        # pi_old must be the policy that sampled: recompute it before the first update when
        # several optimizer steps follow; with one step the current logprobs are pi_old exactly.
        # the policy stays gathered for its update (its last backward reshards)
        old = [self._pack_logprobs(self.model, p, self.sharded, self.keep_gathered, whole=self.keep_gathered)
               if len(steps) > 1 else None
               for p in packs]
        in_loss = self.reference is not None and not self.cfg.loss.use_kl_in_reward  # else sequence_kl's
        keep_ref = self.keep_gathered and self.reference is self.model  # LoRA: gathered on for the update
        with self._as_reference(in_loss):
            ref = [self._pack_logprobs(self.reference, p, self.reference_sharded, keep_ref, whole=self.keep_gathered)
                   if in_loss else None for p in packs]
        self.profiler.mark("old and reference logprobs")
        if len(steps) > 1 or in_loss:
            self.memory.end("logprobs")
        totals: dict[str, float] = {}
        # the trained-token means (entropy, sampler agreement) are over the GRPO step's trained
        # tokens, whichever optimizer step they fell in (one may train nothing); the others are
        # the mean of the optimizer steps' global means
        trained_total = sum(trained_tokens)
        for i, batch in enumerate(steps):
            stats = self._optimizer_step(batch, packs[i], old[i], ref[i], global_tokens[i], global_samples,
                                         max(trained_total, 1.0))
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + (value if key in TRAINED_TOKEN_MEANS else value / len(steps))
        if not trained_total:  # means over no token
            totals.update({key: math.nan for key in TRAINED_TOKEN_MEANS if key in totals})
        return totals

    @torch.no_grad()
    def sequence_kl(self, batch: TrainBatch) -> list[float]:
        """Each sample's per-token KL estimate of the policy that sampled it to the reference
        (loss.reference_policy_kl_type, with its clamps), summed over its response: what
        loss.use_kl_in_reward takes from the reward before the advantages. The same passes as the
        update's logprobs (packed micro-batches, the model gathered as for them)."""
        budget = self._token_budget(None)
        real = len(pack_batch(batch, budget))  # the packs after these are fillers (sharded lockstep)
        packs = self._micro_batches(batch, budget)
        old = self._pack_logprobs(self.model, packs, self.sharded, False, whole=self.keep_gathered)
        with self._as_reference():
            ref = self._pack_logprobs(self.reference, packs, self.reference_sharded, False, whole=self.keep_gathered)
        self.memory.end("logprobs")
        loss = self.cfg.loss
        sums = torch.zeros(len(batch), dtype=torch.float64)
        for mb, pi_old, pi_ref in list(zip(packs, old, ref))[:real]:
            kl = kl_estimate(pi_old.float(), pi_ref.float(), loss.reference_policy_kl_type,
                             loss.kl_input_clamp_value, loss.kl_output_clamp_value)
            sums.index_add_(0, mb.rows, kl.double().cpu())
        return sums.tolist()

    def computing(self):
        """The policy's forwards and backwards: under fp32 master weights at one worker on its bf16
        compute copy (rlscale.workers.compute_copy); otherwise as it is."""
        return self.compute_copy.computing() if self.compute_copy else contextlib.nullcontext()

    def _as_reference(self, active: bool = True):
        """The reference's passes: under LoRA the policy itself with its adapters off (the base)."""
        return adapters_disabled(self.model) if active and self.lora else contextlib.nullcontext()

    @torch.no_grad()
    def _pack_logprobs(self, model, packs: list[PackedMicroBatch], sharded: bool,
                       keep_gathered: bool, whole: bool = True) -> list[torch.Tensor]:
        """Logprobs of each pack's targets, on the device; keep_gathered: see distributed.gathered.
        whole=False: the model is not gathered whole, each forward gathers one FSDP2 unit at a time
        (policy.keep_gathered=false, the memory plan's figure for a model too large to gather);
        every worker must then run as many packs (`_micro_batches` pads them)."""
        model.eval()
        computing = self.computing() if model is self.model else contextlib.nullcontext()
        with computing, distributed.gathered(model, sharded and whole, keep=keep_gathered):
            return [self._logprobs(model, mb.to(self.device))[0] for mb in packs]

    def _micro_batches(self, batch: TrainBatch, budget: int) -> list[PackedMicroBatch]:
        packs = pack_batch(batch, budget)
        if self.sharded:
            # every FSDP forward/backward is a collective: all workers run as many micro-batches
            count = distributed.max_over_workers(len(packs), self.device)
            packs += [filler_pack(self.tokenizer.pad_token_id)] * (count - len(packs))
        return packs

    def _optimizer_step(self, batch, micro_batches, old, ref, global_tokens, global_samples,
                        trained_total) -> dict[str, float]:
        """old, ref: logprobs per micro-batch (None: pi_old is the training forward itself / no KL)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # summed on the device: reading each micro-batch's numbers back would stall the GPU queue
        keys = ["loss", "kl", "clip_fraction", "entropy"]
        if batch.gen_logprobs is not None:
            keys.append("token_mult_prob_error")
        if self.cfg.loss.use_importance_sampling_correction:
            if batch.gen_logprobs is None and len(batch.advantages):
                raise UserError("loss.use_importance_sampling_correction=true needs the sampler's logprobs, and "
                                "this run's generation returned none (transformers generate: the rollout engine "
                                "does not support this model)")
            keys += ["is_ratio_mean", "is_weight_mean", "is_kept_fraction"]
        sums = {key: torch.zeros((), device=self.device) for key in keys}
        # Every worker divides by the same global count; gradients are averaged over workers,
        # hence the world size.
        norm = max(global_tokens, 1.0) / self.world_size
        seq_norm = global_samples / self.world_size
        response_lengths = batch.response_mask.sum(1).clamp_min(1)
        deferred = self.sharded and self.keep_gathered  # gradients reduced once, at the last micro-batch
        with self.computing(), distributed.accumulating(self.model, deferred):
            for i, mb in enumerate(micro_batches):
                distributed.last_micro_batch(self.model, i == len(micro_batches) - 1, deferred)
                self._accumulate(mb, batch, None if old is None else old[i], None if ref is None else ref[i],
                                 norm, seq_norm, trained_total, response_lengths, sums)
                self.profiler.mark(f"micro-batch {i} forward+backward")
        if not micro_batches:
            # nothing to train (every sample skipped): zero gradients, so that AdamW still steps as
            # it would have (momentum, weight decay). Resharded first: the sharded parameters are
            # the optimizer's, and the generation may have left them gathered for this update.
            distributed.reshard(self.model, self.sharded)
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        self.memory.end("update")
        max_norm = self.cfg.policy.max_grad_norm or math.inf
        grad_norm = distributed.clip_grad_norm(list(self.model.parameters()), max_norm, self.sharded)
        self.profiler.mark("clip gradients")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients' memory is the generation's until the next update
        self.scheduler.step()
        self.profiler.mark("optimizer step")
        self.memory.end("optimizer step")
        stats = {key: float(value) for key, value in sums.items()}
        stats.update(grad_norm=distributed.as_float(grad_norm), lr=lr)
        return stats

    def _accumulate(self, mb, batch, old, ref, norm, seq_norm, trained_total, response_lengths, sums) -> None:
        """Forward and backward of one packed micro-batch; gradients add up in the parameters.

        old, ref: pi_old's and the reference's logprobs of the pack's tokens (old None: the
        training forward's own, detached). With policy.fused_head_loss the LM head takes the
        loss's gradient in its forward (rlscale.grpo.loss.linear_logprobs_loss); otherwise the
        loss is built on the returned logprobs and the head's backward recomputes its logits.
        """
        loss_cfg = self.cfg.loss
        rows, cols = mb.rows, mb.cols  # on the host, like the batch they index
        mb = mb.to(self.device)
        advantages = to_device(batch.advantages[rows], self.device)
        # token-mean: every response token of the global batch weighs 1/tokens; seq-mean-token-mean:
        # mean per sequence, then over the global batch's sequences; seq-mean-token-sum-norm: Dr. GRPO
        scale = loss_cfg.loss_scale_factor or self.cfg.policy.generation.max_new_tokens
        weights = to_device(loss_weights(loss_cfg.aggregation, response_lengths, norm, seq_norm, scale)[rows],
                            self.device)
        gen = to_device(batch.gen_logprobs[rows, cols], self.device) if batch.gen_logprobs is not None else None
        correct = loss_cfg.use_importance_sampling_correction and gen is not None  # None: refused above, or no sample
        whole = loss_cfg.whole_sequences and len(rows) > 0
        if whole:  # the pack's tokens as [sequences, positions], for the terms that take a sequence's tokens
            _, local = torch.unique_consecutive(rows, return_inverse=True)
            at = (to_device(local, self.device), to_device(cols, self.device))
            shape = (int(local.max()) + 1, batch.response_mask.shape[1])

            def dense(values):
                return values.new_zeros(shape).index_put(at, values)

        def terms_of(logprobs, part=slice(None)):
            old_part = logprobs.detach() if old is None else old[part]
            ref_part = None if ref is None else ref[part]
            clip = loss_cfg.sequence_clip if loss_cfg.sequence_level_importance_ratios else \
                (loss_cfg.ratio_clip_min, loss_cfg.ratio_clip_max)
            kwargs = dict(clip_low=clip[0], clip_high=clip[1], kl_beta=loss_cfg.kl_in_loss,
                          kl_type=loss_cfg.reference_policy_kl_type, kl_input_clamp=loss_cfg.kl_input_clamp_value,
                          kl_output_clamp=loss_cfg.kl_output_clamp_value)
            if not whole:  # every term is a token's own: the pack as one row
                weights_is = self._importance(old_part[None], gen[part][None], None) if correct else None
                return grpo_token_loss(logprobs[None], old_part[None], advantages[part][None],
                                       None if ref_part is None else ref_part[None], is_weights=weights_is, **kwargs)
            mask = dense(torch.ones_like(logprobs))
            weights_is = self._importance(dense(old_part), dense(gen), mask) if correct else None
            terms = grpo_token_loss(dense(logprobs), dense(old_part), dense(advantages),
                                    None if ref_part is None else dense(ref_part),
                                    sequence_level=loss_cfg.sequence_level_importance_ratios, mask=mask,
                                    is_weights=weights_is, **kwargs)
            return dataclasses.replace(terms, **{f.name: getattr(terms, f.name)[at][None]
                                                 for f in dataclasses.fields(terms)})

        def token_loss(logprobs, part=slice(None)):
            return terms_of(logprobs, part).loss[0] * weights[part]

        # a sequence's terms need all its tokens at once: the fused head sees one chunk at a time
        if self.cfg.policy.fused_head_loss and not whole:
            logprobs, entropy, losses = self._logprobs(self.model, mb, True, token_loss)
        else:
            logprobs, entropy = self._logprobs(self.model, mb, True)
            losses = token_loss(logprobs)
        losses.sum().backward()
        with torch.no_grad():
            # metrics: this worker's share of a global token mean (the controller adds the shares).
            # loss, kl and clipping over every token (a skipped sample's are 0); entropy and the
            # sampler agreement over the trained tokens (a skipped sample's are not computed)
            global_tokens = norm * self.world_size
            terms = terms_of(logprobs.detach())
            if gen is not None:
                # sampler vs trainer on the same tokens under pi_old: mean exp|difference|, 1.0 = identical
                pi_old = logprobs.detach() if old is None else old
                sums["token_mult_prob_error"] += (gen - pi_old).abs().exp().sum() / trained_total
            if correct and len(rows):
                # the correction's statistics over the trained tokens (a sequence's weight on each of its tokens)
                pi_old = logprobs.detach() if old is None else old
                if whole:
                    mask = dense(torch.ones_like(pi_old))
                    stats = self._importance(dense(pi_old), dense(gen), mask, full=True)
                    stats = [value.expand(shape)[at] for value in (stats.raw, stats.weights, stats.kept)]
                else:
                    stats = self._importance(pi_old[None], gen[None], None, full=True)
                    stats = [value[0] for value in (stats.raw, stats.weights, stats.kept)]
                for key, value in zip(("is_ratio_mean", "is_weight_mean", "is_kept_fraction"), stats):
                    sums[key] += value.sum() / trained_total
            for key, per_token in (("loss", terms.loss[0]), ("kl", terms.kl[0]), ("clip_fraction", terms.clipped[0])):
                sums[key] += per_token.sum() / global_tokens
            sums["entropy"] += entropy.sum() / trained_total

    def _importance(self, old, gen, mask, full: bool = False):
        """The sampler/trainer correction (rlscale.grpo.loss.importance_weights) by loss.*: its weights,
        or with `full` all it computes."""
        cfg = self.cfg.loss
        out = importance_weights(old, gen, mask, cfg.truncated_importance_sampling_type,
                                 cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min,
                                 sequence_level=cfg.sequence_level_importance_ratios)
        return out if full else out.weights

    # ------------------------------------------------------------------ state

    @property
    def ckpt_settings(self):
        return self.cfg.checkpointing

    def checkpoint_snapshot(self, directory: str) -> dict:
        # a save between a generation and its update (a preemption) finds the policy gathered
        distributed.reshard(self.model, self.sharded)
        return super().checkpoint_snapshot(directory)

