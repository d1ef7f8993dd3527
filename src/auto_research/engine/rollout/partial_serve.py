"""Partial rollouts in a rollout server (--in-flight-updates with --rollout-mode server or process; docs/async.md):
the continuous batch (the builtin engine's ``partial.Rounds`` over a ``Pool``, or vLLM's ``vllm_partial.VLLMRounds``)
lives in the server, and the lease holder drives it a round at a time. Weights are pushed between rounds as ever, so a new version reaches the rows in
flight between two of their decode steps, their KV cache kept or recomputed.

- ``POST /partial/round`` with the lease and ``{"round", "version", "weights_version", "per_step", "oldest_allowed",
  "recompute_kv", "group_size", "settings", "supply"}`` and optionally ``"pool_groups"`` (the groups decoding at once:
  ``per_step`` to ``MAX_IN_FLIGHT_POOL`` · ``per_step``, default ``per_step``) and ``"settle"`` (a checkpoint will
  read this round: ``partial.Rounds.run``): ``supply`` is ``[[[index, seed], prompt ids, seed], ...]``, appended to
  the queue of groups to draw (the trainer keeps it at three steps' worth); ``version`` names, in the trainer's
  numbering, the weights the server holds (``weights_version``, its own push count, must match them). The server puts
  back the groups holding a token older than ``oldest_allowed``, decodes until ``per_step`` groups are done →
  ``{"lanes": [{"key", "order", "prompt_ids", "tokens", "logprobs", "entropies", "versions"}], "requeued", "pending",
  "weights_version", "instance"}``. Rounds come in order (``round`` is the last one's + 1, else 409). Under torchrun
  every rank sends each round (the same request: the whole step's groups): the first runs it, the others get its
  answer, and each rank trains its own slice of the groups. A round sent again with another request is a 409.
- ``POST /partial/state`` with the lease and ``{"round"}`` → the state as that round left it (kept for the last
  ``KEPT_STATES`` rounds): a safetensors body, its plain values as JSON in the metadata's ``"plain"``. A
  checkpoint saves it; ``POST /partial/restore`` with the lease and that body puts it back for ``--resume``.

The state belongs to the lease that made it, and goes when the lease is released or lapses (vLLM's requests
aborted): another lease (a new run, or the same run resumed with its secret) starts from an empty one, at any
round, or from what it restores. While a vLLM engine holds a session's requests, other clients' ``/generate`` is a
409 (vLLM's ``generate`` would step them to their end), checked in the engine's turn. A round the engine fails
is a 500, and the session's rounds are given up: that round sent again, or a later one, is a 409 naming the failure
(a run resumes from its checkpoint; a round 1 starts afresh).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import safetensors.torch

from auto_research.engine.rollout.guard import MAX_PROMPTS, Refused, check_generate
from auto_research.engine.rollout.partial import SUPPLY_ROUNDS, builtin_rounds, supply_target
from auto_research.engine.partial_bounds import MAX_IN_FLIGHT_POOL
from auto_research.errors import one_line

KEPT_STATES = 3
"""Rounds whose state the server keeps: a checkpoint after step s reads round s + 1's, and round s + 2 may have run."""
STATE_BYTES = 2**31
"""The bound on a restored state's body (the pool's KV cache and its rows)."""
ROUND_FIELDS = ("round", "version", "weights_version", "per_step", "oldest_allowed", "recompute_kv", "group_size",
                "settings", "supply")
OPTIONAL_FIELDS = ("pool_groups", "settle")

@dataclass
class Session:
    """One lease's rounds: its settings (fixed by its first round, or by what it restored), the rounds, and the
    state after each of the last rounds."""

    lease: str
    config: dict
    rounds: object
    last_round: int = 0
    states: dict = field(default_factory=dict)
    answers: dict = field(default_factory=dict)
    """Each kept round's request (a hash) and answer: under torchrun every rank sends the round, the first runs
    it, the others get its answer."""
    failed: str | None = None
    """Why a round failed in the engine, which then gave up the rounds: a retry of that round, or any later one,
    is a 409 naming it (rather than a round that would find half of what the failed one did)."""


