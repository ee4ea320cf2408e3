"""Fault injection: real kills, full disks and damaged files never cost a committed checkpoint.

Each kill case forks a child process that trains a tiny worker and saves steps 1..4 (async,
keep_top_k=2) with RLSCALE_FAULT set, so the checkpoint engine SIGKILLs the child at a seeded
random passage of a named fault point (rlscale/ckpt/faults.py) in the snapshot, the writer threads'
persist, the commit or retention. The child logs (fsynced) each step's weight digest before saving
it and each commit it has seen. This process then checks: every step_N left verifies with
checksums, the newest intact one is at least the newest commit the child saw, it loads, and its
weights are the ones saved at that step; the next start clears the debris and saves again.

RLSCALE_FAULT_SEED picks other points (the seed is in each case's id, to reproduce a failure).
"""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
from pathlib import Path

import pytest
import torch

from rlscale.ckpt import layout
from rlscale.ckpt.faults import ENV
from rlscale.ckpt.resume import choose
from rlscale.errors import UserError
from rlscale.workers.state_io import model_tensors
from tests.ckpt.conftest import checkpointer_for, entries, make_group, train_steps

SAVES = 4
WRITER_FILES_PER_SAVE = 11  # the worker's files of one save (tiny model, writers_per_rank=2)
SEED = int(os.environ.get("RLSCALE_FAULT_SEED", "9"))
PHASES = {  # fault point -> passages per run of SAVES saves (retention drops steps 1 and 2)
    "snapshot.before": SAVES, "snapshot.after": SAVES,
    "persist.after_file": SAVES * WRITER_FILES_PER_SAVE,
    "commit.before_manifest": SAVES, "commit.after_manifest": SAVES, "commit.after_rename": SAVES,
    "commit.after_fsync": SAVES, "retention.renamed_aside": SAVES - 2,
}


def kill_cases(seed: int, rounds: int = 3) -> list[tuple[str, int, bool]]:
    """(point, nth passage, async_save): every point `rounds` times, at seeded random passages."""
    rng = random.Random(seed)
    return [(point, rng.randint(1, passes), rng.random() < 0.75)
            for _ in range(rounds) for point, passes in PHASES.items()]


def weights_digest(worker) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model_tensors(worker.model).items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _record(log: Path, **entry) -> None:
    with open(log, "a") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _train_and_save(cfg, log: Path, fault: str | None, saves: int = SAVES, fsize_limit: int | None = None) -> None:
    """The child: train a step, save it, note commits; SIGKILLed by the fault point (or not)."""
    try:
        torch.set_num_threads(1)
        if fault:
            os.environ[ENV] = fault
        group = make_group(cfg)
        ckpt = checkpointer_for(cfg)
        for step in range(1, saves + 1):
            if fsize_limit is not None and step == saves:  # the last save hits the file-size limit
                for report in ckpt.wait():
                    _record(log, committed=report.step)
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, resource.RLIM_INFINITY))
            train_steps(group.workers[0], steps=1, seed=step)
            _record(log, saved=step, weights=weights_digest(group.workers[0]))
            report = ckpt.save(step, group, {"step": step}, {})  # committed already when not async
            for done in ([report] if report.committed else []) + ckpt.poll():
                _record(log, committed=done.step)
        for report in ckpt.wait():
            _record(log, committed=report.step)
    except UserError as exc:
        _record(log, error=str(exc))
    finally:
        os._exit(0)


def run_child(cfg, log: Path, fault: str | None = None, **kwargs) -> int:
    """Fork a child running _train_and_save; its exit code (-9 when SIGKILLed)."""
    child = multiprocessing.get_context("fork").Process(target=_train_and_save, args=(cfg, log, fault), kwargs=kwargs)
    child.start()
    child.join(120)
    assert child.exitcode is not None, "the child hung"
    return child.exitcode


