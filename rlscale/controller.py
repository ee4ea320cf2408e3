"""The GRPO loop, top to bottom: generate, reward, advantages, train, validate, checkpoint, log.

The controller owns the loop and small data (prompt texts, token ids, scores, metrics); the
policy workers own the model, optimizer and activations.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlscale.ckpt import Checkpointer
from rlscale.config import Config, derive_sizes
from rlscale.data import PromptLoader, build_datasets
from rlscale.errors import UserError
from rlscale.evaluate import EvalResult, evaluate, is_correct
from rlscale.grpo import group_advantages
from rlscale.rewards import RewardScorer
from rlscale.telemetry import ProgressDisplay, StepTimer, build_sinks
from rlscale.workers.batch import Rollouts, build_train_batch
from rlscale.workers.group import LocalWorkerGroup, split_evenly
from rlscale.workers.policy import PolicyWorker, SamplingParams


@dataclass
class TrainerState:
    """Everything the controller needs to continue a run exactly where it stopped."""

    step: int = 0
    loader: dict = field(default_factory=dict)
    eval_before: dict | None = None
    last_val: dict = field(default_factory=dict)
    wall_s: float = 0.0


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name, then rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def prepare_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.logger.log_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", cfg.to_yaml())
    except OSError as exc:
        raise UserError(f"logger.log_dir {str(run_dir)!r} is not writable: {exc.strerror}") from None
    return run_dir


def sampling_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    gen = cfg.policy.generation
    return SamplingParams(
        temperature=gen.temperature if temperature is None else temperature,
        top_p=gen.top_p, top_k=gen.top_k, max_new_tokens=gen.max_new_tokens,
        stop_strings=tuple(gen.stop_strings))


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
    from rlscale.workers.ray_group import RayWorkerGroup, cluster_has_gpus, connect

    connect(cfg)
    use_gpus = cfg.cluster.use_gpus
    if use_gpus is None:
        use_gpus = cfg.policy.device != "cpu" and cluster_has_gpus()
    return RayWorkerGroup(cfg, use_gpus)


def generate_rollouts(group, texts: list[str], params: SamplingParams) -> Rollouts:
    """Every worker samples its slice of the prompts; results are concatenated in order."""
    shards = split_evenly(texts, group.world_size)
    parts = group.run_all("generate", [(shard, params) for shard in shards])
    return Rollouts(*(sum((getattr(p, name) for p in parts), []) for name in
                      ("prompt_ids", "response_ids", "texts", "truncated")))


def train_on_rollouts(cfg: Config, group, rollouts: Rollouts, advantages: list[float], step: int,
                      pad_id: int) -> dict[str, float]:
    """Shuffle samples, cut them into optimizer steps, shard each step over the workers."""
    sizes = derive_sizes(cfg)
    order = torch.randperm(len(advantages), generator=torch.Generator().manual_seed(cfg.grpo.seed * 100_003 + step))
    order = order.tolist()
    gbs = cfg.policy.train_global_batch_size
    per_worker: list[list] = [[] for _ in range(group.world_size)]
    global_tokens = []
    for start in range(0, len(order), gbs):
        chosen = order[start:start + gbs]
        global_tokens.append(float(sum(len(rollouts.response_ids[i]) for i in chosen)))
        for rank, shard in enumerate(split_evenly(chosen, group.world_size)):
            per_worker[rank].append(build_train_batch(
                [rollouts.prompt_ids[i] for i in shard], [rollouts.response_ids[i] for i in shard],
                [advantages[i] for i in shard], pad_id, cfg.policy.max_total_sequence_length))
    results = group.run_all("train", [(steps, global_tokens, gbs, sizes.micro_batch_size) for steps in per_worker])
    # each worker reports its share of a global mean, so the global value is their sum
    summed = {key: sum(r[key] for r in results) for key in ("loss", "kl", "clip_fraction", "entropy")}
    summed.update(grad_norm=results[0]["grad_norm"], lr=results[0]["lr"])
    return {f"train/{k}": v for k, v in summed.items()}


def validate(cfg: Config, group, problems, scorer) -> EvalResult:
    return evaluate(group, problems[: cfg.grpo.max_val_samples], scorer,
                    sampling_params(cfg, temperature=cfg.grpo.val_temperature), k=1)


def train(cfg: Config) -> dict:
    """Run (or resume) a GRPO training run; returns the summary written to summary.json."""
    started = time.perf_counter()
    sizes = derive_sizes(cfg)
    # Check the inputs (data, reward function) before writing anything, the directories before
    # the slow model load, and start metrics.jsonl only once the model has loaded.
    datasets = build_datasets(cfg.data, cfg.grpo.seed)
    loader = PromptLoader(datasets.train, seed=cfg.grpo.seed, shuffle=cfg.data.shuffle)
    scorer = RewardScorer(cfg.rewards.function, cfg.rewards.timeout_s, cfg.rewards.num_workers)
    run_dir = prepare_run_dir(cfg)
    checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing, cfg.to_yaml(), cfg.digest())
    if cfg.checkpointing.enabled:
        checkpointer.prepare()
    group = make_worker_group(cfg)
    sinks = build_sinks(run_dir, cfg.logger.tensorboard_enabled, cfg.logger.wandb_enabled)
    pad_id = group.run_rank0("ready")["pad_token_id"]
    state = TrainerState()
    resumed_from = None
    if cfg.checkpointing.enabled and cfg.checkpointing.resume and (latest := checkpointer.latest()):
        state = TrainerState(**checkpointer.load(latest, group))
        loader.load_state_dict(state.loader)
        resumed_from = str(latest)

    start_step, wall_before = state.step, state.wall_s
    P, G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    params = sampling_params(cfg)
    timer = StepTimer()
    last_saved = state.step if resumed_from else None
    with ProgressDisplay(cfg.grpo.max_num_steps, state.step, cfg.logger.progress) as progress:
        progress.print(f"run dir {run_dir}  |  {sizes.samples_per_step} samples/step, "
                       f"{sizes.optimizer_steps_per_grpo_step} optimizer step(s)/step"
                       + (f"  |  resumed from {resumed_from}" if resumed_from else ""))
        if state.eval_before is None and cfg.grpo.val_at_start:
            result = validate(cfg, group, datasets.val, scorer)
            state.eval_before = result.metrics("val")
            state.last_val = state.eval_before
            progress.print(f"held-out accuracy before training: {result.accuracy:.3f}")
            sinks.log(state.step, state.eval_before)

        while state.step < cfg.grpo.max_num_steps:
            step = state.step + 1
            step_started = time.perf_counter()
            with timer.section("generate"):
                problems = loader.next_batch(P)
                texts = [p.text for p in problems for _ in range(G)]
                answers = [p.answer for p in problems for _ in range(G)]
                rollouts = generate_rollouts(group, texts, params)
            with timer.section("reward"):
                scores = scorer.score(rollouts.texts, answers)
            rewards = torch.tensor(scores.rewards).view(P, G)
            advantages = group_advantages(rewards, cfg.grpo.use_leave_one_out_baseline, cfg.grpo.normalize_rewards)
            with timer.section("train"):
                metrics = train_on_rollouts(cfg, group, rollouts, advantages.flatten().tolist(), step, pad_id)
            state.step = step
            state.loader = loader.state_dict()
            if cfg.grpo.val_period and step % cfg.grpo.val_period == 0:
                with timer.section("validate"):
                    state.last_val = validate(cfg, group, datasets.val, scorer).metrics("val")
                metrics.update(state.last_val)
            if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0
                                              or step == cfg.grpo.max_num_steps):
                with timer.section("checkpoint"):
                    state.wall_s = wall_before + time.perf_counter() - started
                    report = checkpointer.save(step, group, state.__dict__, {**state.last_val, **metrics})
                metrics.update(report.metrics())
                last_saved = step
            step_s = time.perf_counter() - step_started
            response_tokens = sum(len(r) for r in rollouts.response_ids)
            all_tokens = response_tokens + sum(len(p) for p in rollouts.prompt_ids)
            metrics.update(timer.pop())
            metrics.update({
                "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                "accuracy": sum(map(is_correct, scores.rewards)) / len(scores.rewards),
                "reward/timeouts": scores.num_timeouts, "reward/errors": scores.num_errors,
                "grpo/zero_std_groups": float((rewards.std(dim=1) == 0).float().mean()),
                "response/length_mean": response_tokens / len(rollouts.response_ids),
                "response/truncated_fraction": sum(rollouts.truncated) / len(rollouts.truncated),
                "time/step_s": step_s,
                "throughput/tokens_per_s": all_tokens / step_s,
                "data/epoch": loader.epoch,
            })
            sinks.log(step, metrics)
            progress.update(step, metrics)

        eval_after = None
        if cfg.grpo.val_at_end:
            eval_after = validate(cfg, group, datasets.val, scorer).metrics("val")
            progress.print(f"held-out accuracy after training: {eval_after['val/accuracy']:.3f}")
            sinks.log(state.step, {f"final/{k}": v for k, v in eval_after.items()})
        state.wall_s = wall_before + time.perf_counter() - started
        if cfg.checkpointing.enabled and last_saved != state.step:
            checkpointer.save(state.step, group, state.__dict__, state.last_val)
    checkpointer.close()
    scorer.close()
    sinks.close()
    summary = {
        "final_step": state.step,
        "steps_run": state.step - start_step,
        "resumed_from": resumed_from,
        "wall_s": round(state.wall_s, 3),
        "eval": {"before": _strip(state.eval_before), "after": _strip(eval_after)},
        "checkpoint_dir": str(cfg.checkpoint_dir) if cfg.checkpointing.enabled else None,
    }
    write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _strip(val_metrics: dict | None) -> dict | None:
    """{'val/accuracy': x, ...} -> {'accuracy': x, ...} for summary.json."""
    if val_metrics is None:
        return None
    return {key.split("/", 1)[1]: value for key, value in val_metrics.items()}