def _integer(value, name: str, low: int, high: int = 2**62) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"{name} must be an integer in {low}..{high}, got {str(value)[:40]}")
    return value


def close(serving) -> None:
    """The server's partial rollouts given up (vLLM's requests aborted): another lease's rounds, or none."""
    if serving.partial is not None:
        serving.partial.rounds.close()
        serving.partial = None


def prune(serving) -> None:
    """A session whose lease was released or lapsed goes, with what it held (every request calls this)."""
    session = serving.partial
    if session is not None and not serving.leases.holds(session.lease):
        with serving.turns.turn(first=True):
            if serving.partial is session:
                close(serving)


def blocks_generate(serving) -> bool:
    """vLLM's own ``generate`` steps every request in its engine to its end, partial rollouts' included: while a
    session has groups decoding on a vLLM engine, other clients' draws wait for a server without them."""
    session = serving.partial
    return session is not None and getattr(session.rounds.pool, "engine", None) is not None and bool(
        session.rounds.pool.lanes)


def _session(handler, token: str, config: dict, fresh: bool) -> Session:
    """The lease's session, made (or remade, from ``config``) when ``fresh`` or when it has none."""
    serving = handler.serving
    session = serving.partial
    if fresh or session is None or session.lease != token:
        engine = serving.sampler
        if not getattr(engine, "partial_rollouts", False):
            raise Refused(400, "this server's engine cannot decode partial rollouts (--in-flight-updates needs a "
                               "builtin or vLLM rollout server of this version or later, without --enable-lora)")
        _, group_size, _, settings = check_generate(
            {"prompt_ids": [[0]], "group_size": config["group_size"], "seeds": [0], "settings": config["settings"]},
            serving.served.vocab_size, engine.max_model_len, serving.limits.max_group_size)
        rounds = engine.rounds(group_size, settings) if hasattr(engine, "rounds") else builtin_rounds(
            engine, group_size, settings)
        close(serving)
        session = serving.partial = Session(token, config, rounds)
    elif session.failed is not None:
        raise Refused(409, f"round {session.last_round + 1} failed in this server's engine ({session.failed}): this "
                           "lease's partial rollouts are gone; --resume the run from its last checkpoint")
    elif session.config != config:
        raise Refused(400, f"this lease's rounds run with {json.dumps(session.config)}, not {json.dumps(config)}")
    return session


def partial_round(handler):
    """One round for the lease holder (see the module)."""
    serving = handler.serving
    token = handler.headers.get("X-Lease")
    serving.leases.check(token)
    body = handler._json(2**26)
    number, version, per_step, oldest, supply, config = _read_round(serving, body)
    asked = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with serving.turns.turn(first=True):
        session = serving.partial
        if session is not None and session.lease == token and number in session.answers:
            drawn_for, payload = session.answers[number]  # another rank's copy of the round (torchrun)
            if drawn_for != asked:
                raise Refused(409, f"round {number} was drawn already, for another request (every rank sends the "
                                   "same one)")
            return 200, payload
        if body["weights_version"] != serving.turns.version:
            raise Refused(409, f"the round names weights version {body['weights_version']}, but the server holds "
                               f"version {serving.turns.version}")
        session = _session(handler, token, config, fresh=number == 1)
        _check_queue(session, number, per_step, supply)
        try:  # (the state's copy too: the round's groups are out of the rounds by then)
            session.rounds.supply(supply)
            lanes = session.rounds.run(version, per_step, oldest, config["recompute_kv"], config["pool_groups"],
                                       body.get("settle", False))
            tensors, plain = session.rounds.to_files()
        except Exception as error:  # the engine's own failure (a 500): what the rounds hold is no longer known
            session.failed = one_line(error)[:300]
            session.rounds.close()
            raise
        session.last_round = number
        session.states[number] = (tensors, {**plain, "config": config, "round": number})
        payload = {"lanes": [{"key": list(lane.key), "order": lane.order, "prompt_ids": lane.prompt_ids,
                              "tokens": lane.tokens.tolist(), "logprobs": lane.logprobs.tolist(),
                              "entropies": None if lane.entropies is None else lane.entropies.tolist(),
                              "versions": lane.versions.tolist()}
                             for lane in lanes],
                   "requeued": session.rounds.requeued, "pending": len(session.rounds.pending),
                   "weights_version": serving.turns.version, "instance": serving.instance}
        session.answers[number] = (asked, payload)
        for kept in (session.states, session.answers):
            for older in [r for r in kept if r <= number - KEPT_STATES]:
                del kept[older]
    return 200, payload


