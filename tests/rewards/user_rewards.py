"""Reward functions for the scorer tests, imported by workers as tests.rewards.user_rewards:NAME."""

import os
import time


def exact(response: str, answer: str) -> float:
    """1.0 on an exact match; a few responses misbehave on purpose."""
    if response == "sleep":
        time.sleep(30)  # far past any test timeout: the worker must be killed
    if response == "boom":
        raise ValueError("boom")
    if response == "slow boom":
        time.sleep(0.5)
        raise ValueError("slow boom")
    if response == "die":
        os._exit(3)
    if response.startswith("nap"):  # e.g. "nap 1": long enough for a signal to land mid-sample
        time.sleep(0.2)
        return float(response == answer)
    return float(response == answer)


def returns_nan(response: str, answer: str) -> float:
    return float("nan")


def returns_text(response: str, answer: str):
    return "1.0"


class Grader:
    @staticmethod
    def length(response: str, answer: str) -> int:
        return len(response)


NOT_CALLABLE = 3
