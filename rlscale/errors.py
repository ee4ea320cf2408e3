"""User-facing errors.

Anything the user can fix (a bad key, a missing file, an unwritable directory) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, without a traceback.
"""


from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""


def short_reason(exc: BaseException, limit: int = 300) -> str:
    """First line of an exception's message, capped, so the UserError built from it stays one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _capped(text: str, limit: int = 120) -> str:
    """A key or value as echoed in an error: a 5000-character value would not make one line."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


def validation_message(err: ValidationError, subject: str) -> str:
    """One line for the first problem pydantic found, naming its key: `unknown config key 'a.b'`,
    `config key 'a.b': input should be ... (got 7)`, or for a check across keys `config: <reason>`.
    Whole mappings and lists are not echoed back (they would not fit on a line)."""
    first = err.errors()[0]
    loc = _capped(".".join(str(part) for part in first["loc"]))
    if first["type"] == "extra_forbidden":
        return f"unknown {subject} key {loc!r}"
    if first["type"] == "value_error":  # our own validators: their message is already a sentence
        reason = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
        return f"{subject} key {loc!r}: {reason}" if loc else f"{subject}: {reason}"
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {_capped(repr(got))})"
    message = first["msg"]  # pydantic's "Input should be ...": lower-case the first letter only
    return f"{subject} key {loc!r}: {message[:1].lower()}{message[1:]}{shown}"
