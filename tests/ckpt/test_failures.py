"""Saves that fail, crash or rot never pass for complete checkpoints."""

import errno
import threading

import pytest

from rlscale.ckpt import Checkpointer, layout, tensorfile
from rlscale.errors import UserError
from tests.ckpt.conftest import checkpointer_for, entries, make_group, train_steps


@pytest.fixture
def saved(make_cfg):
    """A run dir with step 1 committed, and its worker group."""
    cfg = make_cfg("checkpointing.keep_top_k=1")
    group = make_group(cfg)
    train_steps(group.workers[0])
    ckpt = checkpointer_for(cfg)
    ckpt.save(1, group, {"step": 1}, {})
    ckpt.wait()
    return cfg, group, ckpt


def test_a_write_error_mid_save_keeps_older_steps_and_commits_nothing(saved, monkeypatch):
    cfg, group, ckpt = saved
    real_write = tensorfile.write_file

    def failing_write(path, buffer):
        if "optim-r000-001" in path:  # one writer fails; the others succeed
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(path, buffer)

    monkeypatch.setattr(tensorfile, "write_file", failing_write)
    train_steps(group.workers[0])
    ckpt.save(2, group, {"step": 2}, {})  # the failure happens in the background...
    with pytest.raises(UserError, match="step 2 failed: No space left on device"):
        ckpt.wait()  # ...and is reported here (or at the next poll / save)
    assert entries(cfg.checkpoint_dir) == ["step_1"]
    assert ckpt.latest() == cfg.checkpoint_dir / "step_1"
    assert layout.verify_step_dir(ckpt.latest(), checksums=True).ok  # keep_top_k=1 deleted nothing

    monkeypatch.setattr(tensorfile, "write_file", real_write)
    ckpt.save(3, group, {"step": 3}, {})  # the engine recovers: next save works, retention runs
    ckpt.wait()
    assert entries(cfg.checkpoint_dir) == ["step_3"]


def test_a_crash_mid_save_leaves_a_tmp_dir_that_is_never_trusted(saved):
    cfg, group, ckpt = saved
    # what a killed process leaves: data files written, no manifest, no rename
    tmp = cfg.checkpoint_dir / "tmp_step_2"
    group.run_all("checkpoint_snapshot", [(str(tmp),)])
    group.run_all("checkpoint_finish")
    assert any(tmp.rglob("*.safetensors")) and not (tmp / "manifest.json").exists()
    assert ckpt.latest() == cfg.checkpoint_dir / "step_1"
    checkpointer_for(cfg)  # a new run's prepare() removes it
    assert not tmp.exists()


def test_a_flipped_byte_is_caught_by_verify_and_by_a_verifying_load(saved):
    cfg, group, ckpt = saved
    step = cfg.checkpoint_dir / "step_1"
    assert layout.verify_step_dir(step, checksums=True).ok
    shard = sorted((step / "policy").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    assert layout.verify_step_dir(step).ok  # same size: only the checksum sees it
    verdict = layout.verify_step_dir(step, checksums=True)
    assert not verdict.ok and shard.name in verdict.reason and "checksum" in verdict.reason
    verifying = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing.model_copy(update={"verify_checksums": True}),
                             cfg.to_yaml(), cfg.digest())
    with pytest.raises(UserError, match="checksum"):
        verifying.load(step, make_group(cfg))


def test_a_same_size_corruption_of_the_trainer_state_is_caught_without_verify_checksums(saved):
    cfg, group, ckpt = saved  # verify_checksums is off: the small files are checked all the same
    state_file = cfg.checkpoint_dir / "step_1" / layout.TRAINER_STATE
    text = state_file.read_bytes()
    state_file.write_bytes(b"#" + text[1:])  # same size, not JSON any more
    assert not cfg.checkpointing.verify_checksums
    with pytest.raises(UserError, match=f"damaged: {layout.TRAINER_STATE} does not match its checksum"):
        ckpt.load(cfg.checkpoint_dir / "step_1", group)


