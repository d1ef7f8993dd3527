"""Weights updated in flight, and partial rollouts (--in-flight-updates, with --max-staleness K ≥ 1; docs/async.md).

The rollout side keeps a continuous batch of groups (``engine/rollout/partial.Pool``) in a thread of its own, and
produces one step's batch a *round*. Round r (for step r) decodes with the weights of version max(0, r − 2), taken
between two decode steps (the rows in flight go on from where they were, their KV cache kept or recomputed), while
the trainer trains step r − 1. A round admits groups into the rows that finished groups freed and decodes until P
groups (this rank's prompts a step) have all K completions done; those P, in the order they finished, are step
r's batch. A group still decoding is not waited for: it goes on in the next round under the next weights, so a
completion may span versions, and the trainer takes other finished groups instead. Nothing depends on timing:
"due" is counted in decode steps (a round ends when its P-th group finishes), and every round waits for its
version, so one seed gives one schedule.

Bounded: before round r, a group (finished or not) holding a token drawn by a version older than (r − 1) − K is
put back in the queue, to be drawn again from its first token (same prompt, same seed) under the current weights;
such a token is never trained on. At K = 1 that is every group carried over a round: partial rollouts pay from
K = 2.

Each token carries the version that drew it and μ's log-prob under that version; the trainer's correction
(``experience.build_experience``) weights each token by π_old / μ_version (truncated, --rollout-correction).

A checkpoint after step s saves the batch of step s + 1 and the rollout side as round s + 1 left it: the groups
decoding with their KV caches (the old weights' own), those done but not handed over, the queue and the prompt
generator. A resumed run decodes on from there: SIGKILL and --resume end with the uninterrupted run's rows.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque

import torch

from auto_research.engine.rollout import Rollout, eos_ids
from auto_research.engine.rollout.partial import Finished, Pool, lanes_to_rows, pool_from_files, pool_to_files
from auto_research.train.experience import Batch
from auto_research.train.rollouts import Drawn, Handover, RolloutSource, draw_batch, score, signal_counts
from auto_research.errors import RewardError


def round_version(step: int) -> int:
    """The weights version a round decodes with: the trainer's previous step's input, max(0, step − 2)."""
    return max(0, step - 2)


class PartialInFlight(Handover):
    """The rollout side of --in-flight-updates: ``take``, ``checkpoint`` (the batch of the next step) and ``close``
    are ``Handover``'s; ``state``, the rest of the rollout side for a checkpoint."""

    depth = 1

    def __init__(self, source: RolloutSource, model, tokenizer, settings, rng, max_staleness: int, last_step: int,
                 version: int, policy, recompute_kv: bool, saved: list[Drawn] = (), cpus: set[int] | None = None,
                 state: tuple[dict, dict] | None = None, context=contextlib.nullcontext):
        self.source, self.model, self.rng, self.cpus = source, model, rng, cpus
        self.tokenizer, self.max_staleness, self.last_step = tokenizer, max_staleness, last_step
        self.recompute_kv, self.context = recompute_kv, context
        """``context``: entered around every forward of the rollout side (the trainer's bf16 autocast)."""
        self.pool = Pool(model, tokenizer, source.group_size, settings.max_new_tokens, settings.temperature,
                         settings.top_k, settings.top_p, eos_ids(tokenizer, model), source.pad_token_id)
        self.condition = threading.Condition()
        self.ready = {drawn.step: drawn for drawn in saved}
        self.snapshots: dict[int, dict] = {}
        self.loaded: int | None = None
        self.error: BaseException | None = None
        self.stopping = False
        self.first_step = version + 1 + len(saved)
        self.pending: deque = deque()
        self.finished: list[Finished] = []
        self.draws = self.first_step - 1  # a resumed run draws new prompt seeds, not the first run's again
        self.per_step: int | None = None
        self.numpy_after = saved[-1].numpy_after if saved else rng.bit_generator.state
        self.requeued = 0
        self.states: dict[int, tuple[dict, dict]] = {}
        """The rollout side after each round (``_state``), until a checkpoint no longer needs it."""
        if state is not None:
            self._restore(*state)
        self.publish(version, policy)
        self.thread = threading.Thread(target=self._run, name="auto-research-partial-rollouts", daemon=True)
        self.thread.start()

    # --- the trainer's side --------------------------------------------------------------------------------------

    def publish(self, version: int, policy) -> None:
        if version > round_version(self.last_step):
            return
        snapshot = {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}
        with self.condition:
            self.snapshots[version] = snapshot
            self.condition.notify_all()

    def state(self, step: int) -> tuple[dict, dict]:
        """The rollout side as the round of step + 1 left it (``checkpoint`` waited for that round)."""
        last = min(step + self.depth, self.last_step)
        with self.condition:
            for older in [s for s in self.states if s < last]:
                del self.states[older]
            return self.states.get(last, ({}, {}))

    def _state(self) -> tuple[dict, dict]:
        tensors, plain = pool_to_files(self.pool, self.finished)
        plain.update(pending=[list(item) for item in self.pending], draws=self.draws, per_step=self.per_step,
                     requeued=self.requeued, loaded=self.loaded)
        return tensors, plain

    def _restore(self, tensors: dict, plain: dict) -> None:
        if not plain:
            return
        self.finished = pool_from_files(self.pool, tensors, plain)
        self.pending = deque(tuple(item) for item in plain["pending"])
        self.draws, self.per_step, self.requeued = plain["draws"], plain["per_step"], plain["requeued"]
        self.loaded = plain["loaded"]
        if self.loaded is not None:  # the weights those caches were decoding with: swapped for the next at once
            self.loaded = -1

    # --- the producer's side ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)
            for step in range(self.first_step, self.last_step + 1):
                waiting = time.perf_counter()
                with self.context():
                    if not self._take_weights(round_version(step)):
                        return
                    idle = time.perf_counter() - waiting
                    drawn = self._round(step, idle)
                state = self._state()
                with self.condition:
                    self.states[step] = state  # before the batch: ``checkpoint`` waits for the batch, then reads it
                self._hand_over(step, drawn)
        except BaseException as error:  # handed to the trainer, raised where it waits
            self._fail(error)

    def _take_weights(self, version: int) -> bool:
        going, snapshot = self._await_version(version)
        if not going:
            return False
        if self.loaded != version:
            self.model.load_state_dict(snapshot)
            self.loaded = version
            self.pool.swap(version, self.recompute_kv)  # between two decode steps of the rows in flight
        return True

    def _round(self, step: int, idle: float) -> Drawn:
        """Step ``step``'s batch: the stale groups back in the queue, then decode steps until P groups are done."""
        started = time.perf_counter()
        oldest_allowed = (step - 1) - self.max_staleness
        stale = [lane for lane in self.finished if int(lane.versions[lane.versions >= 0].min()) < oldest_allowed]
        self.finished = [lane for lane in self.finished if all(lane is not other for other in stale)]
        dropped = {key for key, oldest in self.pool.oldest_versions() if oldest < oldest_allowed}
        requeue = [lane.key for lane in stale] + self.pool.drop(lambda key: key not in dropped)
        self.requeued += len(requeue)
        self.pending.extendleft(reversed(requeue))  # drawn again first, in the order they were first admitted
        self._fill()
        while self.per_step is None or len(self.finished) < self.per_step:
            self.finished += self.pool.tick()
            self._fill()
        taken, self.finished = self.finished[: self.per_step], self.finished[self.per_step:]
        sampled = time.perf_counter()
        drawn = self._drawn(step, taken, idle, sampled - started)
        drawn.seconds["score"] = time.perf_counter() - sampled
        return drawn

    def _fill(self) -> None:
        """Admit groups into the free rows (the batch's rows: P · K), drawing the next prompts when the queue is
        empty (one draw a step's worth, from the run's generator and seed)."""
        K, admitted = self.source.group_size, []
        while self.per_step is None or self.pool.size + K * (len(admitted) + 1) <= self.per_step * K:
            if not self.pending:
                self.draws += 1
                batch = draw_batch(self.source, self.rng, self.draws)
                self.per_step = self.per_step or len(batch.indices)
                self.pending.extend(zip(batch.indices, batch.seeds))
            index, seed = self.pending.popleft()
            ids = self.tokenizer(self.source.prompts[index], add_special_tokens=False)["input_ids"]
            admitted.append(((index, seed), ids, seed))
        self.pool.admit_many(admitted)

    def _drawn(self, step: int, lanes: list[Finished], idle: float, sample_seconds: float) -> Drawn:
        source, K = self.source, self.source.group_size
        prompt, prompt_mask, tokens, mask, logprobs, entropies, versions = lanes_to_rows(
            lanes, source.pad_token_id, eos_ids(self.tokenizer, self.model))
        texts = self.tokenizer.batch_decode(tokens * mask + source.pad_token_id * (1 - mask), skip_special_tokens=True)
        oldest = versions.masked_fill(versions < 0, 1 << 62).amin(1)
        rollout = Rollout(torch.cat([prompt, tokens], dim=1), prompt_mask, mask, texts, K, logprobs, entropies,
                          False, oldest, token_versions=versions)
        indices, seeds = [lane.key[0] for lane in lanes], [lane.key[1] for lane in lanes]
        batch = Batch(indices, [source.prompts[i] for i in indices], [source.examples[i] for i in indices], seeds)
        rewards = failure = None
        try:
            rewards = score(source, batch, rollout)
        except RewardError as error:
            failure = str(error)
        counts = signal_counts(rewards, K) if failure is None else None
        reference = source.reference(rollout) if source.reference is not None and failure is None else None
        seconds = {"sample": sample_seconds, "score": 0.0, "idle": idle}
        return Drawn(step, batch, rollout, rewards, None, failure, self.rng.bit_generator.state, seconds, reference,
                     counts)
