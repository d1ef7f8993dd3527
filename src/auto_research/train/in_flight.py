"""Rollouts in flight (--max-staleness K ≥ 1): the rollout side in a thread of its own, with its own copy of the
policy's weights, drawing step s's batch with weights version max(0, s − 1 − K) while the trainer trains.

The rollout side also computes the frozen reference's log-probs of each batch (with a copy of the reference,
when it is a model of its own), which a synchronous step computes in the trainer's experience phase: a stale
batch costs the trainer a forward of its own policy for π_old instead.

The schedule is fixed, so two runs with one seed train on the same batches whatever the threads' timing: the
producer *waits* for the version a batch needs (it never draws with newer weights, and no batch is dropped), and
the trainer waits for the batch it needs. At most K + 1 batches are ever drawn ahead of the trainer, and the
producer holds at most K + 1 versions of the weights (a copy each, the newest the trainer published). The
builtin sampler runs apart this way; the thread runs no collective (each rank has its own producer; the
agreement over ranks is the trainer's, ``rollouts.agreed_scores``).

A checkpoint after step s holds the batches of steps s + 1 … s + K (drawn by versions that a resumed run no
longer has) and the prompt generator's state after the last of them; a resumed run starts its producer at
step s + K + 1 with the checkpoint's weights, version s: SIGKILL and --resume end with the same weights.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import queue
import threading
import time

import torch

from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout.builtin import BuiltinSampler, sample
from auto_research.errors import UserError
from auto_research.train.components import Components, chunk_prompts, sampling_settings
from auto_research.train.experience import no_grad_forward, widen
from auto_research.train.rollouts import (Drawn, Handover, RolloutSource, Synchronous, draw_batch, drawing_version,
                                          finish, produce)
from auto_research.train.state import LoopState


class InFlight(Handover):
    """The rollout side in a thread: ``take``, ``publish``, ``checkpoint`` and ``close`` as ``Synchronous``'s."""

    def __init__(self, source: RolloutSource, model, rng, max_staleness: int, last_step: int, version: int, policy,
                 saved: list[Drawn] = (), cpus: set[int] | None = None, remote=None):
        self.source, self.model, self.rng, self.remote = source, model, rng, remote
        self.max_staleness, self.last_step, self.cpus = max_staleness, last_step, cpus
        self.depth = max_staleness
        self.condition = threading.Condition()
        self.ready = {drawn.step: drawn for drawn in saved}
        self.snapshots: dict[int, dict | None] = {}
        self.loaded: int | None = None
        self.error: BaseException | None = None
        self.stopping = False
        self.first_step = version + 1 + len(saved)
        self.drawn_through = self.first_step - 1
        self.numpy_after = saved[-1].numpy_after if saved else rng.bit_generator.state
        if remote is None:
            self.publish(version, policy)
        else:  # the engine was given these weights when the run started (or resumed)
            self.snapshots[version] = None
        self.thread = threading.Thread(target=self._run, name="auto-research-rollouts", daemon=True)
        self.thread.start()

    # --- the trainer's side ---------------------------------------------------------------------------------

    def publish(self, version: int, policy) -> None:
        """A copy of the weights of ``version`` for the producer, unless no batch left to draw needs it."""
        if version > drawing_version(self.last_step, self.max_staleness):
            return
        if self.remote is not None:
            return self._push(version, policy)
        snapshot = {name: tensor.detach().clone() for name, tensor in policy.state_dict().items()}
        with self.condition:
            self.snapshots[version] = snapshot
            self.condition.notify_all()

    def _push(self, version: int, policy) -> None:
        """Version v goes in once every batch drawn by v − 1 is drawn (the last is step v + K); the engine samples
        step v + K + 1 while the trainer trains."""
        self._push_when_drawn(version, min(version + self.max_staleness, self.last_step), policy)

    # --- the producer's side ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # this thread only
            for step, version, snapshot, idle in self._scheduled():
                loading = time.perf_counter()
                if self.loaded != version and snapshot is not None:
                    self.model.load_state_dict(snapshot)
                    self.loaded = version
                drawn = produce(self.source, self.rng, step, version, idle, time.perf_counter() - loading)
                with self.condition:
                    self.drawn_through = step  # (``_push`` waits for it, woken by the hand-over)
                self._hand_over(step, drawn)
        except BaseException as error:  # handed to the trainer, raised where it waits
            self._fail(error)

    def _scheduled(self):
        """Each step left to draw, once the weights its batch needs are published: (step, version, their snapshot,
        the seconds waited for them); it ends when the run closes."""
        for step in range(self.first_step, self.last_step + 1):
            version = drawing_version(step, self.max_staleness)
            waiting = time.perf_counter()
            going, snapshot = self._await_version(version)
            if not going:
                return
            yield step, version, snapshot, time.perf_counter() - waiting