def test_a_truncated_file_makes_the_step_untrusted(saved):
    cfg, group, ckpt = saved
    step = cfg.checkpoint_dir / "step_1"
    shard = sorted((step / "optim").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    verdict = layout.verify_step_dir(step)
    assert not verdict.ok and "bytes" in verdict.reason
    assert ckpt.latest() is None
    with pytest.raises(UserError, match="damaged"):
        ckpt.load(step, group)


def test_the_loop_waits_only_for_the_snapshot_and_one_save_is_in_flight(saved, monkeypatch):
    cfg, group, ckpt = saved
    gate = threading.Event()
    real_write = tensorfile.write_file

    def gated_write(path, buffer):
        gate.wait(10)
        return real_write(path, buffer)

    monkeypatch.setattr(tensorfile, "write_file", gated_write)
    report = ckpt.save(2, group, {"step": 2}, {})
    assert not report.committed and report.stall_s < 5
    assert ckpt.poll() == []  # persist still blocked
    assert group.workers[0].checkpoint_poll() is None  # the worker answers at once meanwhile
    assert not (cfg.checkpoint_dir / "step_2").exists()
    assert (cfg.checkpoint_dir / "step_1").exists()  # nothing is deleted before the newer commit

    threading.Timer(0.3, gate.set).start()
    second = ckpt.save(3, group, {"step": 3}, {})  # must wait for step 2 to commit
    assert second.wait_s >= 0.2 and second.stall_s >= second.wait_s
    done = ckpt.wait()
    assert [r.step for r in done] == [2, 3] and all(r.committed for r in done)
    assert entries(cfg.checkpoint_dir) == ["step_3"]


_CLAIMANT = """
import sys, time
from rlscale.ckpt.claim import claim
from rlscale.errors import UserError
start = time.monotonic()
try:
    claim(sys.argv[1], wait_s=float(sys.argv[2]), poll_s=0.1, notify=lambda line: print("WAIT", line, flush=True))
except UserError as e:
    print("REFUSED", round(time.monotonic() - start, 1), e, flush=True)
    sys.exit(2)
print("CLAIMED", round(time.monotonic() - start, 1), flush=True)
"""


def test_a_claim_held_from_another_node_is_waited_for_and_one_from_this_node_is_not(make_cfg):
    """A RayJob retry after a node died finds the dead node's lock still held (NFS/Lustre keep it
    until the client's lease ends): it waits up to claim_wait_s. A holder on this node is a live run."""
    import subprocess
    import sys

    from rlscale.ckpt.claim import LOCK_NAME

    cfg = make_cfg()
    first = checkpointer_for(cfg)
    lock = cfg.checkpoint_dir / LOCK_NAME

    def claimant(wait_s):
        return subprocess.Popen([sys.executable, "-c", _CLAIMANT, str(cfg.checkpoint_dir), str(wait_s)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    same_node = claimant(600)
    out, err = same_node.communicate(timeout=60)
    assert same_node.returncode == 2 and out.startswith("REFUSED") and "WAIT" not in out, err
    assert float(out.split()[1]) < 30  # at once, not after the wait
    lock.write_text("pid 4242 on a-node-that-died\n")  # the holder's note, as another node writes it
    gives_up = claimant(1.0)
    out, err = gives_up.communicate(timeout=60)
    lines = out.splitlines()
    assert gives_up.returncode == 2, err
    assert lines[0].startswith("WAIT") and "held by pid 4242 on a-node-that-died" in lines[0] and "claim_wait_s" in lines[0]
    assert lines[1].startswith("REFUSED") and float(lines[1].split()[1]) >= 1.0
    assert "in use by another run (pid 4242 on a-node-that-died)" in lines[1]
    waits = claimant(600)
    assert waits.stdout.readline().startswith("WAIT")  # waiting now: the holder goes away
    first.close()
    out, err = waits.communicate(timeout=60)
    assert waits.returncode == 0 and out.startswith("CLAIMED"), err


def test_which_lock_notes_name_another_machine(monkeypatch):
    from rlscale.ckpt import claim

    monkeypatch.setattr(claim, "_boot_id", lambda: "boot-here")
    monkeypatch.setattr(claim.os, "uname", lambda: type("U", (), {"nodename": "pod-a"})())
    assert claim._holder_note() == f"pid {claim.os.getpid()} on pod-a, boot boot-here"
    assert not claim._held_elsewhere("pid 7 on pod-b, boot boot-here")  # another pod, same machine: live
    assert claim._held_elsewhere("pid 7 on pod-a, boot boot-there")  # the same pod name on a new machine
    assert not claim._held_elsewhere("pid 7 on pod-a")  # an older note: by hostname
    assert claim._held_elsewhere("pid 7 on pod-b") and claim._held_elsewhere("")
    monkeypatch.setattr(claim, "_boot_id", lambda: None)  # no boot id here: hostnames decide
    assert not claim._held_elsewhere("pid 7 on pod-a, boot boot-there")
    assert claim._held_elsewhere("pid 7 on pod-b, boot boot-here")


def test_a_holder_caught_before_its_note_is_looked_at_again(tmp_path):
    """A holder between its lock and its note leaves an empty note: the claim looks again, finds a
    live run on this machine and refuses it as such, without claiming it waited out claim_wait_s."""
    import subprocess
    import sys

    from rlscale.ckpt import claim

    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\nfrom rlscale.ckpt.claim import _holder_note\n"
         "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('LOCKED', flush=True)\n"
         "time.sleep(0.5); f.write(_holder_note() + '\\n'); f.flush(); time.sleep(30)", str(tmp_path / claim.LOCK_NAME)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("LOCKED")
        import time

        start = time.monotonic()
        with pytest.raises(UserError) as refused:
            claim.claim(tmp_path, wait_s=300, poll_s=0.2)
        assert time.monotonic() - start < 60  # refused once the note named this machine, not after 300 s
        assert "in use by another run (pid" in str(refused.value) and "after waiting" not in str(refused.value)
    finally:
        holder.kill()
        holder.wait()


def test_a_run_that_waited_for_the_claim_is_told_so(make_cfg):
    """The directory's contents may have changed during the wait (the holder's last save): prepare
    says it waited, and the controller then chooses its resume step again."""
    import subprocess
    import sys

    cfg = make_cfg()
    cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from rlscale.ckpt.claim import claim\n"
         "claim(sys.argv[1]); (Path(sys.argv[1]) / '.rlscale.lock').write_text('pid 9 on elsewhere, boot x')\n"
         "print('HELD', flush=True); time.sleep(1.5)", str(cfg.checkpoint_dir)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().startswith("HELD")
    notes = []
    ckpt = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing.model_copy(update={"claim_wait_s": 60.0}), "{}", "x")
    assert ckpt.prepare(notify=notes.append) is True
    assert len(notes) == 1 and "held by pid 9 on elsewhere, boot x" in notes[0]
    holder.wait(timeout=30)
    ckpt.close()
    again = Checkpointer(cfg.checkpoint_dir, cfg.checkpointing, "{}", "x")
    assert again.prepare() is False  # free: no wait
    again.close()


def test_synchronous_saves_return_committed(make_cfg):
    cfg = make_cfg("checkpointing.async_save=false")
    group = make_group(cfg)
    ckpt = checkpointer_for(cfg)
    report = ckpt.save(1, group, {}, {})
    assert report.committed and (cfg.checkpoint_dir / "step_1" / "manifest.json").exists()
    assert set(report.metrics()) >= {"ckpt/bytes", "ckpt/stall_s", "ckpt/persist_s", "ckpt/GBps", "ckpt/free_GB"}
    assert ckpt.poll() == []


def test_one_run_at_a_time_per_checkpoint_dir(make_cfg, tmp_path):
    """A second run on a directory in use would delete the first one's save in flight (as a
    crash's leftover): it is refused, by another process; the lock file goes with the claim."""
    import subprocess
    import sys

    from rlscale.ckpt.claim import LOCK_NAME

    cfg = make_cfg()
    first = checkpointer_for(cfg)
    lock = cfg.checkpoint_dir / LOCK_NAME
    assert lock.read_text().startswith(f"pid {__import__('os').getpid()} ")
    (cfg.checkpoint_dir / "tmp_step_7").mkdir()  # as if the first run were saving step 7
    second = subprocess.run(
        [sys.executable, "-c", "import sys; from rlscale.ckpt.claim import claim; from rlscale.errors import UserError\n"
         "try:\n    claim(sys.argv[1])\nexcept UserError as e:\n    print(e); sys.exit(2)", str(cfg.checkpoint_dir)],
        capture_output=True, text=True, timeout=60)
    assert second.returncode == 2, second.stderr
    assert "is in use by another run (pid" in second.stdout and "its own" in second.stdout
    assert (cfg.checkpoint_dir / "tmp_step_7").is_dir()  # the refused run removed nothing
    also_here = checkpointer_for(cfg)  # the same process shares its claim
    also_here.close()
    assert lock.exists()
    first.close()
    assert not lock.exists()  # the last holder's close ends the claim
    third = checkpointer_for(cfg)  # and the directory is free again
    assert lock.exists()
    third.close()
    # a claim whose directory was removed and made again is taken afresh, lock file and all
    import shutil

    held = checkpointer_for(cfg)
    shutil.rmtree(cfg.checkpoint_dir)
    again = checkpointer_for(cfg)
    assert lock.exists()
    again.close()
    held.close()
