"""Which rollout side a run gets, built once when the run opens (or resumes): a table keyed by what the settings
and the engine declare, not a chain of conditions.

    (in flight, in-flight updates, streams, pushes weights)   the side
    (no,  no,  no,  either)                                    Synchronous: sample, then train
    (yes, no,  no,  no)                                        InFlight: the engine on a copy of the policy
    (yes, no,  no,  yes)                                       InFlight over an engine holding pushed weights
    (yes, no,  yes, yes)                                       StreamedInFlight: a fleet drawing across batches
    (yes, yes, no,  no)                                        PartialInFlight, the engine's pool in this process
    (yes, yes, no,  yes)                                       PartialInFlight, rounds in a rollout server (each
                                                               server of a fleet: rounds of its own)

"Streams": the engine draws across batches (``Sampler.streams``, a fleet of servers) in one process, each batch
drawn once (no multi-turn episodes, refills or greedy baseline, which draw again mid-batch), and its K + 2 copies of
the weights fit in memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable, NamedTuple

from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout.builtin import sample
from auto_research.train.components import Drawing, Models, RunContext, chunk_prompts, sampling_settings
from auto_research.train.experience import no_grad_forward
from auto_research.train.in_flight import InFlight, StreamedInFlight
from auto_research.train.rollouts import Drawn, RolloutSource
from auto_research.train.sides import RolloutSide, Schedule, Synchronous
from auto_research.train.state import LoopState
from auto_research.train.signals import OUTSIDE


class Layout(NamedTuple):
    in_flight: bool
    updates: bool
    streams: bool
    pushes_weights: bool


class Opening(NamedTuple):
    """What building a side takes: the run's three values, its loop state, the batches a checkpoint saved in flight
    and, with --in-flight-updates, the rest of the side it saved."""

    run: RunContext
    models: Models
    drawing: Drawing
    state: LoopState
    saved: list[Drawn]
    side: tuple[dict, dict] | None

    def source(self, sampler, model=None, tokenizer=None) -> RolloutSource:
        """A side in flight's source: a frozen reference model (not LoRA's, the policy with its adapters off) is
        copied once, and its forward runs on the rollout side beside the trainer's; an offloaded one is shared (a
        copy would be ordinary memory again)."""
        models, reference = self.models, None
        if models.reference is not None and not self.run.config.lora.lora_r:
            reference = (models.reference_in_use if models.offloaded_reference is not None else
                         lambda held=copy.deepcopy(models.reference): contextlib.nullcontext(held))
        return rollout_source(self.run, self.drawing, sampler, model, self.run.autocast, reference, tokenizer)

    def own_copies(self):
        """The policy's copy for a side in this process, and a tokenizer of its own: a fast tokenizer's padding
        is state of the tokenizer, so the trainer's evaluation and the rollout thread's calls at the same time
        broke one another (seen: "Unable to create tensor" in a held-out evaluation)."""
        return copy.deepcopy(self.models.policy).requires_grad_(False), copy.deepcopy(self.run.tokenizer)

    def side_of(self, kind, source, **given):
        schedule = Schedule(self.run.config.rollout.max_staleness, self.run.config.run.steps, self.state.step)
        return kind(source, self.state.rng, schedule, self.models.policy, self.saved, **given)


def open_side(run: RunContext, models: Models, drawing: Drawing, state: LoopState, saved: list[Drawn] = (),
              side: tuple[dict, dict] | None = None) -> RolloutSide:
    """The run's rollout side at its current step (``saved``, ``side``: what a checkpoint held of it)."""
    rollout, in_flight, sampler = run.config.rollout, bool(run.config.rollout.max_staleness), drawing.sampler
    streamed = (in_flight and not rollout.in_flight_updates and streams(run, drawing)
                and copies_fit(models.policy, rollout.max_staleness, sampler.log))
    layout = Layout(in_flight, rollout.in_flight_updates, streamed, in_flight and run.engine.pushes_weights)
    return SIDES[layout](Opening(run, models, drawing, state, list(saved), side))


def _local_in_flight(o: Opening) -> InFlight:
    model, tokenizer = o.own_copies()
    config = o.run.config
    sampler = o.run.engine.over_model(model, tokenizer, sampling_settings(config.sampling),
                                      chunk_prompts(config.sampling, config.optimisation), o.run.autocast)
    return o.side_of(InFlight, o.source(sampler, model, tokenizer), model=model)


def _streamed(o: Opening) -> StreamedInFlight:
    sampling, fleet = o.run.config.sampling, o.drawing.sampler
    return o.side_of(StreamedInFlight, o.source(fleet), fleet=fleet, reference_rows=reference_rows(
        o.run.config.optimisation, sampling.prompts_per_step, sampling.group_size))


