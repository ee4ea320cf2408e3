import threading

import pytest

from rlscale.rewards import extract_boxed, math_reward


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not nest
    (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box wins
    (r"$\boxed 5$", "5"),
    ("no box here", None),
    (r"\boxed{\frac{1}{2}", None),  # truncated: unbalanced
    (r"\boxed", None),
    ("", None),
    (None, None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, answer, reward", [
    (r"The answer is \boxed{85}.", "85", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{2}", r"\boxed{2}", 1.0),
    (r"\boxed{2}", "$2$", 1.0),
    (r"\boxed{86}", "85", 0.0),
    (r"\boxed{85} no wait \boxed{84}", "85", 0.0),
    ("85", "85", 0.0),  # no box, no reward
    (r"\boxed{}", "85", 0.0),
    (r"\boxed{\frac{", "85", 0.0),
    (r"\boxed{85}", "", 0.0),
    (r"\boxed{)(*&^}", "}{", 0.0),
    (None, "85", 0.0),
    (r"\boxed{85}", None, 0.0),
    (r"\boxed{85}", 85, 1.0),  # a numeric answer column
])
def test_math_reward(response, answer, reward):
    assert math_reward(response, answer) == reward


def test_math_reward_off_the_main_thread():
    # math-verify's signal-based timeouts would raise here; math_reward must switch them off.
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join()
    assert out == [1.0]
