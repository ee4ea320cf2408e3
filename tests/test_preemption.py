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
