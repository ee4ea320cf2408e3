"""The stop request, the grace estimate and the deadline, on their own (the loop's use of them is
tested end to end in tests/integration/test_preemption.py)."""

import multiprocessing
import os
import signal
import time

from rlscale.preemption import EXIT_DEADLINE, EXIT_SIGINT, EXIT_SIGTERM, Deadline, StopSignals, save_fits


def test_a_signal_becomes_a_request_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        assert not signals.requested
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        time.sleep(0.01)  # the handler runs in the main thread, between bytecodes
        assert signals.requested and signals.name == "SIGINT" and signals.exit_code == EXIT_SIGINT == 130
        assert 0 <= signals.seconds_since() < 5
    assert signal.getsignal(signal.SIGINT) is before


def _signal_twice():
    with StopSignals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    os._exit(0)  # not reached: the second signal exits at once


def test_a_second_signal_exits_at_once_with_the_signal_code():
    child = multiprocessing.get_context("fork").Process(target=_signal_twice)
    started = time.monotonic()
    child.start()
    child.join(30)
    assert child.exitcode == EXIT_SIGTERM == 143 and time.monotonic() - started < 4


def test_an_emergency_save_is_tried_when_it_fits_or_was_never_measured():
    assert save_fits(30, since_signal_s=2, save_estimate_s=None)
    assert save_fits(30, since_signal_s=2, save_estimate_s=20)
    assert not save_fits(30, since_signal_s=12, save_estimate_s=20)


def test_the_deadline_is_due_when_one_more_step_and_save_would_pass_it():
    assert EXIT_DEADLINE == 75
    started = time.perf_counter() - 100  # 100 s into a 130 s budget
    deadline = Deadline(130.0, started)
    assert not deadline.due(step_estimate_s=None, save_estimate_s=50)  # no step timed yet: go on
    assert not deadline.due(step_estimate_s=10, save_estimate_s=None)
    assert not deadline.due(step_estimate_s=10, save_estimate_s=10)
    assert deadline.due(step_estimate_s=10, save_estimate_s=25)
    assert not Deadline(None, started).due(1e9, 1e9)


def test_stop_requests_from_live_pods_are_obeyed_and_stale_ones_removed(tmp_path):
    """A pod's request (a file named by its hostname) stops the run like a SIGTERM received when
    the file was written; one from a pod no longer in the cluster is removed and ignored."""
    from rlscale.preemption import StopRequests

    live = {"worker-1"}
    requests = StopRequests(tmp_path, alive=lambda pod: pod in live)
    signals = StopSignals(requests)
    assert not signals.requested  # nothing there
    (tmp_path / ".worker-2.tmp").write_text("half written")
    (tmp_path / "worker-0").write_text("a pod long gone")
    assert not signals.requested
    assert sorted(p.name for p in tmp_path.iterdir()) == [".worker-2.tmp"]  # the stale one removed
    (tmp_path / "worker-1").write_text("stop")
    written = time.time() - 5
    os.utime(tmp_path / "worker-1", (written, written))
    assert signals.requested and signals.exit_code == EXIT_SIGTERM
    assert signals.name == "the stop of pod worker-1"
    assert 4.5 < signals.seconds_since() < 30  # the grace counts from the request
    assert (tmp_path / "worker-1").exists()  # kept until the save is done
    (tmp_path / "worker-3").write_text("a second pod, stopped at the same time")
    signals.acknowledge()  # both pods may go
    assert sorted(p.name for p in tmp_path.iterdir()) == [".worker-2.tmp"]


