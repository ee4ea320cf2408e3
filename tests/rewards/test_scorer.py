import pytest

from rlscale.errors import UserError
from rlscale.rewards import RewardScorer, ScoreResult, math_reward

USER = "tests.rewards.user_rewards:exact"


@pytest.fixture(scope="module")
def math_scorer():
    with RewardScorer("math", timeout_s=5.0, num_workers=2) as scorer:
        yield scorer


@pytest.fixture(scope="module")
def user_scorer():
    with RewardScorer(USER, timeout_s=0.5, num_workers=2) as scorer:
        yield scorer


def test_batch_matches_math_reward(math_scorer):
    responses = [rf"so \boxed{{{i % 7}}}" if i % 5 else "no box" for i in range(40)]
    responses += [r"\boxed{\frac{1}{2}}", r"\boxed{0.25}", r"\boxed{\frac{", "garbage }{"]
    answers = [str(i % 3) for i in range(40)] + ["0.5", r"\frac{1}{4}", "1", "1"]
    result = math_scorer.score(responses, answers)
    assert isinstance(result, ScoreResult)
    assert result.rewards == [math_reward(r, a) for r, a in zip(responses, answers)]
    assert 0 < sum(result.rewards) < len(responses)
    assert (result.num_timeouts, result.num_errors, result.first_error) == (0, 0, None)
    assert result.seconds > 0


def test_empty_batch_and_length_mismatch(math_scorer):
    assert math_scorer.score([], []).rewards == []
    with pytest.raises(ValueError):
        math_scorer.score(["a"], [])


def test_pathological_math_answer_times_out():
    # sympy grinds on this far longer than the limit; only killing the worker bounds it.
    with RewardScorer("math", timeout_s=0.5, num_workers=1) as scorer:
        result = scorer.score([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{7}"], ["5", "7"])
        assert result.rewards == [0.0, 1.0]
        assert result.num_timeouts == 1


def test_slow_sample_times_out_and_the_rest_still_score(user_scorer):
    # 64 samples → chunks of 8, so the sleeper sits mid-chunk and its chunk-mates are requeued.
    responses = [str(i) for i in range(64)]
    answers = [str(i) if i % 2 else "x" for i in range(64)]
    responses[3] = "sleep"
    result = user_scorer.score(responses, answers)
    expected = [float(r == a) for r, a in zip(responses, answers)]
    assert result.rewards == expected and result.rewards[3] == 0.0
    assert (result.num_timeouts, result.num_errors) == (1, 0)
    assert result.seconds < 5
    again = user_scorer.score(["a", "b"], ["a", "c"])  # the killed worker was replaced
    assert again.rewards == [1.0, 0.0] and again.num_timeouts == 0


def test_errors_bad_values_and_dead_workers_are_counted(user_scorer):
    result = user_scorer.score(["a", "boom", "b", "die", "c"], ["a", "x", "b", "x", "x"])
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert (result.num_timeouts, result.num_errors) == (0, 2)
    assert result.first_error == "sample 1: ValueError: boom"
    assert user_scorer.score(["a"], ["a"]).rewards == [1.0]


def test_first_error_is_the_lowest_failing_sample_not_the_first_to_fail():
    # One sample per chunk, one chunk per worker: sample 1 fails at once, sample 0 half a
    # second later. The log names sample 0 whatever order the workers answer in.
    with RewardScorer(USER, timeout_s=5.0, num_workers=2) as scorer:
        result = scorer.score(["slow boom", "boom", "a"], ["x", "x", "a"])
    assert result.rewards == [0.0, 0.0, 1.0] and result.num_errors == 2
    assert result.first_error == "sample 0: ValueError: slow boom"


@pytest.mark.parametrize("name", ["returns_nan", "returns_text"])
def test_non_finite_or_non_numeric_rewards_are_errors(name):
    with RewardScorer(f"tests.rewards.user_rewards:{name}", timeout_s=1.0, num_workers=1) as scorer:
        result = scorer.score(["a", "b"], ["a", "b"])
    assert result.rewards == [0.0, 0.0] and result.num_errors == 2
    assert "finite float" in result.first_error


@pytest.mark.parametrize("kwargs, fragment", [
    ({"function": "tests.rewards.user_rewards:missing"}, "has no attribute 'missing'"),
    ({"function": "nocolon"}, "'nocolon' must be 'math'"),
    ({"timeout_s": 0}, "rewards.timeout_s=0 must be"),
    ({"num_workers": 0}, "rewards.num_workers=0 must be"),
])
def test_bad_settings_raise_user_errors(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        RewardScorer(**kwargs)


def test_close_is_idempotent_and_final():
    scorer = RewardScorer(USER, timeout_s=1.0, num_workers=1)
    assert scorer.score(["a"], ["a"]).rewards == [1.0]
    scorer.close()
    scorer.close()
    with pytest.raises(RuntimeError):
        scorer.score(["a"], ["a"])


def test_a_sigterm_to_the_process_group_leaves_every_sample_scored():
    """Ray's job stop and a pod's shutdown send SIGTERM to every process of the job; the parent
    decides when to stop (after the step), so a worker must not die mid-sample and score it 0."""
    import os
    import signal
    import threading

    from multiprocessing import forkserver

    with RewardScorer(USER, timeout_s=5.0, num_workers=2) as scorer:
        pids = [w.process.pid for w in scorer._workers]
        # the forkserver the workers come from is in the job too (its death would make
        # multiprocessing take the workers for dead)
        server = forkserver._forkserver._forkserver_pid
        responses = [f"nap {i}" for i in range(12)]
        answers = [r if i % 3 else "x" for i, r in enumerate(responses)]
        timer = threading.Timer(0.3, lambda: [os.kill(pid, signal.SIGTERM) for pid in [*pids, server]])
        timer.start()
        result = scorer.score(responses, answers)
        timer.join()
        assert result.rewards == [float(i % 3 != 0) for i in range(12)]
        assert (result.num_errors, result.num_timeouts) == (0, 0)
        assert [w.process.pid for w in scorer._workers] == pids  # the same workers, alive
        assert all(w.process.is_alive() for w in scorer._workers)
    assert all(not w.process.is_alive() for w in scorer._workers)  # close() still stops them


def test_a_scorer_dropped_without_close_stops_its_workers():
    import gc

    scorer = RewardScorer(USER, timeout_s=5.0, num_workers=1)
    process = scorer._workers[0].process
    assert scorer.score(["a"], ["a"]).rewards == [1.0]
    del scorer
    gc.collect()
    process.join(timeout=10)
    assert not process.is_alive()


def test_a_failing_reward_function_is_reported_and_one_that_always_fails_stops_the_run():
    from rlscale.rewards.scorer import ScoreResult

    assert ScoreResult(rewards=[1.0, 0.0]).check("m:f", "step 3") is None
    note = ScoreResult(rewards=[1.0, 0.0, 0.0], num_errors=2, first_error="sample 1: ValueError: boom").check(
        "m:f", "step 3")
    assert note == ("rewards.function 'm:f' failed on 2 of 3 samples of step 3, scored 0 "
                    "(the first: sample 1: ValueError: boom); metric reward/errors counts them")
    with pytest.raises(UserError, match=r"^rewards.function 'm:f' failed on every sample of step 3: sample 0: "):
        ScoreResult(rewards=[0.0, 0.0], num_errors=2, first_error="sample 0: TypeError: x").check("m:f", "step 3")