def _partial(o: Opening, local: bool):
    from auto_research.train.partial_flight import LocalRounds, PartialInFlight, remote_rounds  # noqa: PLC0415

    config, sampler, rollout = o.run.config, o.drawing.sampler, o.run.config.rollout
    settings = sampling_settings(config.sampling)
    if local:
        model, tokenizer = o.own_copies()
        source = o.source(None, model, tokenizer)
        rounds = LocalRounds(model.eval(), o.run.engine.pool(model, tokenizer, source.group_size, settings),
                             rollout.recompute_kv_on_update, o.run.autocast)
    else:
        source, tokenizer = o.source(sampler), copy.deepcopy(o.run.tokenizer)
        rounds = remote_rounds(sampler, source, settings, rollout.recompute_kv_on_update)
    return o.side_of(PartialInFlight, source, engine=rounds, tokenizer=tokenizer, remote=None if local else sampler,
                     state=o.side, pool=rollout.in_flight_pool, checkpoint_every=config.run.checkpoint_every)


REFERENCE_PARTS = 4
"""A streamed batch's reference log-probs come in (at most) this many parts of whole groups, as their rows are
drawn, unless --micro-batch-size sets the parts (the trainer's own micro-batches)."""


def reference_rows(optimisation, prompts: int, group_size: int) -> int | None:
    """Rows a part of a streamed batch's reference log-probs: the trainer's micro-batch when it is a number of
    rows, else the whole groups of a REFERENCE_PARTS-th of the batch's prompts (a group in one forward shares its
    prompt's pass, ``packing.grouped_rows``). None (the whole batch, once drawn) when micro-batches are cut by
    tokens, which depends on every row's length, and with --offload-reference, whose weights come back for each
    pass. ``optimisation``: the run's section."""
    if optimisation.max_tokens_per_micro_batch is not None or optimisation.offload_reference:
        return None
    return optimisation.micro_batch_size or -(-prompts // REFERENCE_PARTS) * group_size


def streams(run: RunContext, drawing: Drawing) -> bool:
    """Whether a run's batches can be drawn across batches (``StreamedInFlight``): an engine that streams (a fleet
    of servers), one process, one draw per batch (no multi-turn episodes, refills or greedy baseline, which draw
    again mid-batch)."""
    return (drawing.sampler.streams and not run.world.distributed and drawing.episodes is None
            and not run.config.sampling.dynamic_sampling and not run.algorithm.needs_greedy)


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


def rollout_source(run: RunContext, drawing: Drawing, sampler, model, context, reference=None, tokenizer=None):
    """What the rollout side needs of a run; ``reference``: what yields a frozen reference (a copy, or the offloaded
    one, shared), whose log-probs it then computes (in the micro-batches the trainer would use, so the numbers are
    the trainer's); ``tokenizer``: the rollout side's own (default: the trainer's)."""
    sampling, world, episodes = run.config.sampling, run.world, drawing.episodes
    tokenizer = tokenizer or run.tokenizer
    greedy = reference_logprobs = None
    if run.algorithm.needs_greedy:
        def greedy(prompts):
            with context():
                return sample(model, tokenizer, prompts, 1, sampling.max_new_tokens, greedy=True)
    if reference is not None:
        def reference_logprobs(rollout):
            with reference() as held:
                return no_grad_forward(run, held, rollout, token_logprobs, temperature=sampling.temperature)
    scorers = {name: (lambda rollout, examples, held=held, score=OUTSIDE[name].score: score(run, held, rollout,
                                                                                          examples))
               for name, held in drawing.outside.items()}
    return RolloutSource(drawing.train_prompts, run.task.train, run.config.run.seed, sampling.prompts_per_step,
                         sampling.group_size, lambda picks: world.share(picks, run.config.loss.ppo_mini_batches),
                         sampler, drawing.reward, greedy,
                         reference_logprobs, sampling.max_refills if sampling.dynamic_sampling else None,
                         run.tokenizer.pad_token_id or 0,
                         None if episodes is None else dataclasses.replace(episodes, generate=sampler.generate_ids),
                         scorers)


SIDES: dict[Layout, Callable[[Opening], RolloutSide]] = {
    Layout(False, False, False, False): lambda o: Synchronous(rollout_source(
        o.run, o.drawing, o.drawing.sampler, o.models.policy, o.run.sampling(o.models.policy)), o.state.rng),
    Layout(True, False, False, False): _local_in_flight,
    Layout(True, False, False, True): lambda o: o.side_of(InFlight, o.source(o.drawing.sampler),
                                                          remote=o.drawing.sampler),
    Layout(True, False, True, True): _streamed,
    Layout(True, True, False, False): lambda o: _partial(o, local=True),
    Layout(True, True, False, True): lambda o: _partial(o, local=False),
}
"""Every layout a run can have (the settings' checks refuse the others, ``config/rollout.py``)."""