def read_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("point,nth,async_save", kill_cases(SEED),
                         ids=[f"seed{SEED}-{i}-{p}-{n}{'' if a else '-sync'}" for i, (p, n, a) in enumerate(kill_cases(SEED))])
def test_a_kill_at_any_point_of_a_save_loses_no_committed_step(make_cfg, tmp_path, point, nth, async_save):
    cfg = make_cfg("checkpointing.keep_top_k=2", f"checkpointing.async_save={str(async_save).lower()}")
    log = tmp_path / "child.jsonl"
    assert run_child(cfg, log, f"{point}:{nth}") == -signal.SIGKILL  # killed where the seed said

    entries = read_log(log)
    digests = {e["saved"]: e["weights"] for e in entries if "saved" in e}
    seen_committed = [e["committed"] for e in entries if "committed" in e]
    root = cfg.checkpoint_dir
    for _step, path in layout.committed_steps(root):  # a step_N is either whole or absent
        assert layout.verify_step_dir(path, checksums=True).ok, path
    newest = layout.latest_intact(root)
    if seen_committed:
        assert newest is not None and int(newest.name.split("_")[1]) >= max(seen_committed)
    if newest is None:  # killed before the first commit was durable
        assert not seen_committed and point in ("snapshot.before", "snapshot.after", "persist.after_file",
                                                "commit.before_manifest", "commit.after_manifest")
        return
    step = int(newest.name.split("_")[1])
    fresh = make_group(cfg)
    state = checkpointer_for(cfg).load(newest, fresh)  # prepare() clears what the kill left half-done
    assert state == {"step": step}
    assert weights_digest(fresh.workers[0]) == digests[step]  # the weights saved at that step, not others
    assert not layout.stale_tmp_dirs(root)
    ckpt = checkpointer_for(cfg)  # and the run goes on: the next save commits
    ckpt.save(step + 1, fresh, {"step": step + 1}, {})
    ckpt.wait()
    assert layout.latest_intact(root) == root / f"step_{step + 1}"


def test_the_seeded_cases_cover_snapshot_persist_and_commit_twenty_times():
    cases = kill_cases(SEED)
    assert len(cases) >= 20
    assert {point.split(".")[0] for point, _, _ in cases} == {"snapshot", "persist", "commit", "retention"}
    assert kill_cases(SEED) == cases  # the seed reproduces them


def test_a_file_size_limit_efbig_fails_the_save_in_one_line_and_keeps_older_steps(make_cfg, tmp_path):
    cfg = make_cfg("checkpointing.keep_top_k=1")
    log = tmp_path / "child.jsonl"
    assert run_child(cfg, log, saves=2, fsize_limit=4096) == 0
    errors = [e["error"] for e in read_log(log) if "error" in e]
    assert len(errors) == 1 and "step 2 failed: File too large" in errors[0] and "\n" not in errors[0]
    assert [p.name for _s, p in layout.committed_steps(cfg.checkpoint_dir)] == ["step_1"]
    assert layout.verify_step_dir(cfg.checkpoint_dir / "step_1", checksums=True).ok
    assert not (cfg.checkpoint_dir / "tmp_step_2").exists()


def test_a_full_disk_while_writing_the_manifest_commits_nothing(make_cfg, monkeypatch):
    """ENOSPC in the commit itself (the data-file case is in test_failures.py)."""
    from rlscale.ckpt import checkpointer as checkpointer_module

    cfg = make_cfg("checkpointing.keep_top_k=1")
    group = make_group(cfg)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {"step": 1}, {})
    ckpt.wait()
    real_write = checkpointer_module.write_file

    def full_at_manifest(path, data):
        if path.endswith(layout.MANIFEST):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(path, data)

    monkeypatch.setattr(checkpointer_module, "write_file", full_at_manifest)
    ckpt.save(2, group, {"step": 2}, {})
    with pytest.raises(UserError, match="step 2 failed: No space left on device"):
        ckpt.wait()
    assert entries(cfg.checkpoint_dir) == ["step_1"]
    assert choose(cfg.checkpoint_dir, "auto").path == cfg.checkpoint_dir / "step_1"


