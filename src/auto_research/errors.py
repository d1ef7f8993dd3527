"""Errors that are the user's to fix: the command line reports a ``UserError`` as one line on stderr, exit status
2, no traceback. Raise it before any work starts whenever possible."""


class UserError(Exception):
    """A bad input: a missing file, a malformed row, an impossible setting."""


class TrainingInterrupted(Exception):
    """Ctrl-C or SIGTERM during training: the step in flight finished and a checkpoint was saved. The exit status
    is the shell's for that signal: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, message: str, exit_status: int = 130):
        super().__init__(message)
        self.exit_status = exit_status


def is_decimal(text: str) -> bool:
    """Digits 0-9 only (``str.isdigit`` is true of "²" and "١٢" too, which ``int`` then refuses or reads)."""
    return text.isascii() and text.isdigit()


def one_line(error: BaseException) -> str:
    """An exception as one line for a user-facing message: its type and the first line of its text."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class RewardError(Exception):
    """A reward (or judge) raised or returned something that is not a number (NaN, inf, a string), mid-run: the
    run saves its last good step and stops with one line."""


class RolloutEngineError(UserError):
    """A rollout engine in another process (a vLLM server) refused a request or is gone, mid-run: the run stops
    with one line naming the server and the last good checkpoint, from which ``--resume`` continues."""
