"""The GRPO loop, top to bottom: generate, reward, advantages, train, validate, checkpoint, log.

The controller owns the loop and small data (prompt texts, token ids, scores, metrics); the
policy workers own the model, optimizer and activations. Read top down: `Run` and its loop, the
step's parts, then `train`, which starts a run and wires its parts together, then what a run that
runs out of memory reports. What a start finds in, and leaves in, the run and checkpoint
directories (resume or start afresh, a finished run, config.yaml, summary.json) is
rlscale/run_dir.py's.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path

import torch

from rlscale.ckpt import Checkpointer, SaveReport
from rlscale.ckpt.faults import maybe_fault
from rlscale.ckpt.layout import read_manifest
from rlscale.config import Config, derive_sizes, overlong_lengths, prompts_per_generation
from rlscale.data import PromptLoader, build_datasets
from rlscale.errors import OOM_PHASES, OutOfMemory, UserError, advice_for, is_out_of_memory, out_of_memory
from rlscale.evaluate import EvalResult, evaluate, is_correct
from rlscale.grpo import carries_gradient, group_advantages
from rlscale.grpo.dynamic_sampling import chosen_groups, informative_groups, sample_indices
from rlscale.grpo.shaping import in_loss, kl_penalized_rewards, overlong_penalty
from rlscale.preemption import EXIT_DEADLINE, Deadline, RunStopped, StopRequests, StopSignals, save_fits
from rlscale.rewards import RewardScorer
from rlscale.rewards.scorer import concat_scores
from rlscale.rollout.sampling import SamplingParams
from rlscale.run_dir import (TrainerState, already_finished, check_fresh_start, finished_summary, new_run_dirs,
                             prepare_run_dir, remove_if_empty, resume_choice, resume_or_start, write_start_files,
                             write_summary)
from rlscale.telemetry import ProgressDisplay, StepTimer, build_sinks, print_note
from rlscale.telemetry.memory import largest_over_workers
from rlscale.workers.batch import Rollouts, build_train_batch, concat_rollouts, select_rollouts
from rlscale.workers.group import LocalWorkerGroup, split_evenly
from rlscale.workers.policy import PolicyWorker


# ------------------------------------------------------------------ the loop


class Run:
    """One invocation of the loop: the parts it drives and the state it advances."""

    def __init__(self, cfg, group, scorer, checkpointer, sinks, loader, val_problems, state: TrainerState,
                 signals: StopSignals | None = None, deadline: Deadline | None = None,
                 position: RunPosition | None = None):
        self.cfg, self.group, self.scorer, self.checkpointer = cfg, group, scorer, checkpointer
        self.sinks, self.loader, self.val_problems, self.state = sinks, loader, val_problems, state
        self.signals = signals or StopSignals()  # not entered: never requested
        self.deadline = deadline or Deadline(None, 0.0)
        self.start_step, self.wall_before = state.step, state.wall_s
        self.started = time.perf_counter()
        self.pad_id = group.run_rank0("ready")["pad_token_id"]
        self.last_saved: int | None = None  # the newest step saved (committed or in flight)
        self.val_step: int | None = None  # the step state.last_val was measured at, in this invocation
        self.step_estimate_s: float | None = None  # the longest step of this invocation
        self.save_estimate_s: float | None = None  # the longest save, snapshot start to commit
        self.noted: set[str] = set()  # what print_once has said
        self.position = position or RunPosition()  # the step under way, for an error's line
        self.position.step = state.step

    def loop(self, progress: ProgressDisplay, resumed_from: str | None) -> dict | None:
        """The GRPO loop, top to bottom. Returns the held-out metrics after training."""
        cfg, group, state = self.cfg, self.group, self.state
        sizes = derive_sizes(cfg)
        timer = StepTimer()
        self.last_saved = state.step if resumed_from else None
        progress.print(f"run dir {cfg.logger.log_dir}  |  {sizes.samples_per_step} samples/step, "
                       f"{sizes.optimizer_steps_per_grpo_step} optimizer step(s)/step, {sizes.world_size} worker(s)"
                       + (f"  |  resumed from {resumed_from}" if resumed_from else ""))
        if state.eval_before is None and cfg.grpo.val_at_start:
            state.eval_before = state.last_val = self.validate()
            self.val_step = state.step
            progress.print(f"held-out accuracy before training: {state.eval_before['val/accuracy']:.3f}")
            self.sinks.log(state.step, state.eval_before)

        while state.step < cfg.grpo.max_num_steps:
            if self.signals.requested or self.deadline.due(self.step_estimate_s, self.save_estimate_s):
                self.stop()  # a safe point between steps; raises RunStopped
            step = self.position.step = state.step + 1
            step_started = time.perf_counter()
            batch = self.sample(step, timer, progress)  # generated and scored; more rounds with dynamic sampling
            rewards, kl_metrics = batch.rewards, {}
            if cfg.loss.use_kl_in_reward:  # REINFORCE++: the KL penalty moves from the loss into the reward
                with timer.section("train"):
                    rewards, kl_metrics = subtract_kl(cfg, group, batch, self.pad_id)
            advantages = group_advantages(rewards, cfg.grpo.use_leave_one_out_baseline,
                                          cfg.grpo.normalize_rewards, std_of=cfg.grpo.advantage_std)
            with timer.section("train"):
                metrics = train_on_rollouts(cfg, group, batch.rollouts, advantages.flatten().tolist(), step,
                                            self.pad_id)
            metrics.update(batch.metrics)  # before the save: metric_name may rank by them
            metrics.update(kl_metrics)
            state.step = step
            state.loader = self.loader.state_dict()
            if cfg.grpo.val_period and step % cfg.grpo.val_period == 0:
                with timer.section("validate"):
                    state.last_val = self.validate()
                    self.val_step = step
                metrics.update(state.last_val)
            if self.checkpointer.saves_at(step, cfg.grpo.max_num_steps):
                with timer.section("checkpoint"):
                    metrics.update(self.save(metrics))
            for committed in self.checkpointer.poll():  # saves whose background persist has finished
                metrics.update(self.committed(committed))
            metrics.update(timer.pop())
            metrics.update(throughput_metrics(batch.generated, time.perf_counter() - step_started))
            metrics["data/epoch"] = self.loader.epoch
            self.sinks.log(step, metrics)
            progress.update(step, metrics)
            self.step_estimate_s = max(self.step_estimate_s or 0.0, time.perf_counter() - step_started)
            maybe_fault("loop.after_step")

        if self.signals.requested:  # during the last step: its save is in flight; skip validation
            self.stop()
        eval_after, final = None, {}
        if cfg.grpo.val_at_end:
            eval_after = state.last_val = self.validate()
            self.val_step = state.step
            progress.print(f"held-out accuracy after training: {eval_after['val/accuracy']:.3f}")
            final.update({f"final/{k}": v for k, v in eval_after.items()})
        if cfg.checkpointing.enabled:
            if self.last_saved != state.step:
                final.update(self.save(self.validation_of_this_step()))
            for committed in self.checkpointer.wait():  # the last save's persist numbers, too
                final.update(self.committed(committed))
        if final:
            self.sinks.log(state.step, final)
        return eval_after

    def sample(self, step: int, timer: StepTimer, progress: ProgressDisplay) -> StepBatch:
        """The step's groups, generated and scored: grpo.num_prompts_per_step prompts in one round,
        or, with grpo.use_dynamic_sampling, rounds of more prompts until that many groups have
        rewards that differ (rlscale.grpo.dynamic_sampling). The loader's position advances by every
        round's prompts, and each round's sampling is keyed by the step and the round, so a resumed
        run draws the same rounds."""
        cfg = self.cfg
        P, G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
        dynamic, rounds = cfg.grpo.use_dynamic_sampling, []
        informative: list[bool] = []
        while True:
            problems = self.loader.next_batch(prompts_per_generation(cfg))
            with timer.section("generate"):
                texts = [p.text for p in problems for _ in range(G)]
                # keyed by the step: the samples do not depend on the RNG state a resume restores
                seed = generation_seed(cfg, step, "rollout" if not rounds else f"rollout round {len(rounds) + 1}")
                rollouts = generate_rollouts(self.group, texts, sampling_params(cfg, seed=seed))
            maybe_fault("loop.after_generate")
            self.abandon_step_if_stopping()
            with timer.section("reward"):
                scores = self.scorer.score(rollouts.texts, [p.answer for p in problems for _ in range(G)])
            if any(rollouts.prompt_cut):
                self.print_once("prompt cut", progress, prompt_cut_note(cfg, step, rollouts))
            failures = scores.check(cfg.rewards.function, f"step {step}")  # raises when every sample failed
            if failures:
                self.print_once("reward failures", progress, failures)
            self.abandon_step_if_stopping()
            scored = torch.tensor(scores.rewards).view(len(problems), G)  # the verifier's: reward/* and accuracy
            rewards, penalties = shape_rewards(cfg, scored, rollouts)  # what the advantages see
            rounds.append((rollouts, scores, scored, rewards, penalties))
            if not dynamic:
                break
            informative += informative_groups(rewards)
            if sum(informative) >= P:
                break
            if len(rounds) == cfg.grpo.dynamic_sampling_max_gen_batches:
                raise UserError(self.too_few_informative_groups(step, sum(informative), len(rounds)))
        generated = concat_rollouts([r[0] for r in rounds])
        scores = concat_scores([r[1] for r in rounds])
        scored, rewards, penalties = (torch.cat([r[i] for r in rounds]) for i in (2, 3, 4))
        metrics = sample_metrics(generated, scored, scores)  # what the policy generated, all rounds
        metrics["grpo/overlong_penalty_mean"] = float(penalties.mean())
        if not dynamic:
            return StepBatch(generated, rewards, generated, metrics)
        groups = chosen_groups(informative, P)
        metrics.update({"grpo/refill_rounds": float(len(rounds)),
                        "grpo/dropped_groups": float(len(informative) - sum(informative)),
                        "grpo/surplus_groups": float(sum(informative) - P)})
        return StepBatch(select_rollouts(generated, sample_indices(groups, G)), rewards[groups], generated, metrics)

    def too_few_informative_groups(self, step: int, found: int, rounds: int) -> str:
        cfg = self.cfg
        newest = self.checkpointer.latest() if cfg.checkpointing.enabled else None
        return (f"step {step}: dynamic sampling found {found} of the {cfg.grpo.num_prompts_per_step} groups it needs "
                f"(grpo.num_prompts_per_step) whose rewards differ, in {rounds} generation rounds of "
                f"{prompts_per_generation(cfg)} prompts (grpo.dynamic_sampling_max_gen_batches={rounds}); raise "
                "grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, or train on data of a difficulty "
                "the model sometimes solves; " + (f"{newest} is the newest checkpoint" if newest
                                                  else "no checkpoint is saved yet"))

    def print_once(self, what: str, progress: ProgressDisplay, line: str) -> None:
        """Say `line` the first time `what` happens in this run (a metric counts it every step)."""
        if what not in self.noted:
            self.noted.add(what)
            progress.print(line)

    def validate(self) -> dict[str, float]:
        with _relabel_out_of_memory("generation", "validation"):  # the workers see a generation
            return validate(self.cfg, self.group, self.val_problems, self.scorer, self.state.step).metrics("val")

    def validation_of_this_step(self) -> dict[str, float]:
        """The held-out metrics if they were measured at the current step, else none: a
        checkpoint's manifest (what checkpointing.metric_name ranks) never carries older ones."""
        return self.state.last_val if self.val_step == self.state.step else {}

    def save(self, metrics: dict[str, float]) -> dict[str, float]:
        self.state.wall_s = self.wall_before + time.perf_counter() - self.started
        report = self.checkpointer.save(self.state.step, self.group, self.state.__dict__, metrics)
        self.last_saved = self.state.step
        if report.committed:  # checkpointing.async_save=false
            self.committed(report)
        return report.metrics()

    def committed(self, report: SaveReport) -> dict[str, float]:
        """Note a commit's durable time (for the grace and deadline estimates); its metrics."""
        self.save_estimate_s = max(self.save_estimate_s or 0.0, report.persist_s)
        return report.commit_metrics()

    # ------------------------------------------------------------------ stopping early

    def abandon_step_if_stopping(self) -> None:
        """A safe point inside a step: on a signal, drop the step when the last finished one is
        already saved (nothing of this step would be kept). Otherwise the step finishes and is saved:
        a save taken mid-step would hold worker RNG states the rollout has already advanced."""
        if self.signals.requested and (self.last_saved == self.state.step or not self.cfg.checkpointing.enabled):
            self.stop()

    def stop(self) -> None:
        """Save the last finished step unless it is saved already (on a signal, only if the save fits
        in checkpointing.preemption_grace_s), wait for the commit, say what is on disk, raise RunStopped."""
        ckpt, state, signals = self.cfg.checkpointing, self.state, self.signals
        if signals.requested:
            why, code = f"{signals.name}", signals.exit_code
        else:
            why, code = f"checkpointing.checkpoint_must_save_by={ckpt.checkpoint_must_save_by}", EXIT_DEADLINE
        final, skipped = {}, ""
        if ckpt.enabled and self.last_saved != state.step and state.step > self.start_step:  # new work to keep
            since = signals.seconds_since()
            if signals.requested and not save_fits(ckpt.preemption_grace_s, since, self.save_estimate_s):
                skipped = (f"; step {state.step} not saved: a save takes about {self.save_estimate_s:.1f}s and "
                           f"{max(ckpt.preemption_grace_s - since, 0):.1f}s of checkpointing.preemption_grace_s are left")
            else:
                final.update(self.save(self.validation_of_this_step()))
        if ckpt.enabled:
            for committed in self.checkpointer.wait():
                final.update(self.committed(committed))
        signals.acknowledge()  # committed: a pod that asked for the stop may go
        if final:
            self.sinks.log(state.step, final)
        newest = self.checkpointer.latest() if ckpt.enabled else None
        kept = f"{newest} is the newest checkpoint" if newest else "no checkpoint is saved"
        # resume=never or a step path would not pick up this run's newest step: auto does
        again = ("run the same command to resume" if self.cfg.checkpointing.resume == "auto"
                 else "run it again with checkpointing.resume=auto to resume")
        raise RunStopped(f"stopped by {why} after step {state.step}: {kept}{skipped}; {again}",
                         code)  # the CLI prints it as its last line


