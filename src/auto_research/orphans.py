"""Processes that must not outlive their starter: a torchrun rank its launcher (``engine/distributed.py``), the
rollout process of ``--rollout-mode process`` its trainer. Each polls its parent from a daemon thread and stops once
re-parented. (``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, not the process: a trainer
built in a worker thread would lose its rollout process with that thread.) Light, so a child watches from its start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable

from auto_research.errors import is_decimal

PARENT_POLL_SECONDS = 1.0
"""How often a child checks that its parent is alive."""
TRAINER_VARIABLE = "AUTO_RESEARCH_TRAINER_PID"
"""Set by a trainer in the environment of the rollout process it starts: the PID that process stops without."""
STOP_SECONDS = 30.0
"""How long a rollout process whose trainer is gone may take to stop cleanly before it is SIGKILLed."""


def watch_parent(parent: int, gone: Callable[[], None], poll: float = PARENT_POLL_SECONDS) -> threading.Thread:
    """A daemon thread that calls ``gone()`` once this process's parent is no longer ``parent`` (at once if it is
    not now: the parent died before the child looked)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        gone()

    thread = threading.Thread(target=watch, name="auto-research-parent-watch", daemon=True)
    thread.start()
    return thread


def say(line: str) -> None:
    """One line on stderr, without Python's buffers: the parent that read it may be gone (a closed pipe)."""
    with contextlib.suppress(OSError, ValueError):
        os.write(sys.stderr.fileno(), f"auto-research: {line}\n".encode())


def stop_with_trainer(environment=os.environ, poll: float = PARENT_POLL_SECONDS) -> threading.Thread | None:
    """In a rollout process a trainer started (``TRAINER_VARIABLE``): once that trainer is gone, SIGTERM this process
    (``rollout-serve`` removes its shared-memory buffer on SIGTERM), and SIGKILL it if it has not ended
    ``STOP_SECONDS`` later. None where no trainer started this process."""
    trainer = environment.get(TRAINER_VARIABLE, "")
    if not is_decimal(trainer):
        return None

    def gone() -> None:
        say(f"the trainer that started this rollout process (PID {trainer}) is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    return watch_parent(int(trainer), gone, poll)
