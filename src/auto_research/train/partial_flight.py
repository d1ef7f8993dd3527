"""Weights updated in flight, and partial rollouts (--in-flight-updates, with --max-staleness K ≥ 1; docs/async.md).

The rollout side keeps a continuous batch of groups (``engine/rollout/partial.Rounds``) and makes one step's batch a
*round*, from a thread of its own: in this process (``LocalRounds``, over a copy of the policy), in a rollout server
(``RemoteRounds``, ``partial_serve.py``) or in each server of a fleet (``FleetRounds``). Round r decodes with the
weights of version max(0, r − 2), taken between two decode steps, until P groups are done; a group still decoding
goes on in the next round under the next weights. "Due" is counted in decode steps and every round waits for its
version, so one seed gives one schedule. Before round r, a group holding a token older than (r − 1) − K goes back
to the queue, to be drawn again from its first token; such a token is never trained on. Each token carries the
version that drew it and μ's log-prob under it (``experience.build_experience`` corrects by π_old / μ_version).

A checkpoint after step s saves the batch of step s + 1 and the rounds as round s + 1 left them (the groups decoding
with their KV caches; on vLLM they are drawn again, by the uninterrupted run too: ``settle``), so SIGKILL and
--resume end with the uninterrupted run's rows.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from auto_research.engine.rollout import Rollout, eos_ids
from auto_research.engine.partial_bounds import pool_groups
from auto_research.engine.rollout.fleet import Fleet, each_server
from auto_research.engine.rollout.partial import Rounds, lanes_to_rows, supply_target
from auto_research.engine.rollout.partial_files import Finished
from auto_research.engine.rollout.partial_serve import KEPT_STATES
from auto_research.train.rollouts import Drawn, RolloutSource, batch_of, draw_batch, finish
from auto_research.train.sides import Handover, Schedule
from auto_research.errors import RolloutEngineError, UserError


class LocalRounds:
    """The rounds in the trainer's process: the engine's ``pool`` over a copy of the policy (``model``), loaded with
    each version's snapshot, decoding under the trainer's autocast (``context``)."""

    def __init__(self, model, pool, recompute_kv: bool, context):
        self.model, self.recompute_kv, self.context = model, recompute_kv, context
        self.rounds = Rounds(pool)
        self.loaded: int | None = None
        self.states: dict[int, tuple[dict, dict]] = {}

    def load(self, version: int, snapshot) -> None:
        if self.loaded != version:
            self.model.load_state_dict(snapshot)
            self.loaded = version

    def run(self, number: int, version: int, per_step: int, pool_groups: int, oldest_allowed: int,
            supply: list, settle: bool) -> tuple:
        """Round ``number``'s lanes, the groups put back so far and the queue's length after it."""
        self.rounds.supply(supply)
        with self.context():
            lanes = self.rounds.run(version, per_step, oldest_allowed, self.recompute_kv, pool_groups, settle)
        self.states[number] = self.rounds.to_files()
        for older in [n for n in list(self.states) if n <= number - KEPT_STATES]:  # a checkpoint reads no older one
            del self.states[older]
        return lanes, self.rounds.requeued, len(self.rounds.pending)

    def state(self, number: int) -> tuple[dict, dict]:
        for older in [n for n in list(self.states) if n < number]:  # (the producer adds to it meanwhile)
            del self.states[older]
        return self.states.get(number, ({}, {}))

    def restore(self, tensors: dict, plain: dict) -> None:
        self.rounds.restore(tensors, plain)


class RemoteRounds:
    """The rounds in a rollout server (``partial_serve.py``), which holds the continuous batch and the
    weights this run pushed (``sampler``: the run's ``ServerSampler``)."""

    def __init__(self, sampler, source: RolloutSource, settings, recompute_kv: bool):
        self.sampler = sampler
        self.fixed = {"group_size": source.group_size, "recompute_kv": recompute_kv,
                      "settings": {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                                   "top_p": settings.top_p, "top_k": settings.top_k}}

    def load(self, version: int, snapshot) -> None:
        """Nothing: the trainer pushed ``version`` before the producer was let through (``PartialInFlight._push``)."""

    def run(self, number: int, version: int, per_step: int, pool_groups: int, oldest_allowed: int,
            supply: list, settle: bool) -> tuple:
        optional = {**({"pool_groups": pool_groups} if pool_groups != per_step else {}),  # (an older server takes
                    **({"settle": True} if settle else {})}  # the rounds without them)
        answer = self.sampler.partial_round({
            **self.fixed, "round": number, "version": version, "per_step": per_step, "oldest_allowed": oldest_allowed,
            **optional, "supply": [[list(key), ids, seed] for key, ids, seed in supply]})
        lanes = [Finished(tuple(lane["key"]), lane["order"], lane["prompt_ids"],
                          torch.tensor(lane["tokens"], dtype=torch.long), torch.tensor(lane["logprobs"]),
                          None if lane["entropies"] is None else torch.tensor(lane["entropies"]),
                          torch.tensor(lane["versions"], dtype=torch.long))
                 for lane in answer["lanes"]]
        return lanes, answer["requeued"], answer["pending"]

    def state(self, number: int) -> tuple[dict, dict]:
        """Rank 0's copy alone (it alone restores it): the other ranks save their own plain values only. Every rank
        learns whether rank 0 got it (the others would wait for it in the checkpoint's gather)."""
        world, state, error = self.sampler.world, ({}, {}), None
        if world.main:
            try:
                state = self.sampler.partial_state(number)
            except Exception as failed:  # noqa: BLE001 - agreed: every rank stops with its line
                error = failed
        world.agree(error, RolloutEngineError)
        return state

    def restore(self, tensors: dict, plain: dict) -> None:
        """Rank 0 puts the state back (every rank saved the same); no rank sends a round before it is in."""
        world = self.sampler.world
        error = None
        if world.main:
            try:
                self.sampler.partial_restore(tensors, plain)
            except Exception as failed:  # noqa: BLE001 - agreed: every rank stops with its line
                error = failed
        world.agree(error, RolloutEngineError)


class FleetRounds:
    """The rounds over several rollout servers (``--rollout-server A,B,…``): each server holds a continuous batch of
    its own. Server i decodes P_i of the step's P groups (P split in the servers' order, the pool likewise), and the
    step's batch is their lanes in that order. The run's queue is dealt to the servers by need (each is kept at its
    own ``supply_target``), so which groups a server decodes depends on the seeds and the rounds alone, never on
    which server answers first. A server that leaves the pool takes its groups decoding with it: the run stops."""

    def __init__(self, fleet, members: list[RemoteRounds]):
        self.fleet, self.members = fleet, members
        self.addresses = list(fleet.members)
        self.clients = [member.sampler for member in members]
        self.pendings = [0] * len(members)
        """Each server's queue (groups) after the last round."""
        self.after: dict[int, list[int]] = {}
        """Each server's queue after round n, until a checkpoint no longer reads it."""

    def load(self, version: int, snapshot) -> None:
        """Nothing: the trainer pushed ``version`` to every server (``Fleet.load_weights``)."""

    def run(self, number: int, version: int, per_step: int, pool_groups: int, oldest_allowed: int,
            supply: list, settle: bool) -> tuple:
        for address, client in zip(self.addresses, self.clients):
            if self.fleet.members.get(address) is not client:
                why = self.fleet.left.get(address, ("it was replaced",))[0]
                raise RolloutEngineError(f"--in-flight-updates: rollout server {address} left the pool ({why}); the "
                                         "groups it was decoding live on it alone")
        n = min(len(self.members), per_step)  # (a server beyond the step's groups would decode none)
        shares, pools = _split(per_step, n), _split(pool_groups, n)
        targets = [supply_target(p, g) for p, g in zip(shares, pools)]
        dealt = self._deal(supply, targets)
        answered: dict[int, tuple] = {}
        failures = each_server({address: (lambda i=i: answered.__setitem__(i, self.members[i].run(
            number, version, shares[i], pools[i], oldest_allowed, dealt[i], settle)))
            for i, address in enumerate(self.addresses[:n])}, concurrently=True)
        if failures:  # the first server's, in their order
            raise RolloutEngineError(next(failures[address] for address in self.addresses if address in failures))
        answers = [answered[i] for i in range(n)]
        self.pendings = [pending for _, _, pending in answers]
        self.after[number] = list(self.pendings)
        for older in [kept for kept in self.after if kept <= number - KEPT_STATES]:
            del self.after[older]
        lanes = [lane for answer in answers for lane in answer[0]]
        return lanes, sum(answer[1] for answer in answers), sum(map(min, self.pendings, targets))

    def _deal(self, supply: list, targets: list[int]) -> list[list]:
        """Each server tops its queue up to its target, in the servers' order; what is left goes, one group at a
        time, to the server furthest below its target (the first of equals)."""
        dealt, supply = [[] for _ in targets], list(supply)
        for i, target in enumerate(targets):
            need = max(0, target - self.pendings[i])
            dealt[i], supply = supply[:need], supply[need:]
        for group in supply:
            i = min(range(len(targets)), key=lambda j: self.pendings[j] + len(dealt[j]) - targets[j])
            dealt[i].append(group)
        return dealt

    def state(self, number: int) -> tuple[dict, dict]:
        states = [member.state(number) for member in self.members]
        tensors = {f"server{i}/{name}": tensor for i, (part, _) in enumerate(states) for name, tensor in part.items()}
        return tensors, {"servers": [plain for _, plain in states], "pendings": self.after.get(number)}

    def restore(self, tensors: dict, plain: dict) -> None:
        """(The run's settings hold the servers' addresses: a resume over others is refused before this.)"""
        for i, (member, part) in enumerate(zip(self.members, plain["servers"])):
            prefix = f"server{i}/"
            member.restore({name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}, part)
        self.pendings = list(plain["pendings"])


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` shares, the first ones a unit larger (7 in 3: 3, 2, 2)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def remote_rounds(sampler, source: RolloutSource, settings, recompute_kv: bool):
    """The rounds in one rollout server (``RemoteRounds``), or in each of a fleet's (``FleetRounds``)."""
    clients = list(sampler.members.values()) if isinstance(sampler, Fleet) else [sampler]
    for client in clients:
        if not client.partial:
            raise UserError(f"--in-flight-updates: the rollout server at {client.address} cannot decode partial "
                            "rollouts (it needs auto-research rollout-serve --engine builtin or vllm, of this "
                            "version or later, without --enable-lora)")
    members = [RemoteRounds(client, source, settings, recompute_kv) for client in clients]
    return FleetRounds(sampler, members) if isinstance(sampler, Fleet) else members[0]


class PartialInFlight(Handover):
    """The rollout side of --in-flight-updates: ``take``, ``checkpoint`` (the batch of the next step) and ``close``
    are ``Handover``'s; ``state``, the rest of the rollout side for a checkpoint. The rounds run in this process
    (``LocalRounds``: a copy of the policy) or in a rollout server (``RemoteRounds``, whose client is ``remote``).
    ``pool``: --in-flight-pool; ``checkpoint_every``: --checkpoint-every (the rounds a checkpoint reads)."""

    depth = 1
    carries_state = True
    name = "auto-research-partial-rollouts"

    def __init__(self, source: RolloutSource, rng, schedule: Schedule, policy, saved: list[Drawn] = (), *, engine,
                 tokenizer, remote=None, state: tuple[dict, dict] | None = None, pool: float = 1.0,
                 checkpoint_every: int = 0):
        super().__init__(source, rng, schedule, policy, saved, remote)
        self.engine, self.tokenizer, self.pool, self.checkpoint_every = engine, tokenizer, pool, checkpoint_every
        self.max_staleness = schedule.max_staleness
        self.whole = dataclasses.replace(source, share=list)
        """The source unshared: a round holds every rank's groups (one continuous batch, in a rollout server under
        torchrun), and each rank takes its slice of the groups it finished."""
        self.eos = eos_ids(tokenizer, policy)
        self.draws = self.first_step - 1  # a resumed run draws new prompt seeds, not the first run's again
        self.per_step: int | None = None
        self.pending = 0
        """Groups in the engine's queue after the last round."""
        self.requeued = 0
        self.counts: dict[int, dict] = {}
        """This side's own plain values after each round (``_state``), until a checkpoint no longer needs them."""
        if state is not None and state[1]:
            self._restore(*state)

    def state(self, step: int) -> tuple[dict, dict]:
        """The rollout side as the round of step + 1 left it (``checkpoint`` waited for that round)."""
        last = min(step + self.depth, self.last_step)
        with self.condition:
            for older in [s for s in self.counts if s < last]:
                del self.counts[older]
            counts = self.counts.get(last)
        if counts is None:
            return {}, {}
        tensors, plain = self.engine.state(last)
        return tensors, {**plain, **counts}

    def _restore(self, tensors: dict, plain: dict) -> None:
        self.engine.restore(tensors, plain)
        self.draws, self.per_step, self.requeued = plain["draws"], plain["per_step"], plain["requeued"]
        self.pending = plain["pending_count"]

    # --- the producer's side ------------------------------------------------------------------------------------

    def _draw(self, step: int, version: int, snapshot, idle: float) -> Drawn:
        self.engine.load(version, snapshot)
        return self._round(step, version, idle)

    def _hand_over(self, step: int, drawn: Drawn) -> None:
        with self.condition:  # before the batch: ``checkpoint`` waits for the batch, then reads them
            self.counts[step] = {"draws": self.draws, "per_step": self.per_step, "requeued": self.requeued,
                                 "pending_count": self.pending}
            super()._hand_over(step, drawn)

    def _round(self, step: int, version: int, idle: float) -> Drawn:
        """Step ``step``'s batch: the queue topped up, then the engine's round (stale groups back in its queue,
        decode steps until P groups are done), scored here."""
        started = time.perf_counter()
        supply = self._supply()
        lanes, self.requeued, self.pending = self.engine.run(
            step, version, self.per_step, self.pool_groups, (step - 1) - self.max_staleness, supply,
            self._read_by_a_checkpoint(step))
        lanes = self.source.share(lanes)  # this rank's slice of the step's groups, in the order they finished
        return self._drawn(step, version, lanes, idle, time.perf_counter() - started)

    def _read_by_a_checkpoint(self, step: int) -> bool:
        """Whether a checkpoint reads round ``step``'s state: the one after step s reads round min(s + 1, the last)
        (``state``), and one is made every --checkpoint-every steps and at the last."""
        every, before = self.checkpoint_every, step - self.depth
        return step == self.last_step or bool(every and before >= 1 and before % every == 0)

    @property
    def pool_groups(self) -> int:
        """The groups decoding at once (--in-flight-pool F: F · P, rounded up)."""
        return pool_groups(self.pool, self.per_step)

    def _supply(self) -> list:
        """New groups for the engine's queue (key, prompt ids, seed), drawn a step's worth at a time from the run's
        generator and seed, until it holds ``SUPPLY_ROUNDS`` steps' worth and the pool's extra groups: a round never
        runs dry."""
        supply = []
        while self.per_step is None or self.pending + len(supply) < supply_target(self.per_step, self.pool_groups):
            self.draws += 1
            batch = draw_batch(self.whole, self.rng, self.draws)  # every rank's prompts: one queue for the run
            self.per_step = self.per_step or len(batch.indices)
            for index, seed in zip(batch.indices, batch.seeds):
                ids = self.tokenizer(self.source.prompts[index], add_special_tokens=False)["input_ids"]
                supply.append(((int(index), int(seed)), ids, int(seed)))
        return supply

    def _drawn(self, step: int, version: int, lanes: list[Finished], idle: float, sample_seconds: float) -> Drawn:
        source, K = self.source, self.source.group_size
        prompt, prompt_mask, tokens, mask, logprobs, entropies, versions = lanes_to_rows(
            lanes, source.pad_token_id, self.eos)
        texts = self.tokenizer.batch_decode(tokens * mask + source.pad_token_id * (1 - mask), skip_special_tokens=True)
        oldest = versions.masked_fill(versions < 0, 1 << 62).amin(1)
        rollout = Rollout(torch.cat([prompt, tokens], dim=1), prompt_mask, mask, texts, K, logprobs, entropies,
                          False, oldest, token_versions=versions)
        indices, seeds = [lane.key[0] for lane in lanes], [lane.key[1] for lane in lanes]
        return finish(source, step, version, batch_of(source, indices, seeds), rollout, self.rng.bit_generator.state,
                      {"sample": sample_seconds, "idle": idle})
