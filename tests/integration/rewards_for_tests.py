"""Reward functions for the integration tests, imported by the CLI's scoring processes as
`tests.integration.rewards_for_tests:NAME` (the tests put the repository root on PYTHONPATH).

The tiny random model the tests train never writes a correct `\\boxed{}` answer, so the math
reward would be 0 everywhere: no advantage, no gradient, nothing to compare. `digit_share` gives
graded rewards that differ within a group, so the loss, gradients and updates are real.
"""


def digit_share(response: str, answer: str) -> float:
    """1.0 for the exact answer, else the share of the response's characters that are digits."""
    if response.strip() == answer:
        return 1.0
    return sum(c.isdigit() for c in response) / max(len(response), 1)


NOT_CALLABLE = 3


def kill_a_worker_once(response: str, answer: str) -> float:
    """Scores like digit_share, but the first call after the marker file appears (and the path in
    RLSCALE_TEST_KILL_AFTER, if set) SIGKILLs one policy worker actor: a worker lost mid-step (OOM
    killer, preempted node)."""
    import os
    import signal

    marker = os.environ.get("RLSCALE_TEST_KILL_MARKER")
    after = os.environ.get("RLSCALE_TEST_KILL_AFTER")  # e.g. a checkpoint's step dir: wait until it exists
    if after and not os.path.exists(after):
        return digit_share(response, answer)
    if marker and os.path.exists(marker):
        try:
            os.unlink(marker)  # exactly one scoring process wins the race
        except FileNotFoundError:
            return digit_share(response, answer)
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith("ray::PolicyWorker"):
                os.kill(int(pid), signal.SIGKILL)
                break
    return digit_share(response, answer)


def pause_for_node_loss(response: str, answer: str) -> float:
    """Scores like digit_share, but once the path in RLSCALE_TEST_PAUSE_AFTER exists (a committed
    checkpoint's step dir) it touches RLSCALE_TEST_PAUSE_READY and waits (60 s at most) for
    RLSCALE_TEST_PAUSE_GO: the test takes a node away meanwhile, mid-step, with the policy
    workers idle between calls (tests/integration/test_two_nodes.py)."""
    import os
    import time

    after, ready, go = (os.environ.get(f"RLSCALE_TEST_PAUSE_{name}") for name in ("AFTER", "READY", "GO"))
    if after and ready and go and os.path.exists(after) and not os.path.exists(go):
        with open(ready, "a"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.05)
    return digit_share(response, answer)


def digit_share_if_even(response: str, answer: str) -> float:
    """digit_share for problems whose answer is even, 0.0 for the others: every group of an odd
    answer agrees (zero std), so dynamic sampling drops it and refills the step."""
    return digit_share(response, answer) if answer.strip().lstrip("-").isdigit() and int(answer) % 2 == 0 else 0.0


def always_zero(response: str, answer: str) -> float:
    """0.0 whatever the response: no group is informative."""
    return 0.0
