"""Errors that are the user's to fix.

A ``UserError`` is reported by the command line as one line on stderr with exit
status 2 and no traceback. Raise it before any work starts whenever possible.
"""


class UserError(Exception):
    """A bad input: a missing file, a malformed row, an impossible setting."""


class TrainingInterrupted(Exception):
    """Ctrl-C during training: the step in flight finished and a checkpoint was saved (exit 130)."""
