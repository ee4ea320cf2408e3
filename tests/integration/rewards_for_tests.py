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