# ------------------------------------------------------------------ the step's parts


@dataclass
class StepBatch:
    """A step's samples: those trained on (rollouts; rewards [groups, G], shaped), all that were
    generated (every dynamic-sampling round), and the metrics of the generated ones."""

    rollouts: Rollouts
    rewards: torch.Tensor
    generated: Rollouts
    metrics: dict[str, float]


def sampling_params(cfg: Config, temperature: float | None = None, seed: int | None = None) -> SamplingParams:
    """A generation request from policy.generation. seed: the key of the request's sampling
    (`generation_seed`); default: the one of an evaluation outside a run (grpo.seed's alone)."""
    gen = cfg.policy.generation
    return SamplingParams(
        temperature=gen.temperature if temperature is None else temperature,
        top_p=gen.top_p, top_k=gen.top_k, max_new_tokens=gen.max_new_tokens,
        stop_strings=tuple(gen.stop_strings),
        seed=generation_seed(cfg, 0, "evaluation") if seed is None else seed)


def generation_seed(cfg: Config, step: int, purpose: str = "rollout") -> int:
    """The sampling key of one generation request: a hash of grpo.seed, what the request is for
    (rollout, validation, evaluation) and the GRPO step it belongs to (the step it generates for,
    or the one after which it validates). With each sample's index in the request (its sample
    id), the engine draws the same tokens however the request is split over the workers and
    tensor-parallel groups, and a resumed run draws what the uninterrupted one did, with no
    generation RNG state in the checkpoint. In [0, 2**31)."""
    digest = hashlib.blake2b(f"{cfg.grpo.seed}:{purpose}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def generate_rollouts(group, texts: list[str], params: SamplingParams) -> Rollouts:
    """Every worker samples its slice of the prompts, each sample keyed by its index in `texts`
    (see `generation_seed`); results are concatenated in order."""
    shards = split_evenly(texts, group.world_size)
    ids = split_evenly(list(range(len(texts))), group.world_size)
    parts = group.run_all("generate", [(shard, params, True, shard_ids)  # the update follows
                                       for shard, shard_ids in zip(shards, ids)])
    return concat_rollouts(parts)


def shape_rewards(cfg: Config, rewards: torch.Tensor, rollouts: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards the advantages are computed from, and the overlong penalty each got (zeros
    with grpo.reward_shaping off), both shaped like `rewards` (rlscale.grpo.shaping)."""
    shaping = cfg.grpo.reward_shaping
    if not shaping.enabled:
        return rewards, torch.zeros_like(rewards)
    lengths = torch.tensor([len(r) for r in rollouts.response_ids]).view(rewards.shape)
    penalties = overlong_penalty(lengths, *overlong_lengths(cfg), shaping.overlong_buffer_penalty)
    return rewards + penalties, penalties


def subtract_kl(cfg: Config, group, batch: StepBatch, pad_id: int) -> tuple[torch.Tensor, dict[str, float]]:
    """loss.use_kl_in_reward: each sample's reward minus beta × its summed per-token KL to the
    reference (the workers' sequence_kl, on the policy that sampled), and the KL's metrics:
    train/kl the mean per response token (what the loss's KL term reports otherwise) and
    reward/kl_penalty_mean the mean penalty per sample."""
    rollouts = batch.rollouts
    shards = split_evenly(list(range(len(rollouts.response_ids))), group.world_size)
    parts = group.run_all("sequence_kl", [(build_train_batch(
        [rollouts.prompt_ids[i] for i in shard], [rollouts.response_ids[i] for i in shard], [0.0] * len(shard),
        pad_id, cfg.policy.max_total_sequence_length),) for shard in shards])
    sums = torch.tensor(sum(parts, []), dtype=torch.float64)
    beta = cfg.loss.reference_policy_kl_penalty
    penalized = kl_penalized_rewards(batch.rewards, sums.view(batch.rewards.shape), beta)
    tokens = max(sum(len(r) for r in rollouts.response_ids), 1)
    return penalized, {"train/kl": float(sums.sum()) / tokens,
                       "reward/kl_penalty_mean": beta * float(sums.mean())}


def train_on_rollouts(cfg: Config, group, rollouts: Rollouts, advantages: list[float], step: int,
                      pad_id: int) -> dict[str, float]:
    """Shuffle samples, cut them into optimizer steps, shard each step's trained samples over the
    workers (samples without a gradient, see `carries_gradient`, only count in the normaliser;
    samples overlong filtering takes out of the loss, see `in_loss`, are neither trained nor counted)."""
    sizes = derive_sizes(cfg)
    generator = torch.Generator().manual_seed((cfg.grpo.seed * 100_003 + step) % 2**63)  # any seed in range
    order = torch.randperm(len(advantages), generator=generator)
    order = order.tolist()
    counted = in_loss(rollouts.truncated, cfg.grpo.overlong_filtering)
    trains = [c and t for c, t in zip(counted, carries_gradient(advantages, cfg.loss.kl_in_loss,
                                                                cfg.loss.skip_zero_advantage))]
    gbs = cfg.policy.train_global_batch_size
    per_worker: list[list] = [[] for _ in range(group.world_size)]
    global_tokens, trained_tokens = [], []
    for start in range(0, len(order), gbs):
        chosen = order[start:start + gbs]
        global_tokens.append(float(sum(len(rollouts.response_ids[i]) for i in chosen if counted[i])))
        trained = [i for i in chosen if trains[i]]  # split after the cut: the optimizer steps stay the same
        trained_tokens.append(float(sum(len(rollouts.response_ids[i]) for i in trained)))
        for rank, shard in enumerate(split_evenly(trained, group.world_size)):
            per_worker[rank].append(build_train_batch(
                [rollouts.prompt_ids[i] for i in shard], [rollouts.response_ids[i] for i in shard],
                [advantages[i] for i in shard], pad_id, cfg.policy.max_total_sequence_length,
                [rollouts.logprobs[i] for i in shard] if rollouts.logprobs else None))
    results = group.run_all("train", [(steps, global_tokens, gbs, sizes.micro_batch_size, trained_tokens)
                                      for steps in per_worker])
    # each worker reports its share of a global mean, so the global value is their sum
    memory = largest_over_workers(results)  # measured peaks per phase (CUDA only)
    summed = {key: sum(r[key] for r in results) for key in results[0]
              if key not in ("grad_norm", "lr") and key not in memory}
    summed.update(grad_norm=results[0]["grad_norm"], lr=results[0]["lr"],
                  skipped_fraction=1.0 - sum(trains) / max(len(trains), 1))
    return {**{f"train/{k}": v for k, v in summed.items()}, **memory,
            "grpo/overlong_filtered_fraction": 1.0 - sum(counted) / max(len(counted), 1)}


def validate(cfg: Config, group, problems, scorer, step: int = 0) -> EvalResult:
    """Held-out metrics after `step` GRPO steps (0: before training)."""
    return evaluate(group, problems[: cfg.grpo.max_val_samples], scorer,
                    sampling_params(cfg, temperature=cfg.grpo.val_temperature,
                                    seed=generation_seed(cfg, step, "validation")), k=1)


def sample_metrics(rollouts: Rollouts, rewards: torch.Tensor, scores) -> dict[str, float]:
    """What one step's samples say: rewards, accuracy, lengths."""
    return {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "accuracy": sum(map(is_correct, scores.rewards)) / len(scores.rewards),
        "reward/timeouts": scores.num_timeouts, "reward/errors": scores.num_errors,
        "grpo/zero_std_groups": float((rewards.std(dim=1) == 0).float().mean()),
        "response/length_mean": sum(len(r) for r in rollouts.response_ids) / len(rollouts.response_ids),
        "response/truncated_fraction": sum(rollouts.truncated) / len(rollouts.truncated),
        "prompt/cut_fraction": sum(rollouts.prompt_cut) / max(len(rollouts.prompt_cut), 1),
    }


def prompt_cut_note(cfg: Config, step: int, rollouts: Rollouts) -> str:
    room = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    return (f"step {step}: {sum(rollouts.prompt_cut)} of {len(rollouts.prompt_cut)} prompts were longer than the "
            f"{room} tokens left for them (policy.max_total_sequence_length - policy.generation.max_new_tokens) "
            "and lost their beginning; raise policy.max_total_sequence_length (metric prompt/cut_fraction)")


def throughput_metrics(rollouts: Rollouts, step_s: float) -> dict[str, float]:
    all_tokens = sum(len(r) for r in rollouts.response_ids) + sum(len(p) for p in rollouts.prompt_ids)
    return {"time/step_s": step_s, "throughput/tokens_per_s": all_tokens / step_s}


@contextmanager
def _relabel_out_of_memory(phase: str, instead: str):
    try:
        yield
    except OutOfMemory as exc:
        if exc.phase == phase:
            exc.phase = instead
        raise


# ------------------------------------------------------------------ starting a run


@dataclass
class RunPosition:
    """Where a run is, for an error that ends it: the step under way (or last finished)."""

    step: int | None = None


def train(cfg: Config, planned: dict[str, int] | None = None) -> dict:
    """Run (or resume) a GRPO training run; returns the summary written to summary.json.

    The memory plan (rlscale.memory_plan) is made first: it sets what the user left to it and
    refuses, in one line, a run that cannot fit. planned: the bytes per phase quoted when the run
    runs out of memory (default: the plan's, see planned_figures). Running out of memory anywhere (a worker, this process) ends the run, after the
    same cleanup as any error (a save in flight commits or is left as tmp_step_N/), with an
    rlscale.errors.OutOfMemory: one line naming the phase, the step, the figures and what to
    change; the tracebacks go to <logger.log_dir>/error.log."""
    from rlscale import memory_plan

    cfg, plan = memory_plan.resolve(cfg)  # before anything loads; a run that cannot fit stops here
    planned = planned if planned is not None else planned_figures(plan)
    position = RunPosition()
    try:
        return _train(cfg, position, plan)
    except OutOfMemory as exc:
        _finish_out_of_memory(exc, cfg, planned, position)
        raise
    except (RuntimeError, MemoryError) as exc:  # in this process, outside any worker call
        if not is_out_of_memory(exc):
            raise
        converted = out_of_memory(exc)  # its traceback as text: the original's frames may go
    raise _finish_out_of_memory(converted, cfg, planned, position)


def _train(cfg: Config, position: RunPosition, plan=None) -> dict:
    """Start (or resume) the run and drive its loop; see `train`.

    The exits of `cleanup` run in the reverse order of their registration, and that order is
    deliberate (last to first): the stop signals are restored, the sinks close, the checkpointer
    waits for the save in flight to commit, the pods' stop requests are acknowledged, the workers
    shut down, the requests are acknowledged again, the directory lock goes, the directories this
    run made and left empty go, the scorer closes."""
    started = time.perf_counter()
    # said once the run starts (with a budget: a verdict and picks; without one, --dry-run shows it)
    from rlscale.memory_plan import summary_line

    plan_line = summary_line(plan) if plan is not None and plan.budget is not None else None
    # which checkpoint to resume from (only reads): a wrong checkpointing.resume fails here
    choice = resume_choice(cfg)
    finished = finished_summary(cfg, choice)
    if finished is not None:
        return already_finished(cfg, choice, finished)
    if choice is None or choice.path is None:
        check_fresh_start(cfg)
    # Check the inputs (data, reward function) before writing anything, the directories before
    # the slow model load, and touch the run's files only once the model and checkpoint loaded.
    datasets = build_datasets(cfg.data, cfg.grpo.seed)
    loader = PromptLoader(datasets.train, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
    with ExitStack() as cleanup:
        scorer = cleanup.enter_context(make_scorer(cfg))
        # directories this run creates are removed again if it ends before putting a file in them
        # (the model failed to load, say); the last callback to run, so after the lock file goes
        cleanup.callback(remove_if_empty, new_run_dirs(cfg))
        run_dir = prepare_run_dir(cfg)
        checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing, cfg.to_yaml(), cfg.digest())
        if cfg.checkpointing.enabled:
            waited = checkpointer.prepare(notify=print_note)
            cleanup.callback(checkpointer.release)  # also when the model fails to load
            if waited:
                # Choose again, on purpose: the choice above was made before this run held the
                # directory, and the run that held it (on another node, a retried job) may have
                # saved a newer step meanwhile (resume from that one, not the older) or finished
                # (train nothing again). Tests: tests/ckpt/test_controller.py::
                # test_a_run_that_waited_for_the_directory_chooses_its_resume_step_again, and
                # tests/ckpt/test_failures.py::test_a_run_that_waited_for_the_claim_is_told_so (the wait).
                choice = resume_choice(cfg)
                finished = finished_summary(cfg, choice)
                if finished is not None:
                    return already_finished(cfg, choice, finished)
        group = make_worker_group(cfg)
        requests = StopRequests.from_env()  # worker pods waiting for this driver to save
        # Acknowledged twice, on purpose. This one, registered before group.shutdown, runs after
        # it, last of the two: a pod's stop hook that began while the workers shut down (after the
        # acknowledgement below had run) is released too, instead of waiting out its timeout.
        cleanup.callback(requests.acknowledge)
        cleanup.callback(group.shutdown)
        requests.watch(group.run_all("hostname"))  # only this run's pods: a cluster may run other jobs
        # This one runs before group.shutdown and after checkpointer.close (registered below): however
        # the run ends, once its saves are in, the pods that asked to stop may go at once.
        cleanup.callback(requests.acknowledge)
        state, resumed_from, notes = resume_or_start(choice, checkpointer, group, loader, cfg)
        cleanup.callback(checkpointer.close)  # runs before shutdown: in-flight saves finish first
        sinks = build_sinks(run_dir, cfg.logger.tensorboard_enabled, cfg.logger.wandb_enabled,
                            resumed_step=state.step if resumed_from else None,
                            prometheus_port=cfg.logger.prometheus_port, config=cfg,
                            resumed_row=(read_manifest(Path(resumed_from)) or {}).get("metrics")
                            if resumed_from else None)
        cleanup.callback(sinks.close)
        # only once every sink opened (a port in use, a missing package): a start that fails leaves
        # the run dir as it was (the older summary.json goes, config.yaml and memory_plan.json come)
        write_start_files(run_dir, cfg, plan)
        # SIGTERM/SIGINT, or a worker pod's stop request: save, then RunStopped
        signals = cleanup.enter_context(StopSignals(requests))
        run = Run(cfg, group, scorer, checkpointer, sinks, loader, datasets.val, state,
                  signals, Deadline(cfg.checkpointing.must_save_by_s(), started), position)
        with ProgressDisplay(cfg.grpo.max_num_steps, state.step, cfg.logger.progress) as progress:
            for note in [plan_line] * bool(plan_line) + notes + sinks.notes():
                progress.print(note)
            eval_after = run.loop(progress, resumed_from)
        state.wall_s = run.wall_before + time.perf_counter() - started
        # written while this run still holds the directory (the loop has waited for its last save):
        # a run waiting for the claim must find the summary when it gets it
        summary = write_summary(run_dir, cfg, state, run.start_step, resumed_from, eval_after)
    return summary


def make_worker_group(cfg: Config):
    """In-process for one worker (the laptop path); Ray actors for more, or on a cluster."""
    world = derive_sizes(cfg).world_size
    backend = cfg.cluster.backend
    if backend == "auto":
        backend = "local" if world == 1 and not (cfg.cluster.address or os.environ.get("RAY_ADDRESS")) else "ray"
    if backend == "local":
        if world > 1:
            raise UserError(f"cluster.backend=local runs one worker, but cluster.num_nodes × "
                            f"cluster.gpus_per_node = {world}; use cluster.backend=ray or auto")
        return LocalWorkerGroup(lambda rank, size: PolicyWorker(cfg, rank, size), world)
    from rlscale.ray_runtime import cluster_has_gpus, start_ray
    from rlscale.workers.ray_group import RayWorkerGroup

    start_ray(cfg)
    use_gpus = cfg.cluster.use_gpus
    if use_gpus is None:
        use_gpus = cfg.policy.device != "cpu" and cluster_has_gpus()
    group = RayWorkerGroup(cfg, use_gpus)  # cluster.num_nodes nodes, gpus_per_node workers each
    if cfg.cluster.num_nodes > 1:
        print_note(group.placement_line())  # which ranks run on which node (ip, Ray node id)
    return group


def make_scorer(cfg: Config):
    """A process pool beside the controller, or one per Ray actor across the cluster."""
    r = cfg.rewards
    if r.ray_actors == 0:
        return RewardScorer(r.function, r.timeout_s, r.num_workers)
    from rlscale.rewards.ray_pool import RayRewardPool
    from rlscale.ray_runtime import start_ray

    start_ray(cfg)
    return RayRewardPool(r.function, r.timeout_s, r.num_workers, r.ray_actors)


# ------------------------------------------------------------------ running out of memory


ERROR_LOG = "error.log"


# an out-of-memory error's phase -> the memory plan's phases it spans (rlscale.memory_plan's names)
_PLAN_PHASES = {"generation": ("generation",), "validation": ("generation",), "weight sync/gather": ("weight sync",),
                "reference logprobs": ("logprobs",), "update": ("update", "optimizer step")}


def planned_figures(plan) -> dict[str, int]:
    """A memory plan's per-GPU bytes by phase, keyed by the phase names an out-of-memory error
    reports (rlscale.errors.OOM_PHASES): what `train(cfg, planned=...)` takes. From
    plan.phase_bytes(phase) where the plan has it, else from its phases (name, total), the
    largest of those a phase spans (the update: its backward and its optimizer step)."""
    if plan is None:
        return {}
    if hasattr(plan, "phase_bytes"):
        figures = {phase: plan.phase_bytes(phase) for phase in OOM_PHASES}
    else:
        totals = {ph.name: ph.total for ph in getattr(plan, "phases", ())}
        figures = {phase: max((totals[n] for n in names if n in totals), default=None)
                   for phase, names in _PLAN_PHASES.items()}
    return {phase: int(size) for phase, size in figures.items() if size is not None}


def _finish_out_of_memory(exc: OutOfMemory, cfg: Config, planned: dict[str, int] | None,
                          position: RunPosition) -> OutOfMemory:
    """The step, the plan's figure and the advice for the phase; the tracebacks logged."""
    if exc.step is None:
        exc.step = position.step
    exc.planned = (planned or {}).get(exc.phase)
    exc.advice = advice_for(exc.phase, cfg, host=exc.host)
    exc.log_path = write_error_log(Path(cfg.logger.log_dir), exc)
    return exc


def write_error_log(run_dir: Path, exc: BaseException) -> str | None:
    """Append the time, the error's line and its tracebacks (where it happened, in a worker too,
    and in the controller) to <run_dir>/error.log; returns the path, None if it cannot be written
    (the line is printed all the same)."""
    path = Path(run_dir) / ERROR_LOG
    previous, exc.log_path = getattr(exc, "log_path", None), str(path)  # the line names the log
    stamp = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
    parts = [f"===== {stamp} pid {os.getpid()}\n", f"rlscale: error: {exc}\n"]
    if isinstance(exc, OutOfMemory):
        parts.append(f"bytes allocated {exc.allocated}, peak {exc.peak}, total {exc.total} on {exc.device}; "
                     f"planned {exc.planned}; the error: {exc.message}\n")
    remote = getattr(exc, "traceback_text", "")
    if remote:
        rank = getattr(exc, "rank", None)
        where = f" (worker rank {rank})" if rank is not None else ""
        parts.append(f"where the memory ran out{where}:\n{remote.rstrip()}\n")
    parts.append("in the controller:\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write("".join(parts) + "\n")
    except OSError:
        exc.log_path = previous
        return None
    return str(path)