def test_a_run_obeys_and_releases_only_the_requests_of_its_own_pods(tmp_path):
    """Two jobs on one RayCluster share its request directory: a pod hosting only job B's workers
    stops B, not A, and A's saves or exit do not release it before B has saved."""
    from rlscale.preemption import StopRequests

    a = StopRequests(tmp_path, alive=lambda pod: True, hosts={"pod-a"})
    b = StopRequests(tmp_path, alive=lambda pod: True, hosts={"pod-x", "pod-y"})
    (tmp_path / "pod-x").write_text("stop")
    assert a.pending() is None and StopSignals(a).requested is False
    a.acknowledge()
    assert (tmp_path / "pod-x").exists()
    assert b.pending()[0] == "pod-x"
    b.acknowledge()
    assert not (tmp_path / "pod-x").exists()
    # a run owns no pod until it knows where its workers run
    (tmp_path / "pod-a").write_text("stop")
    unwatched = StopRequests(tmp_path, alive=lambda pod: True, hosts=())
    assert unwatched.pending() is None
    unwatched.acknowledge()
    assert (tmp_path / "pod-a").exists()
    unwatched.watch(["pod-a"])
    assert unwatched.pending()[0] == "pod-a"


def test_a_request_whose_hook_stopped_waiting_is_stale(tmp_path):
    """A hook killed before it could take its request back leaves it behind; the pod may come back
    under the same name (a restarted container), so its name being alive is not enough."""
    from rlscale.preemption import StopRequests

    requests = StopRequests(tmp_path, alive=lambda pod: True)
    (tmp_path / "worker-1").write_text(f"stop requested at {time.time() - 130:f}\nwaits until {time.time() - 100:f}\n")
    # a pod whose clock is 20 s behind this one: its fresh request must still count
    (tmp_path / "worker-2").write_text(f"stop requested at {time.time() - 20:f}\nwaits until {time.time() - 5:f}\n")
    assert requests.pending()[0] == "worker-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-2"]


def test_a_stale_request_replaced_while_it_was_read_is_kept(tmp_path, monkeypatch):
    """A restarted pod's hook may write a new request (a new file renamed over the old) between
    the driver's read of the stale one and its removal: the new one stays."""
    import rlscale.preemption as preemption

    path = tmp_path / "worker-1"
    path.write_text(f"waits until {time.time() - 100:f}\n")
    real = preemption._wait_ran_out

    def replaced_meanwhile(text):
        (tmp_path / ".worker-1.tmp").write_text(f"waits until {time.time() + 30:f}\n")
        os.replace(tmp_path / ".worker-1.tmp", path)
        return real(text)

    monkeypatch.setattr(preemption, "_wait_ran_out", replaced_meanwhile)
    assert preemption.StopRequests(tmp_path, alive=lambda pod: True).pending() is None  # the old text: stale
    assert path.exists()
    monkeypatch.setattr(preemption, "_wait_ran_out", real)
    assert preemption.StopRequests(tmp_path, alive=lambda pod: True).pending()[0] == "worker-1"


def test_a_signal_while_stopping_for_a_pod_does_not_cut_the_save_short(tmp_path):
    """The head's own preStop or a job stop may SIGTERM the driver while it saves for a worker pod:
    that is its first signal (recorded); only a second one exits at once."""
    script = f"""
import os, signal, sys, time
from pathlib import Path
from rlscale.preemption import StopRequests, StopSignals
Path({str(tmp_path)!r}, "worker-1").write_text("stop")
with StopSignals(StopRequests({str(tmp_path)!r}, alive=lambda pod: True)) as signals:
    assert signals.requested
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("still saving", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
print("not reached", flush=True)
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_SIGTERM, done.stderr
    assert "still saving" in done.stdout and "not reached" not in done.stdout, done.stdout + done.stderr
    assert "SIGTERM received: already stopping" in done.stderr and "second SIGTERM" in done.stderr


def test_a_request_that_cannot_be_removed_is_said_not_raised(tmp_path, capsys):
    """Removing requests runs while a run ends, maybe on its way out with an error: a failing
    removal must not replace that error."""
    from rlscale.preemption import StopRequests

    (tmp_path / "worker-1").mkdir()  # unlink fails on it
    (tmp_path / "worker-2").write_text("stop")
    StopRequests(tmp_path, alive=lambda pod: False).pending()  # stale: removed where possible
    StopRequests(tmp_path).acknowledge()
    assert [p.name for p in tmp_path.iterdir()] == ["worker-1"]
    assert f"cannot remove the stop request {tmp_path / 'worker-1'}" in capsys.readouterr().err