def _read_round(serving, body) -> tuple:
    """A round's number, version, per_step, oldest version allowed, supply ((key, ids, seed) each) and the settings
    its lease's rounds keep; ``Refused`` naming the first field that is wrong."""
    if not isinstance(body, dict) or sorted(set(body) - set(OPTIONAL_FIELDS)) != sorted(ROUND_FIELDS):
        raise Refused(400, f"a round has the fields {', '.join(ROUND_FIELDS)} (and {', '.join(OPTIONAL_FIELDS)}, "
                           "optionally)")
    number = _integer(body["round"], "round", 1)
    version = _integer(body["version"], "version", 0)
    per_step = _integer(body["per_step"], "per_step", 1, MAX_PROMPTS)
    pool_groups = _integer(body.get("pool_groups", per_step), "pool_groups", per_step, MAX_IN_FLIGHT_POOL * per_step)
    oldest = _integer(body["oldest_allowed"], "oldest_allowed", -(2**62))
    supply, most = body["supply"], 4 * per_step + pool_groups - per_step
    if not isinstance(supply, list) or len(supply) > most:
        raise Refused(400, f"supply must be a list of at most {most} groups (four steps' worth, and the pool's extra "
                           "groups)")
    for index, item in enumerate(supply):
        if (not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], list) or len(item[0]) != 2
                or item[0][1] != item[2]):
            raise Refused(400, f"supply item {index} must be [[prompt index, seed], prompt ids, seed]")
        _integer(item[0][0], "a prompt index", 0)
    if not isinstance(body["recompute_kv"], bool) or not isinstance(body.get("settle", False), bool):
        raise Refused(400, "recompute_kv and settle must be true or false")
    prompts, group_size, _, settings = check_generate(
        {"prompt_ids": [item[1] for item in supply] or [[0]], "group_size": body["group_size"],
         "seeds": [item[2] for item in supply] or [0], "settings": body["settings"]},
        serving.served.vocab_size, serving.sampler.max_model_len, serving.limits.max_group_size)
    longest = max(map(len, prompts))
    if pool_groups * group_size * (longest + settings.max_new_tokens) > serving.limits.max_request_tokens:
        raise Refused(413, f"a round of {pool_groups} groups of {group_size} with prompts of {longest} tokens and "
                           f"{settings.max_new_tokens} new tokens is over the server's --max-request-tokens "
                           f"{serving.limits.max_request_tokens}")
    keys = [tuple(item[0]) for item in supply]
    if len(set(keys)) < len(keys):
        raise Refused(400, "supply holds a group twice (its [prompt index, seed])")
    config = {"group_size": group_size, "settings": body["settings"], "recompute_kv": body["recompute_kv"],
              "per_step": per_step, "pool_groups": pool_groups}
    return number, version, per_step, oldest, [(key, item[1], item[2]) for key, item in zip(keys, supply)], config