# ---------------------------------------------------------------- damaged steps and resume choice


@pytest.fixture
def three_steps(make_cfg):
    """Steps 1, 2 and 3 committed, nothing deleted."""
    cfg = make_cfg("checkpointing.keep_top_k=null")
    group = make_group(cfg)
    ckpt = checkpointer_for(cfg)
    for step in (1, 2, 3):
        train_steps(group.workers[0], steps=1, seed=step)
        ckpt.save(step, group, {"step": step}, {})
    ckpt.wait()
    return cfg, cfg.checkpoint_dir


def test_auto_resume_skips_a_corrupted_shard_and_says_so(three_steps):
    _cfg, root = three_steps
    shard = sorted((root / "step_3" / "policy").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40  # same size: only checksums see it
    shard.write_bytes(bytes(data))
    assert choose(root, "auto", checksums=False).path == root / "step_3"  # sizes alone cannot tell
    picked = choose(root, "auto", checksums=True)
    assert picked.path == root / "step_2"
    assert len(picked.notes()) == 1 and "step_3" in picked.notes()[0] and "checksum" in picked.notes()[0]

    shard.write_bytes(bytes(data[:-100]))  # a short shard: sizes are enough
    assert choose(root, "auto").path == root / "step_2"


def test_a_truncated_manifest_is_skipped_by_auto_and_refused_by_path(three_steps):
    _cfg, root = three_steps
    manifest = root / "step_3" / layout.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[:50])
    picked = choose(root, "auto")
    assert picked.path == root / "step_2" and "manifest.json" in picked.notes()[0]
    with pytest.raises(UserError, match=r"checkpointing.resume: '.*step_3' is not an intact checkpoint: manifest"):
        choose(root, str(root / "step_3"))
    explicit = choose(root, str(root / "step_1"))
    assert explicit.path == root / "step_1"
    assert "newer steps (step_2, step_3)" in explicit.notes()[0]  # they are not deleted silently
    assert "set aside as abandoned_step_N" in explicit.notes()[0]
    with pytest.raises(UserError, match=r"checkpointing.resume: '.*step_9' does not exist"):
        choose(root, str(root / "step_9"))


def test_never_refuses_to_start_over_committed_steps_and_auto_refuses_when_all_are_damaged(three_steps, tmp_path):
    _cfg, root = three_steps
    with pytest.raises(UserError, match="resume=never, but .* holds checkpoints .*step_3"):
        choose(root, "never")
    assert choose(tmp_path / "empty", "never").path is None and choose(tmp_path / "empty", "auto").path is None
    for step in (1, 2, 3):
        (root / f"step_{step}" / layout.MANIFEST).unlink()
    with pytest.raises(UserError, match="no intact checkpoint in .*step_3 is damaged"):
        choose(root, "auto")
    assert entries(root) == ["step_1", "step_2", "step_3"]  # nothing deleted


def test_a_step_dir_removed_during_retention(make_cfg):
    """By hand while the run goes on, or by a crash inside retention: neither breaks the next start."""
    cfg = make_cfg("checkpointing.keep_top_k=1")
    group = make_group(cfg)
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {"step": 1}, {})
    ckpt.wait()
    import shutil

    shutil.rmtree(cfg.checkpoint_dir / "step_1")  # removed under the run's feet
    ckpt.save(2, group, {"step": 2}, {})
    assert [r.step for r in ckpt.wait()] == [2]
    (cfg.checkpoint_dir / "dropped_step_1" / "policy").mkdir(parents=True)  # what a crash mid-delete leaves
    assert layout.latest_intact(cfg.checkpoint_dir) == cfg.checkpoint_dir / "step_2"
    checkpointer_for(cfg)
    assert entries(cfg.checkpoint_dir) == ["step_2"]
