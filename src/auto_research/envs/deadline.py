"""Calls into the user's environment and tools, bounded in time (``--env-timeout``, ``--tool-timeout``;
docs/environments.md).

Python cannot stop a thread: a call past its limit is abandoned (its sample fails) and its daemon thread left
running, so at most ``MAX_ABANDONED`` may run at once before the run stops (``StuckCalls``). After a stop request
a call past its limit gives up the step (``Stopped``): a hung environment delays the stop by one limit, not one
per sample. Different trajectories' calls run at once (``each``), and a first wave that all hang stops the run
(``Hung``).

A thread, not a process: the environment object and a TRL environment's bound methods live in the trainer's
process and could not be moved without pickling the user's objects. One thread per trajectory (``Worker``), not
per call, as objects bound to their thread need (an SQLite connection, Playwright's sync API, an asyncio loop).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from auto_research.errors import RewardError, UserError

MAX_ABANDONED = 32
"""Abandoned calls (threads still running past their limit) at most, before the run stops."""

CONCURRENCY = 32
"""--env-concurrency's default: calls of different trajectories made at once. As many as MAX_ABANDONED: once a
wave of hung calls is abandoned, the next wave's first timeout passes the cap, so an environment that hangs stops
the run within two limits whatever the number of rows."""

_abandoned: list[threading.Thread] = []
_lock = threading.Lock()
_stopping = threading.Event()


class CallTimeout(Exception):
    """A call into the user's code ran past its limit: that sample fails, the run goes on."""

    flag = "--env-timeout"

    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what} ran past {self.flag} {seconds:g} s (its thread is left running)")
        self.what, self.seconds = what, seconds


class EnvironmentTimeout(CallTimeout):
    flag = "--env-timeout"


class ToolTimeout(CallTimeout):
    flag = "--tool-timeout"


class StuckCalls(RewardError):
    """Too many abandoned calls are still running: the environment or a tool hangs for good."""


class Stopped(RewardError):
    """A call ran past its limit after the run was asked to stop: the step is given up, not finished."""


class Hung(RewardError):
    """Every call of a wave ran past its limit and none answered: the environment (or a tool) hangs."""


def request_stop() -> None:
    """The run was asked to stop (the training loop's signal handler)."""
    _stopping.set()


def clear_stop() -> None:
    """The run that asked has ended (a later run in this process starts afresh)."""
    _stopping.clear()


class Worker:
    """One trajectory's thread: its calls run there, one after another. Once a call runs past its limit the worker
    is abandoned with it, and the trajectory is not called again."""

    def __init__(self, name: str = "environment"):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"auto-research {name}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (work := self.calls.get()) is not None:
            call, outcome, done = work
            try:
                outcome["value"] = call()
            except BaseException as error:  # noqa: BLE001 - handed to the caller, raised there
                outcome["error"] = error
            done.set()
            del work, call, outcome  # nothing of the trajectory is held while waiting (its end closes the worker)

    def run(self, call: Callable, seconds: float) -> tuple[dict, bool]:
        """``call``'s outcome ({"value"} or {"error"}) and whether it finished within ``seconds``."""
        outcome, done = {}, threading.Event()
        self.calls.put((call, outcome, done))
        return outcome, done.wait(seconds)

    def close(self) -> None:
        """No more calls: the thread ends once its current call (if any) returns."""
        self.calls.put(None)


def bounded(call: Callable, seconds: float, timeout: type[CallTimeout], what: str, worker: Worker | None = None):
    """``call()``'s value (or its exception), waiting at most ``seconds`` (0: no limit), on ``worker``'s thread, else
    on a thread of its own (without a limit, in this one)."""
    if not seconds and worker is None:
        return call()
    runner = worker or Worker(what)
    outcome, finished = runner.run(call, seconds or None)
    if worker is None:
        runner.close()
    if not finished:
        _abandon(runner.thread, what, timeout.flag)
        if _stopping.is_set():
            raise Stopped(f"the run was asked to stop while {what} ran, and it ran past {timeout.flag} {seconds:g} s: "
                          "this step is given up")
        raise timeout(what, seconds)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _abandon(thread: threading.Thread, what: str, flag: str) -> None:
    with _lock:
        _abandoned[:] = [running for running in _abandoned if running.is_alive()]
        _abandoned.append(thread)
        running = len(_abandoned)
    if running > MAX_ABANDONED:
        raise StuckCalls(f"{running} calls into the environment or tools are still running past their timeouts "
                         f"(the last: {what}, past {flag}); Python cannot stop them, so the run stops rather than "
                         "leave more threads behind")


def abandoned() -> int:
    """How many abandoned calls are still running."""
    with _lock:
        return sum(thread.is_alive() for thread in _abandoned)


def each(calls: list[Callable], bound: int) -> list[tuple[bool, object]]:
    """Every call's outcome, (True, its value) or (False, its exception), in order; at most ``bound`` running at
    once, each in a daemon thread, started in order. A ``UserError`` or ``RewardError`` is raised at once, the
    calls not yet started never made; so is ``Hung`` when the first min(``bound``, len(calls)) calls to end, two or
    more, all timed out. ``bound`` 1, or a single call: made in this thread, one after another."""
    if bound <= 1 or len(calls) <= 1:
        return [_outcome(call) for call in calls]
    outcomes: list = [None] * len(calls)
    ended: queue.SimpleQueue = queue.SimpleQueue()

    def run(index: int) -> None:
        try:
            outcomes[index] = _outcome(calls[index])
        except BaseException as error:  # noqa: BLE001 - ours (Stopped, StuckCalls), a SystemExit: the caller's
            outcomes[index] = (False, error)
        ended.put(index)

    started = running = answered = timed_out = 0
    wave = min(bound, len(calls))
    while started < len(calls) or running:
        while started < len(calls) and running < bound:
            threading.Thread(target=run, args=(started,), name="auto-research calls", daemon=True).start()
            started, running = started + 1, running + 1
        ok, value = outcomes[ended.get()]
        running -= 1
        if not ok and not isinstance(value, Exception) or not ok and isinstance(value, (UserError, RewardError)):
            raise value
        if not ok and isinstance(value, CallTimeout):
            timed_out += 1
        else:
            answered += 1
        if timed_out >= wave and not answered:
            raise Hung(f"{value.what} hangs: the {timed_out} calls made at once (of {len(calls)}) all ran past "
                       f"{value.flag} {value.seconds:g} s and none answered, so the run stops rather than wait a "
                       f"limit for each of the rest; {abandoned()} threads are left running")
    return outcomes


def _outcome(call: Callable) -> tuple[bool, object]:
    try:
        return True, call()
    except (UserError, RewardError):
        raise
    except Exception as error:  # noqa: BLE001 - the caller decides what a call's exception means
        return False, error