class StreamedInFlight(InFlight):
    """``InFlight`` over a fleet of rollout servers, drawing across batches (``fleet_stream.Stream``): a batch's
    units are queued as soon as its version is published, and each server moves on to the next version when no unit
    of its own is left, whatever the others still draw. Publishing copies the weights (the pushes happen on the
    servers' threads), so the trainer never waits for a push. One thread queues the batches, another scores each
    once drawn, in order. The same batches as ``InFlight``'s (each unit drawn by its version's weights)."""

    def __init__(self, source: RolloutSource, rng, max_staleness: int, last_step: int, version: int, policy,
                 saved: list[Drawn] = (), cpus: set[int] | None = None, fleet=None, reference_rows: int | None = None):
        self.stream, self.queued = fleet.stream(version, policy), queue.Queue()
        self.reference_rows = reference_rows if source.reference is not None else None
        """Rows a part of a batch whose reference log-probs are computed as soon as they are drawn (None: the
        whole batch once drawn)."""
        self.scorer = threading.Thread(target=self._score_each, name="auto-research-scoring", daemon=True)
        super().__init__(source, None, rng, max_staleness, last_step, version, policy, saved, cpus, fleet)

    def close(self) -> None:
        """The drawer stopped, the stream closed (its servers' threads end; batches waited for fail), the scorer
        joined."""
        try:
            super().close()
        finally:
            self.stream.close()
            if self.scorer.ident is not None:
                self.scorer.join(timeout=60)

    def _push(self, version: int, policy) -> None:
        self.stream.publish(version, policy)
        with self.condition:
            self.snapshots[version] = None
            self.condition.notify_all()

    def _run(self) -> None:
        """Queue each step's batch once its version is published; a thread of its own scores them."""
        self.scorer.start()
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)
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
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # this thread only
            while (item := self.queued.get()) is not None:
                step, version, batch, numpy_after, ticket, idle, queued = item
                parts = self._reference_parts(ticket) if self.reference_rows else None
                rollout = ticket.rollout()
                width = rollout.completion_mask.shape[1]
                drawn = finish(self.source, step, version, batch, rollout, numpy_after,
                               {"sample": time.perf_counter() - queued, "idle": idle},
                               None if parts is None else torch.cat([widen(part, width) for part in parts]))
                with self.condition:
                    self.drawn_through = step
                self._hand_over(step, drawn)
        except BaseException as error:
            self._fail(error)

    def _reference_parts(self, ticket) -> list[torch.Tensor]:
        """The reference's log-probs of the batch, ``reference_rows`` rows at a time, each part as soon as the units
        holding its rows have answered, while the later ones are drawn. Each part is trimmed to its own rows, so
        its numbers are those of the same rows cut from the whole batch."""
        K, size = ticket.group_size, self.reference_rows
        rows, parts = len(ticket.prompt_ids) * K, []
        for start in range(0, rows, size):
            stop = min(start + size, rows)
            first, last = start // K, -(-stop // K)
            drawn = ticket.rollout(first, last)
            parts.append(self.source.reference(drawn.rows(start - first * K, stop - first * K, trim=True)))
        return parts


REFERENCE_PARTS = 4
"""A streamed batch's reference log-probs come in (at most) this many parts of whole groups, as their rows are
drawn, unless --micro-batch-size sets the parts (the trainer's own micro-batches)."""


