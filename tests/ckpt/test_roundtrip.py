"""Save then load gives back every bit of the training state, with any worker count."""

import json
import random

import pytest
import torch

from tests.ckpt.conftest import assert_same_state, checkpointer_for, full_state, make_group, train_steps

TRAINER_STATE = {"step": 3, "loader": {"seed": 42, "epoch": 1, "position": 17, "consumed": 113, "size": 96,
                                       "shuffle": True}, "eval_before": {"val/accuracy": 0.25}, "wall_s": 1.5}


def test_round_trip_is_bit_exact_and_training_continues_identically(make_cfg):
    cfg = make_cfg()
    group = make_group(cfg)
    train_steps(group.workers[0])
    before = full_state(group.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(3, group, TRAINER_STATE, {"val/accuracy": 0.5})
    [report] = ckpt.wait()
    assert report.committed and report.bytes > 0 and report.gbps > 0 and report.free_bytes > 0
    assert_same_state(before, full_state(group.workers[0]))  # saving does not disturb the state

    torch.manual_seed(999), random.seed(999)  # the RNG must come back from the checkpoint
    restored = make_group(cfg)
    assert ckpt.load(ckpt.latest(), restored) == TRAINER_STATE
    assert_same_state(before, full_state(restored.workers[0]))
    # optimizer moments, step counters and scheduler act the same on the next updates
    train_steps(group.workers[0], seed=5)
    train_steps(restored.workers[0], seed=5)
    assert_same_state(full_state(group.workers[0]), full_state(restored.workers[0]))
    assert restored.workers[0].scheduler.last_epoch == group.workers[0].scheduler.last_epoch == 4


def test_two_workers_save_one_loads(make_cfg):
    cfg = make_cfg()
    group = make_group(cfg, world_size=2)
    for worker in group.workers:
        train_steps(worker)
    before = full_state(group.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(2, group, TRAINER_STATE, {})
    ckpt.wait()
    manifest = json.loads((cfg.checkpoint_dir / "step_2" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    for rank in (0, 1):  # both ranks wrote their share of weights and moments
        assert any(rel.startswith(f"policy/model-r{rank:03d}") for rel in manifest["files"])
        assert any(rel.startswith(f"optim/optim-r{rank:03d}") for rel in manifest["files"])

    single = make_group(cfg, world_size=1)
    ckpt.load(cfg.checkpoint_dir / "step_2", single)
    assert_same_state(before, full_state(single.workers[0]))


def test_one_worker_saves_two_load(make_cfg):
    cfg = make_cfg()
    group = make_group(cfg)
    train_steps(group.workers[0])
    before = full_state(group.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, TRAINER_STATE, {})
    ckpt.wait()

    pair = make_group(cfg, world_size=2)
    ckpt.load(cfg.checkpoint_dir / "step_1", pair)
    for worker in pair.workers:
        state = full_state(worker)
        state["torch_rng"], state["py_rng"] = before["torch_rng"], before["py_rng"]  # RNG is per process here
        assert_same_state(before, state)
    assert torch.equal(torch.get_rng_state(), before["torch_rng"])  # rank 0 restored the saved RNG


def test_hf_loads_the_policy_with_identical_logits(make_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = make_cfg()
    group = make_group(cfg)
    worker = group.workers[0]
    train_steps(worker)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {}, {})
    ckpt.wait()
    policy = cfg.checkpoint_dir / "step_1" / "policy"
    loaded = AutoModelForCausalLM.from_pretrained(policy).to(worker.device)
    assert loaded.dtype == worker.model.dtype and loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 60, (2, 11), device=worker.device)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, worker.model(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(policy)("1+2=").input_ids == worker.tokenizer("1+2=").input_ids


def test_staging_buffers_are_reused_and_bounded(make_cfg):
    cfg = make_cfg()
    group = make_group(cfg)
    worker = group.workers[0]
    train_steps(worker)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {}, {})
    first = {rel: buf.data_ptr() for rel, buf in worker._engine._buffers.items()}
    train_steps(worker)
    ckpt.save(2, group, {}, {})  # waits for step 1's commit, then reuses its buffers
    assert first and {rel: buf.data_ptr() for rel, buf in worker._engine._buffers.items()} == first
    ckpt.wait()

    # a budget smaller than the state: the rest is written during the snapshot, memory stays bounded
    small = make_cfg("checkpointing.staging_budget_gb=0.0001")
    group = make_group(small)
    train_steps(group.workers[0])
    before = full_state(group.workers[0])
    ckpt = checkpointer_for(small)
    report = ckpt.save(3, group, {}, {})
    assert report.direct_bytes > 0
    assert 0 < group.workers[0]._engine.staged_bytes() <= 0.0001e9
    ckpt.wait()
    restored = make_group(small)
    ckpt.load(small.checkpoint_dir / "step_3", restored)
    assert_same_state(before, full_state(restored.workers[0]))


def test_load_refuses_a_different_model(make_cfg, tmp_path):
    from rlscale.errors import UserError
    from rlscale.models.tiny import build_char_tokenizer, build_tiny_model

    cfg = make_cfg()
    group = make_group(cfg)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {}, {})
    ckpt.wait()
    other_dir = tmp_path / "other"
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, hidden_size=16, layers=1, heads=2).save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    other = make_group(make_cfg(f"policy.model_name={other_dir}"))
    with pytest.raises(UserError, match="does not match the model"):
        ckpt.load(cfg.checkpoint_dir / "step_1", other)


def test_training_right_after_the_snapshot_does_not_reach_the_save(make_cfg):
    # on CUDA the device-to-host copies run on after save() returns; the optimizer's pre-step
    # hook makes the update wait for them
    cfg = make_cfg()
    group = make_group(cfg)
    worker = group.workers[0]
    train_steps(worker)
    before = full_state(worker)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, TRAINER_STATE, {})
    train_steps(worker, steps=1, seed=3)  # no wait: straight on, as the GRPO loop does
    ckpt.wait()
    restored = make_group(cfg)
    ckpt.load(cfg.checkpoint_dir / "step_1", restored)
    assert_same_state(before, full_state(restored.workers[0]))
    moved = full_state(worker)["moments"]  # the update did happen (weights may not move in bf16)
    assert any(not torch.equal(before["moments"][k], moved[k]) for k in moved)
