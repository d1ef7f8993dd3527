"""Rollouts in flight (--max-staleness K ≥ 1; docs/async.md): the rollout side in a thread of its own, with its own
copy of the weights, drawing step s's batch with version max(0, s − 1 − K) while the trainer trains (and computing
the reference's log-probs). The schedule is fixed: the producer *waits* for the version a batch needs, so one seed
trains on the same batches whatever the threads' timing. A checkpoint after step s holds the batches of steps
s + 1 … s + K; a resumed run's producer starts at step s + K + 1 from version s.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from auto_research.engine.machine import computing
from auto_research.train.experience import widen
from auto_research.train.rollouts import Drawn, RolloutSource, draw_batch, finish, produce
from auto_research.train.sides import Handover, Schedule


class InFlight(Handover):
    """The rollout side in a thread, drawing whole batches with a copy of the policy (``model``) or ``remote``."""

    def __init__(self, source: RolloutSource, rng, schedule: Schedule, policy, saved: list[Drawn] = (), model=None,
                 remote=None):
        super().__init__(source, rng, schedule, policy, saved, remote)
        self.model, self.depth = model, schedule.max_staleness
        self.loaded: int | None = None

    def _draw(self, step: int, version: int, snapshot, idle: float) -> Drawn:
        loading = time.perf_counter()
        if self.loaded != version and snapshot is not None:
            self.model.load_state_dict(snapshot)
            self.loaded = version
        return produce(self.source, self.rng, step, version, idle, time.perf_counter() - loading)


class StreamedInFlight(InFlight):
    """``InFlight`` over a fleet of rollout servers, drawing across batches (``fleet_stream.Stream``): a batch's
    units are queued once its version is published, each server moving on when no unit of its own is left; pushes
    happen on the servers' threads, so the trainer never waits for one. One thread queues, another scores in order:
    the same batches as ``InFlight``'s. ``reference_rows``: the rows of a part whose reference log-probs are computed
    as soon as they are drawn (None: the whole batch once drawn)."""

    def __init__(self, source: RolloutSource, rng, schedule: Schedule, policy, saved: list[Drawn] = (), fleet=None,
                 reference_rows: int | None = None):
        super().__init__(source, rng, schedule, policy, saved, remote=fleet)
        self.stream, self.queued = None, queue.Queue()
        self.reference_rows = reference_rows if source.reference is not None else None
        self.scorer = threading.Thread(target=computing(self._score_each), name="auto-research-scoring", daemon=True)

    def _start(self) -> None:
        self.stream = self.remote.stream(self.schedule.version, self.policy)
        super()._start()

    def close(self) -> None:
        """The drawer stopped, the stream closed (batches waited for fail), the scorer joined."""
        try:
            super().close()
        finally:
            if self.stream is not None:
                self.stream.close()
            if self.scorer.ident is not None:
                self.scorer.join(timeout=60)

    def _push(self, version: int, policy) -> None:
        self.stream.publish(version, policy)
        self._published(version, None)

    def _run(self) -> None:
        """Queue each step's batch once its version is published; a thread of its own scores them."""
        self.scorer.start()
        try:
            for step, version, _, idle in self._scheduled():
                batch = draw_batch(self.source, self.rng, step)
                ticket = self.stream.sample(batch.prompts, self.source.group_size, batch.seeds, version)
                self.queued.put((step, version, batch, self.rng.bit_generator.state, ticket, idle,
                                 time.perf_counter()))
        except BaseException as error:  # handed to the trainer, raised where it waits
            self._fail(error)
        finally:
            self.queued.put(None)

    def _score_each(self) -> None:
        try:
            while (item := self.queued.get()) is not None:
                step, version, batch, numpy_after, ticket, idle, queued = item
                parts = self._reference_parts(ticket) if self.reference_rows else None
                rollout = ticket.rollout()
                width = rollout.completion_mask.shape[1]
                drawn = finish(self.source, step, version, batch, rollout, numpy_after,
                               {"sample": time.perf_counter() - queued, "idle": idle},
                               None if parts is None else torch.cat([widen(part, width) for part in parts]))
                self._hand_over(step, drawn)
        except BaseException as error:
            self._fail(error)

    def _reference_parts(self, ticket) -> list[torch.Tensor]:
        """The reference's log-probs of the batch, ``reference_rows`` rows at a time, each part as soon as its units
        have answered; each trimmed to its own rows (the same numbers as those rows cut from the whole batch)."""
        K, size = ticket.group_size, self.reference_rows
        rows, parts = len(ticket.prompt_ids) * K, []
        for start in range(0, rows, size):
            stop = min(start + size, rows)
            first, last = start // K, -(-stop // K)
            drawn = ticket.rollout(first, last)
            parts.append(self.source.reference(drawn.rows(start - first * K, stop - first * K, trim=True)))
        return parts
