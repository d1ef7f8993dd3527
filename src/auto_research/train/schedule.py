"""Which rollout side a run gets, built once when the run opens (or resumes): a table keyed by what the settings
and the engine declare, not a chain of conditions.

    (in flight, in-flight updates, streams, pushes weights)   the side
    (no,  no,  no,  either)                                    Synchronous: sample, then train
    (yes, no,  no,  no)                                        InFlight with a copy of the policy
    (yes, no,  no,  yes)                                       InFlight over an engine holding pushed weights
    (yes, no,  yes, yes)                                       StreamedInFlight: a fleet drawing across batches
    (yes, yes, no,  no)                                        PartialInFlight, rounds in this process
    (yes, yes, no,  yes)                                       PartialInFlight, rounds in a rollout server

"Streams": the engine draws across batches (``Sampler.streams``, a fleet of servers) in one process, each batch
drawn once (no multi-turn episodes, refills or greedy baseline, which draw again mid-batch), and its K + 2 copies of
the weights fit in memory.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, NamedTuple

from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout.builtin import BuiltinSampler, sample
from auto_research.errors import UserError
from auto_research.train.components import Components, chunk_prompts, sampling_settings
from auto_research.train.experience import no_grad_forward
from auto_research.train.in_flight import InFlight, StreamedInFlight
from auto_research.train.rollouts import Drawn, RolloutSource
from auto_research.train.sides import RolloutSide, Schedule, Synchronous
from auto_research.train.state import LoopState


class Layout(NamedTuple):
    in_flight: bool
    updates: bool
    streams: bool
    pushes_weights: bool


class Opening(NamedTuple):
    """What building a side takes: the run, its loop state, the batches a checkpoint saved in flight and, with
    --in-flight-updates, the rest of the side it saved."""

    c: Components
    state: LoopState
    saved: list[Drawn]
    side: tuple[dict, dict] | None

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.c.config.max_staleness, self.c.config.steps, self.state.step)


def open_side(c: Components, state: LoopState, saved: list[Drawn] = (), side: tuple[dict, dict] | None = None
              ) -> RolloutSide:
    """The run's rollout side at its current step (``saved``, ``side``: what a checkpoint held of it)."""
    config = c.config
    opening = Opening(c, state, list(saved), side)
    in_flight = bool(config.max_staleness)
    streamed = (in_flight and not config.in_flight_updates and streams(c)
                and copies_fit(c.policy, config.max_staleness, c.sampler.log))
    layout = Layout(in_flight, config.in_flight_updates, streamed, in_flight and c.engine.pushes_weights)
    return SIDES[layout](opening)


def _synchronous(o: Opening) -> Synchronous:
    return Synchronous(rollout_source(o.c, o.c.sampler, o.c.policy, o.c.sampling), o.state.rng)


def _frozen_reference(c: Components):
    """A frozen reference model (not LoRA's, which is the policy with its adapters off) is copied once: its
    forward then runs on the rollout side, beside the trainer's, which has the stale batch's π_old to compute.
    An offloaded reference is not copied (a copy would be ordinary memory again): both sides read its mapping."""
    if c.reference is None or c.config.lora_r:
        return None
    return c.reference if c.offloaded_reference is not None else copy.deepcopy(c.reference)


def _own_copies(c: Components):
    """The policy's copy for a side in this process, and a tokenizer of its own: a fast tokenizer's padding is
    state of the tokenizer, so the trainer's evaluation (padded batches) and the rollout thread's calls at the
    same time broke one another (seen: "Unable to create tensor" in a held-out evaluation)."""
    return copy.deepcopy(c.policy).requires_grad_(False), copy.deepcopy(c.tokenizer)


def _local_in_flight(o: Opening) -> InFlight:
    c = o.c
    model, tokenizer = _own_copies(c)
    sampler = BuiltinSampler(model, tokenizer, sampling_settings(c.config), chunk_prompts(c.config), c.autocast)
    source = rollout_source(c, sampler, model, c.autocast, _frozen_reference(c), tokenizer)
    return InFlight(source, o.state.rng, o.schedule, c.policy, o.saved, model=model)


def _remote_in_flight(o: Opening) -> InFlight:
    source = rollout_source(o.c, o.c.sampler, None, o.c.autocast, _frozen_reference(o.c))
    return InFlight(source, o.state.rng, o.schedule, o.c.policy, o.saved, remote=o.c.sampler)


def _streamed(o: Opening) -> StreamedInFlight:
    c, config = o.c, o.c.config
    source = rollout_source(c, c.sampler, None, c.autocast, _frozen_reference(c))
    return StreamedInFlight(source, o.state.rng, o.schedule, c.policy, o.saved, c.sampler,
                            reference_rows(config, config.prompts_per_step, config.group_size))


def _partial(o: Opening, source: RolloutSource, engine, tokenizer, remote=None):
    from auto_research.train.partial_flight import PartialInFlight  # noqa: PLC0415

    return PartialInFlight(source, o.state.rng, o.schedule, o.c.policy, o.saved, engine=engine, tokenizer=tokenizer,
                           remote=remote, state=o.side, pool=o.c.config.in_flight_pool,
                           checkpoint_every=o.c.config.checkpoint_every)


def _local_partial(o: Opening):
    from auto_research.train.partial_flight import LocalRounds  # noqa: PLC0415

    c, config = o.c, o.c.config
    model, tokenizer = _own_copies(c)
    source = rollout_source(c, None, model, c.autocast, _frozen_reference(c), tokenizer)
    rounds = LocalRounds(model.eval(), tokenizer, source, sampling_settings(config), config.recompute_kv_on_update,
                         c.autocast)
    return _partial(o, source, rounds, tokenizer)


def _remote_partial(o: Opening):
    from auto_research.train.partial_flight import RemoteRounds  # noqa: PLC0415

    c, config = o.c, o.c.config
    if not c.sampler.partial:
        raise UserError(f"--in-flight-updates: the rollout server at {c.sampler.address} cannot decode partial "
                        "rollouts (it needs one rollout server, auto-research rollout-serve --engine builtin "
                        "or vllm, of this version or later, without --enable-lora)")
    source = rollout_source(c, c.sampler, None, c.autocast, _frozen_reference(c))
    rounds = RemoteRounds(c.sampler, source, sampling_settings(config), config.recompute_kv_on_update)
    return _partial(o, source, rounds, copy.deepcopy(c.tokenizer), c.sampler)


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


def streams(c: Components) -> bool:
    """Whether a run's batches can be drawn across batches (``StreamedInFlight``): an engine that streams (a fleet
    of servers), one process, one draw per batch (no multi-turn episodes, refills or greedy baseline, which draw
    again mid-batch)."""
    return (c.sampler.streams and not c.world.distributed and c.episodes is None and not c.config.dynamic_sampling
            and not c.algorithm.needs_greedy)


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


SIDES: dict[Layout, Callable[[Opening], RolloutSide]] = {
    Layout(False, False, False, False): _synchronous,
    Layout(True, False, False, False): _local_in_flight,
    Layout(True, False, False, True): _remote_in_flight,
    Layout(True, False, True, True): _streamed,
    Layout(True, True, False, False): _local_partial,
    Layout(True, True, False, True): _remote_partial,
}
"""Every layout a run can have (the settings' checks refuse the others, ``config/rollout.py``)."""
