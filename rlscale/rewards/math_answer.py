"""The built-in math reward: the last \\boxed{} answer, judged by math-verify against the truth."""

from __future__ import annotations

import functools
import logging
import threading

from math_verify import parse, verify
from math_verify.errors import TimeoutException

# math-verify bounds its own sympy work with signal.alarm (whole seconds). That is only a
# first line of defence: alarms cannot interrupt C code, so RewardScorer's process kill is
# the real limit. The alarm also only works in a main thread; elsewhere we pass None.
_MATH_VERIFY_TIMEOUT_S = 5
_BOX = "\\boxed"

# With timeouts off (non-main threads), math-verify warns once; that is expected here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed) or \\boxed 5; None if absent/unbalanced."""
    if not isinstance(text, str):
        return None
    start = text.rfind(_BOX)
    while start != -1:
        pos = start + len(_BOX)
        if pos < len(text) and text[pos].isalpha():  # another macro, e.g. \boxedsymbol
            start = text.rfind(_BOX, 0, start)
            continue
        if pos < len(text) and text[pos] == "{":
            return _braced(text, pos)
        rest = text[pos:]
        if rest[:1].isspace():  # "\boxed 5": one token, up to a space or closing $
            token = rest.split(None, 1)[0] if rest.strip() else ""
            token = token.split("$", 1)[0]
            return token or None
        return None
    return None


def _braced(text: str, open_pos: int) -> str | None:
    """Text between text[open_pos] == '{' and its matching '}', skipping escapes like \\{."""
    depth = 0
    i = open_pos
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ and \} are literal braces, \\ a line break: neither nests
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
        i += 1
    return None


def _timeout() -> int | None:
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout: int | None) -> list:
    # The same ground truth is scored for every sample of a group, so parse it once.
    if "\\boxed" in answer or "$" in answer:
        return parse(answer, parsing_timeout=timeout)
    return parse(f"${answer}$", parsing_timeout=timeout) or parse(
        f"\\boxed{{{answer}}}", parsing_timeout=timeout)


def math_reward(response: str, answer: str) -> float:
    """1.0 if the last \\boxed{} answer in `response` equals `answer` per math-verify, else 0.0."""
    try:
        boxed = extract_boxed(response)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)  # a numeric column straight from a parquet file
        if boxed is None or not boxed.strip() or not isinstance(answer, str):
            return 0.0
        timeout = _timeout()
        gold = _parse_gold(answer.strip(), timeout)
        pred = parse(f"${boxed}$", parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except (Exception, TimeoutException):  # garbage in, zero out: a reward must never crash a training step
        return 0.0