def reference_rows(config, prompts: int, group_size: int) -> int | None:
    """Rows a part of a streamed batch's reference log-probs: the trainer's micro-batch when it is a number of
    rows, else the whole groups of a REFERENCE_PARTS-th of the batch's prompts (a group in one forward shares its
    prompt's pass, ``packing.grouped_rows``). None (the whole batch, once drawn) when micro-batches are cut by
    tokens, which depends on every row's length, and with --offload-reference, whose weights come back for each
    pass."""
    if config.max_tokens_per_micro_batch is not None or config.offload_reference:
        return None
    return config.micro_batch_size or -(-prompts // REFERENCE_PARTS) * group_size


def streams(c: Components, source: RolloutSource) -> bool:
    """Whether a run's batches are drawn across batches over a fleet (``StreamedInFlight``): several servers, one
    process, one draw per batch (no multi-turn episodes, refills or greedy baseline, which draw again mid-batch)."""
    return (hasattr(c.sampler, "stream") and not c.world.distributed and source.episodes is None
            and source.max_refills is None and source.greedy is None)


def available_memory() -> int | None:
    """Bytes of memory this host can give without swapping (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def copies_fit(policy, max_staleness: int, log) -> bool:
    """Whether the K + 2 copies of the weights that drawing across batches holds in host memory fit in half of
    what this host has available; else one line, and the run draws whole batches."""
    copies = max_staleness + 2
    need = copies * sum(parameter.numel() * parameter.element_size() for parameter in policy.parameters())
    free = available_memory()
    if free is None or need <= free / 2:
        return True
    log(f"rollout fleet: whole batches, one version on every server: drawing across batches would hold {copies} "
        f"copies of the weights in host memory ({need / 2**30:.1f} GiB), more than half of the "
        f"{free / 2**30:.1f} GiB available")
    return False


def rollout_source(c: Components, sampler, model, context, reference=None, tokenizer=None) -> RolloutSource:
    """What the rollout side needs of a run; ``reference``: a frozen reference of its own, whose log-probs it
    then computes (in the micro-batches the trainer would use, so the numbers are the trainer's); ``tokenizer``:
    the rollout side's own (default: the trainer's)."""
    config, world = c.config, c.world
    tokenizer = tokenizer or c.tokenizer
    greedy = reference_logprobs = None
    if c.algorithm.needs_greedy:
        def greedy(prompts):
            with context():
                return sample(model, tokenizer, prompts, 1, config.max_new_tokens, greedy=True)
    if reference is not None:
        def reference_logprobs(rollout):
            if reference is c.reference:  # offloaded: shared with the trainer, in the process only while in use
                with c.reference_in_use() as model:
                    return no_grad_forward(c, model, rollout, token_logprobs, temperature=config.temperature)
            return no_grad_forward(c, reference, rollout, token_logprobs, temperature=config.temperature)
    return RolloutSource(c.train_prompts, c.task.train, config.seed, config.prompts_per_step, config.group_size,
                         lambda picks: world.share(picks, config.ppo_mini_batches), sampler, c.reward, greedy,
                         reference_logprobs, config.max_refills if config.dynamic_sampling else None,
                         c.tokenizer.pad_token_id or 0,
                         None if c.episodes is None else dataclasses.replace(c.episodes, generate=sampler.generate_ids))


def start_rollouts(c: Components, state: LoopState, saved: list[Drawn] = (), cpus: set[int] | None = None,
                   side: tuple[dict, dict] | None = None):
    """The rollout side of a run at its current step: synchronous, or in flight with a copy of the weights."""
    config = c.config
    if not config.max_staleness:
        c.rollouts = Synchronous(rollout_source(c, c.sampler, c.policy, c.sampling), state.rng, state.step)
        return c.rollouts
    # A frozen reference model (not LoRA's, which is the policy with its adapters off) is copied once: its
    # forward then runs on the rollout side, beside the trainer's, which has the stale batch's π_old to compute.
    # An offloaded reference is not copied (a copy would be ordinary memory again): both sides read its mapping.
    reference = None
    if c.reference is not None and not config.lora_r:
        reference = c.reference if c.offloaded_reference is not None else copy.deepcopy(c.reference)
    if c.engine.pushes_weights and config.in_flight_updates:  # a rollout server's continuous batch
        from auto_research.train.partial_flight import PartialInFlight  # noqa: PLC0415

        if not getattr(c.sampler, "partial", False):
            raise UserError(f"--in-flight-updates: the rollout server at {c.sampler.address} cannot decode partial "
                            "rollouts (it needs one rollout server, auto-research rollout-serve --engine builtin "
                            "or vllm, of this version or later, without --enable-lora)")
        # (a tokenizer of its own: see below)
        c.rollouts = PartialInFlight(rollout_source(c, c.sampler, None, c.autocast, reference), None,
                                     copy.deepcopy(c.tokenizer),
                                     sampling_settings(config), state.rng, config.max_staleness, config.steps,
                                     state.step, c.policy, config.recompute_kv_on_update, list(saved), cpus, side,
                                     remote=c.sampler, pool=config.in_flight_pool,
                                     checkpoint_every=config.checkpoint_every)
        return c.rollouts
    if c.engine.pushes_weights:  # a rollout server: its own weights, pushed version by version
        source = rollout_source(c, c.sampler, None, c.autocast, reference)
        if streams(c, source) and copies_fit(c.policy, config.max_staleness, c.sampler.log):
            c.rollouts = StreamedInFlight(source, state.rng, config.max_staleness, config.steps, state.step,
                                          c.policy, list(saved), cpus, c.sampler,
                                          reference_rows(config, config.prompts_per_step, config.group_size))
            return c.rollouts
        c.rollouts = InFlight(source, None, state.rng, config.max_staleness, config.steps, state.step, c.policy,
                              list(saved), cpus, c.sampler)
        return c.rollouts
    model = copy.deepcopy(c.policy).requires_grad_(False)
    # A tokenizer of its own: a fast tokenizer's padding is state of the tokenizer, so the trainer's evaluation
    # (padded batches) and the rollout thread's calls at the same time broke one another (seen: "Unable to create
    # tensor" in a held-out evaluation).
    tokenizer = copy.deepcopy(c.tokenizer)
    if config.in_flight_updates:
        from auto_research.train.partial_flight import PartialInFlight  # noqa: PLC0415

        c.rollouts = PartialInFlight(rollout_source(c, None, model, c.autocast, reference, tokenizer), model.eval(),
                                     tokenizer,
                                     sampling_settings(config), state.rng, config.max_staleness, config.steps,
                                     state.step, c.policy, config.recompute_kv_on_update, list(saved), cpus, side,
                                     c.autocast, pool=config.in_flight_pool,
                                     checkpoint_every=config.checkpoint_every)
        return c.rollouts
    sampler = BuiltinSampler(model, tokenizer, sampling_settings(config), chunk_prompts(config), c.autocast)
    c.rollouts = InFlight(rollout_source(c, sampler, model, c.autocast, reference, tokenizer), model, state.rng,
                          config.max_staleness, config.steps, state.step, c.policy, list(saved), cpus)
    return c.rollouts
