"""User-facing errors.

Anything the user can fix (a bad key, a missing file, an unwritable directory) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, without a traceback.
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""


def short_reason(exc: BaseException, limit: int = 300) -> str:
    """First line of an exception's message, capped, so the UserError built from it stays one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
