"""A worker reuses its weight and moment files' FileSpecs (plans, staging views) from save to save
while its tensors are the same ones, updated in place; anything else makes them anew. A reused
FileSpec must never write stale data or a stale layout: every save here is loaded back bit-exact."""

import json

import torch
from safetensors.torch import load_file

from rlscale.ckpt import tensorfile
from rlscale.ckpt.engine import FileSpec, RankEngine
from rlscale.workers.state_io import state_signature
from tests.ckpt.conftest import assert_same_state, checkpointer_for, full_state, make_group, train_steps


def trained_worker(make_cfg):
    """A one-worker group after a few training steps (AdamW moments exist), and its checkpointer."""
    cfg = make_cfg()
    group = make_group(cfg)
    train_steps(group.workers[0])
    return cfg, group, group.workers[0], checkpointer_for(cfg)


def saved_state(cfg, ckpt, step):
    """What a fresh worker holds after loading `step`."""
    fresh = make_group(cfg)
    ckpt.load(cfg.checkpoint_dir / f"step_{step}", fresh)
    return full_state(fresh.workers[0])


def save(ckpt, group, step):
    """Save `step`; returns the state at save time and the tensor files the worker used."""
    worker = group.workers[0]
    state = full_state(worker)
    ckpt.save(step, group, {"step": step}, {})
    return state, worker._ckpt_tensors[1] if worker._ckpt_tensors is not None else None


def test_saves_after_in_place_updates_reuse_the_files_and_write_each_save_state(make_cfg):
    cfg, group, worker, ckpt = trained_worker(make_cfg)
    first_state, first_files = save(ckpt, group, 1)
    views = {rel: entry[2] for rel, entry in worker._engine._targets.items()}
    train_steps(worker, steps=1, seed=1)  # weights, moments, scheduler and RNG all move, in place
    second_state, second_files = save(ckpt, group, 2)
    ckpt.wait()

    assert second_files is first_files  # the cache was hit: same FileSpecs, same staging views
    assert views and all(worker._engine._targets[rel][2] is views[rel] for rel in views)
    assert not torch.equal(first_state["weights"]["model.norm.weight"], second_state["weights"]["model.norm.weight"])
    assert_same_state(first_state, saved_state(cfg, ckpt, 1))
    assert_same_state(second_state, saved_state(cfg, ckpt, 2))


def test_rng_and_scheduler_files_are_made_at_every_save(make_cfg):
    cfg, group, worker, ckpt = trained_worker(make_cfg)
    states = [save(ckpt, group, 1)[0]]
    train_steps(worker, steps=1, seed=2)
    states.append(save(ckpt, group, 2)[0])
    ckpt.wait()
    for step, state in zip((1, 2), states):
        step_dir = cfg.checkpoint_dir / f"step_{step}"
        assert json.loads((step_dir / "optim/meta.json").read_text())["scheduler"]["last_epoch"] == step + 1
        assert torch.equal(load_file(step_dir / "rng/rank0.safetensors")["torch_cpu"], state["torch_rng"])
        python = json.loads((step_dir / "rng/rank0.json").read_text())["python"]
        assert python[1] == list(state["py_rng"][1])
    assert not torch.equal(states[0]["torch_rng"], states[1]["torch_rng"])


def test_replaced_optimizer_state_makes_the_files_anew(make_cfg):
    cfg, group, worker, ckpt = trained_worker(make_cfg)
    _, cached = save(ckpt, group, 1)

    # load_state_dict of a copy: new moment tensors, so a hit would save the old ones
    signature = state_signature(worker.model, worker.optimizer)
    copied = {k: v for k, v in worker.optimizer.state_dict().items()}
    copied["state"] = {i: {k: v.clone() for k, v in s.items()} for i, s in copied["state"].items()}
    worker.optimizer.load_state_dict(copied)
    assert state_signature(worker.model, worker.optimizer) != signature
    train_steps(worker, steps=1, seed=3)
    state, made = save(ckpt, group, 2)
    assert made is not cached

    # a fresh optimizer: its state appears at its first step
    old = worker.optimizer
    worker.optimizer = torch.optim.AdamW(worker.model.parameters(), lr=old.defaults["lr"], betas=old.defaults["betas"])
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda s: 1.0)
    train_steps(worker, steps=1, seed=4)
    fresh_state, fresh = save(ckpt, group, 3)
    assert fresh is not made
    ckpt.wait()
    assert_same_state(state, saved_state(cfg, ckpt, 2))
    assert_same_state(fresh_state, saved_state(cfg, ckpt, 3))


def test_loading_into_the_worker_makes_the_files_anew(make_cfg):
    cfg, group, worker, ckpt = trained_worker(make_cfg)
    first_state, cached = save(ckpt, group, 1)
    train_steps(worker, steps=1, seed=5)
    save(ckpt, group, 2)
    ckpt.wait()
    ckpt.load(cfg.checkpoint_dir / "step_1", group)  # back to step 1, in the worker's own tensors
    assert_same_state(first_state, full_state(worker))
    state, made = save(ckpt, group, 3)
    assert made is not cached
    ckpt.wait()
    assert_same_state(first_state, state)
    assert_same_state(first_state, saved_state(cfg, ckpt, 3))


def test_a_moved_tensor_or_another_writer_count_makes_the_files_anew(make_cfg):
    cfg, group, worker, ckpt = trained_worker(make_cfg)
    _, cached = save(ckpt, group, 1)

    norm = worker.model.model.norm.weight
    norm.data = norm.data.clone()  # same name and object, other memory: the cached alias is stale
    with torch.no_grad():
        norm.add_(1.0)
    state, made = save(ckpt, group, 2)
    assert made is not cached
    ckpt.wait()
    assert_same_state(state, saved_state(cfg, ckpt, 2))

    worker.ckpt_settings.writers_per_rank = 1
    state, single = save(ckpt, group, 3)
    assert single is not made
    assert [f.rel for f in single.files] == ["policy/model-r000-000.safetensors", "optim/optim-r000-000.safetensors"]
    ckpt.wait()
    assert_same_state(state, saved_state(cfg, ckpt, 3))


def test_files_of_the_same_layout_share_one_plan():
    # a sharded rank gathers fresh tensors every save: their FileSpecs are new, their plans are not
    one = FileSpec("policy/a.safetensors", {"w": torch.zeros(2, 3), "b": torch.zeros(3)}, metadata={"format": "pt"})
    two = FileSpec("policy/a.safetensors", {"w": torch.ones(2, 3), "b": torch.ones(3)}, metadata={"format": "pt"})
    assert one.plan is two.plan and one.plan is one.plan
    assert one.plan == tensorfile.plan_file([("w", torch.float32, (2, 3)), ("b", torch.float32, (3,))], {"format": "pt"})
    other = FileSpec("policy/a.safetensors", {"w": torch.ones(3, 2), "b": torch.ones(3)}, metadata={"format": "pt"})
    assert other.plan is not one.plan


def test_the_engine_never_copies_through_the_views_of_another_plan(tmp_path):
    # same file, same size, same staging buffer; another dtype: the views must be made again
    engine = RankEngine(writers=1, budget_bytes=1 << 20, pinned=False)
    try:
        for step, tensor in enumerate([torch.arange(4, dtype=torch.float32) + 0.5, torch.arange(4, dtype=torch.int32) + 7]):
            engine.snapshot(tmp_path / str(step), [FileSpec("x.safetensors", {"a": tensor})])
            engine.finish()
            assert torch.equal(load_file(tmp_path / str(step) / "x.safetensors")["a"], tensor)
    finally:
        engine.close()
