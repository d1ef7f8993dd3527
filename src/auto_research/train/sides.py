"""The rollout side's one interface (``RolloutSide``: take a batch, publish weights, checkpoint, close) and the
state a side in a thread shares with the trainer (``Handover``); which side a run gets is ``schedule.py``'s table.
A side in a thread starts drawing at its first ``take`` (a run's evaluation before training runs alone)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from auto_research.engine.machine import computing
from auto_research.train.rollouts import Drawn, RolloutSource, drawing_version, produce


class RolloutSide(Protocol):
    carries_state: bool
    """A checkpoint saves ``state(step)`` after the batches (--in-flight-updates: the groups still decoding)."""
    started: bool
    """It has drawn for the trainer: a thread of its own then owns the prompt generator and the sampler."""

    def take(self, step: int) -> Drawn: ...  # the step's frozen batch (waits for it)
    def publish(self, version: int, policy) -> None: ...  # weights version ``version`` (after that many steps)
    def checkpoint(self, step: int) -> tuple[list[Drawn], dict]: ...  # the batches drawn ahead, the generator
    def state(self, step: int) -> tuple[dict, dict]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Schedule:
    """When a side draws what: K, the run's last step and the weights version it starts from (the run's step)."""

    max_staleness: int
    last_step: int
    version: int


class Synchronous:
    """The queue of depth 0 (--max-staleness 0): drawn when the trainer asks, by the weights it is about to update."""

    carries_state = False

    def __init__(self, source: RolloutSource, rng: np.random.Generator):
        self.source, self.rng = source, rng
        self.idle_since = None
        self.started = False

    def take(self, step: int) -> Drawn:
        # The sampler idles from the end of one batch until the trainer asks for the next.
        idle = 0.0 if self.idle_since is None else time.perf_counter() - self.idle_since
        drawn = produce(self.source, self.rng, step, step - 1, idle)
        self.idle_since = time.perf_counter()
        return drawn

    def publish(self, version: int, policy) -> None:
        self.source.sampler.load_weights(policy)

    def checkpoint(self, step: int) -> tuple[list[Drawn], dict]:
        """The batches in flight after ``step`` (none here) and the prompt generator's state after the last."""
        return [], self.rng.bit_generator.state

    def state(self, step: int) -> tuple[dict, dict]:
        return {}, {}

    def close(self) -> None:
        pass


class Handover:
    """A rollout side in a thread: the batches it drew, by step (``ready``), handed over under one condition; the
    weights published for it (``snapshots``: version → a copy, or None where the engine holds them); ``error``,
    raised where the trainer waits. ``depth``: batches drawn ahead of the trainer. ``remote``: an engine whose weights
    are pushed to it (a rollout server's client), else None. A subclass draws in ``_draw``."""

    depth: int
    carries_state = False
    name = "auto-research-rollouts"
    cpus: set[int] | None = None
    """Cores for the side's thread alone, set before the first step (benchmarks/async.py), else the process's."""

    def __init__(self, source: RolloutSource, rng, schedule: Schedule, policy, saved: list[Drawn] = (),
                 remote=None):
        self.source, self.rng, self.remote, self.schedule = source, rng, remote, schedule
        self.last_step = schedule.last_step
        self.condition = threading.Condition()
        self.ready = {drawn.step: drawn for drawn in saved}
        self.snapshots: dict[int, dict | None] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.first_step = schedule.version + 1 + len(saved)
        self.drawn_through = self.first_step - 1  # the last step drawn (a push waits for it)
        self.numpy_after = saved[-1].numpy_after if saved else rng.bit_generator.state
        self.policy: object | None = policy  # the weights of ``schedule.version``, published at the first ``take``
        self.thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.thread is not None

    def _start(self) -> None:
        """The first version published (an engine of its own was given it at the start) and the thread started."""
        policy, self.policy = self.policy, None
        if self.remote is None:
            self.publish(self.schedule.version, policy)
        else:
            self.snapshots[self.schedule.version] = None
        self.thread = threading.Thread(target=computing(self._on_its_cores), name=self.name, daemon=True)
        self.thread.start()

    def _on_its_cores(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        self._run()

    # --- the trainer's side ---------------------------------------------------------------------------------------

    def take(self, step: int) -> Drawn:
        if self.thread is None:
            self._start()
        with self.condition:
            while step not in self.ready and self.error is None:
                self.condition.wait()
            if step not in self.ready:
                raise self.error
            return self.ready.pop(step)

    def publish(self, version: int, policy) -> None:
        """The weights of ``version`` for the producer (a copy, or pushed), unless no batch left needs them."""
        if version > drawing_version(self.last_step, self.depth):
            return
        if self.remote is not None:
            return self._push(version, policy)
        self._published(version, {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()})

    def _published(self, version: int, snapshot: dict | None) -> None:
        with self.condition:
            self.snapshots[version] = snapshot
            self.condition.notify_all()

    def _push(self, version: int, policy) -> None:
        """A rollout server holds one version at a time: version v goes in once every batch of v − 1 is drawn (the
        last is step v + depth); the trainer pushes (every rank takes part) while the producer waits."""
        with self.condition:
            while self.drawn_through < min(version + self.depth, self.last_step) and self.error is None:
                self.condition.wait()
            if self.error is not None:
                raise self.error
        self.remote.load_weights(policy)
        self._published(version, None)

    def checkpoint(self, step: int) -> tuple[list[Drawn], dict]:
        """The batches of steps step + 1 … step + depth (waited for: their weights are published) and the prompt
        generator's state after the last of them."""
        last = min(step + self.depth, self.last_step)
        with self.condition:
            while any(s not in self.ready for s in range(step + 1, last + 1)) and self.error is None:
                self.condition.wait()
            if self.error is not None:
                raise self.error
            batches = [self.ready[s] for s in range(step + 1, last + 1)]
            return batches, batches[-1].numpy_after if batches else self.numpy_after

    def state(self, step: int) -> tuple[dict, dict]:
        return {}, {}

    def close(self) -> None:
        if self.thread is None:
            return
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        self.thread.join(timeout=60)

    # --- the producer's side ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for step, version, snapshot, idle in self._scheduled():
                self._hand_over(step, self._draw(step, version, snapshot, idle))
        except BaseException as error:  # handed to the trainer, raised where it waits
            self._fail(error)

    def _draw(self, step: int, version: int, snapshot, idle: float) -> Drawn:
        raise NotImplementedError

    def _scheduled(self):
        """(step, version, snapshot, seconds waited) for each step left to draw, once its weights are published."""
        for step in range(self.first_step, self.last_step + 1):
            version = drawing_version(step, self.depth)
            waiting = time.perf_counter()
            going, snapshot = self._await_version(version)
            if not going:
                return
            yield step, version, snapshot, time.perf_counter() - waiting

    def _await_version(self, version: int) -> tuple[bool, object]:
        """(True, the weights of ``version``; older ones dropped), or (False, None) once the run closes."""
        with self.condition:
            while version not in self.snapshots and not self.stopping:
                self.condition.wait()
            if self.stopping:
                return False, None
            for older in [v for v in self.snapshots if v < version]:
                del self.snapshots[older]
            return True, self.snapshots[version]

    def _hand_over(self, step: int, drawn: Drawn) -> None:
        with self.condition:
            self.ready[step] = drawn
            self.numpy_after = drawn.numpy_after
            self.drawn_through = step
            self.condition.notify_all()

    def _fail(self, error: BaseException) -> None:
        """The producer's error, raised where the trainer waits."""
        with self.condition:
            self.error = error
            self.condition.notify_all()
