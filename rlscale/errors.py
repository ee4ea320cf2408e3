"""User-facing errors.

Anything the user can fix (a bad key, a missing file, an unwritable directory) is raised as a
`UserError`; the CLI prints its message as one line and exits non-zero, without a traceback.
"""


class UserError(Exception):
    """A problem with the user's input or environment, reported as one line."""