def _check_queue(session: Session, number: int, per_step: int, supply: list) -> None:
    """The round comes next, its groups are new to the session, and the queue will hold enough never to run dry."""
    if session.last_round and number != session.last_round + 1:  # a new session starts at any round
        raise Refused(409, f"round {number} after round {session.last_round}: rounds come one at a time, in order")
    held = set(session.rounds.keys()) & {key for key, _, _ in supply}
    if held:
        raise Refused(400, f"supply holds group {list(sorted(held)[0])}, which these rounds hold already")
    needed = supply_target(per_step, session.config["pool_groups"])
    if len(session.rounds.pending) + len(supply) < needed:
        raise Refused(400, f"the queue would hold {len(session.rounds.pending) + len(supply)} groups; a round needs "
                           f"{needed} ({SUPPLY_ROUNDS} steps' worth, and the pool's extra groups) so as never to run "
                           "dry")


def partial_state(handler):
    """The state after a round the server kept, as a safetensors body."""
    serving = handler.serving
    token = handler.headers.get("X-Lease")
    serving.leases.check(token)
    body = handler._json(2**16)
    number = _integer(body.get("round") if isinstance(body, dict) else None, "round", 1)
    with serving.turns.turn(first=True):  # (a round running drops the oldest state it kept)
        session = serving.partial
        if session is None or session.lease != token or number not in session.states:
            kept = sorted(session.states) if session is not None and session.lease == token else []
            raise Refused(404, f"no state of round {number} is kept for this lease (kept: {kept or 'none'})")
        tensors, plain = session.states[number]
    body = safetensors.torch.save(tensors, metadata={"plain": json.dumps(plain)})
    if len(body) > STATE_BYTES:  # refused now, at the checkpoint, rather than at --resume
        raise Refused(413, f"the state of round {number} is {len(body)} bytes, over the {STATE_BYTES} a restore "
                           "takes")
    return 200, body


def partial_restore(handler):
    """A state saved by ``/partial/state`` back into this lease's session, which then goes on from its round."""
    serving = handler.serving
    token = handler.headers.get("X-Lease")
    tensors, plain = read_state(handler.holder_body(STATE_BYTES))
    try:
        config, number = plain["config"], _integer(plain["round"], "round", 1)
        config = {**config, "pool_groups": config.get("pool_groups", config["per_step"])}  # saved before it was one
        _check_prompts(plain, serving.served.vocab_size)
        with serving.turns.turn(first=True):
            session = _session(handler, token, config, fresh=True)
            session.rounds.restore(tensors, plain)
            session.last_round, session.states = number, {number: (tensors, plain)}
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as error:
        with serving.turns.turn(first=True):
            close(serving)  # the session half restored, or the one before it (vLLM's requests aborted)
        raise Refused(400, f"the state does not fit this server's model and rounds: {str(error)[:200]}") from None
    return 200, {"round": number}


def _check_prompts(plain: dict, vocab_size: int) -> None:
    """Every prompt a restored state holds (queued, decoding or done) is token ids of this vocabulary, as a
    round's supply must be: ``ValueError`` naming the first that is not."""
    prompts = ([ids for _, ids, _ in plain["pending"]] + [lane["prompt_ids"] for lane in plain.get("lanes", [])]
               + [lane["prompt_ids"] for lane in plain["finished"]])
    for ids in prompts:
        if not isinstance(ids, list) or not ids or not all(
                isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab_size for token in ids):
            raise ValueError(f"a prompt is not token ids of a vocabulary of {vocab_size}: {str(ids)[:80]}")


def read_state(body: bytes) -> tuple[dict, dict]:
    """A safetensors body's tensors and its metadata's ``"plain"`` values; ``Refused(400)`` when it is not one."""
    try:
        (length,) = struct.unpack("<Q", body[:8])
        header = json.loads(body[8: 8 + length])
        plain = json.loads(header["__metadata__"]["plain"])
        tensors = safetensors.torch.load(body)
    except (struct.error, ValueError, KeyError, TypeError, safetensors.SafetensorError) as error:
        raise Refused(400, f"the body is not a saved partial-rollout state: {str(error)[:200]}") from None
    if not isinstance(plain, dict):
        raise Refused(400, "the body's plain values are not a JSON object")
    return tensors, plain
