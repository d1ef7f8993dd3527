"""Partial rollouts in a rollout server (--in-flight-updates with --rollout-mode server or process; docs/async.md):
the continuous batch (the builtin engine's ``partial.Rounds`` over a ``Pool``, or vLLM's ``vllm_partial.VLLMRounds``)
lives in the server, and the lease holder drives it a round at a time, pushing weights between rounds as ever.

- ``POST /partial/round`` with the lease and the fields ``ROUND_FIELDS`` (``OPTIONAL_FIELDS`` optionally): ``supply``
  (``[[[index, seed], prompt ids, seed], ...]``) is appended to the queue, the groups holding a token older than
  ``oldest_allowed`` go back to it, and the server decodes until ``per_step`` groups are done → ``{"lanes",
  "requeued", "pending", "weights_version", "instance"}``. Rounds come in order (409 otherwise); under torchrun
  every rank sends each round, the first runs it and the others get its answer (another request is a 409).
- ``POST /partial/state`` → the state a kept round (the last ``KEPT_STATES``) left, as safetensors with its plain
  values as JSON in the metadata's ``"plain"``; ``POST /partial/restore`` puts such a body back for ``--resume``,
  checked first by the rules of the rounds it replaces (a state file is what a user restores from).

The state belongs to the lease that made it and goes when the lease does (vLLM's requests aborted). While a vLLM
engine holds a session's requests, other clients' ``/generate`` is a 409 (vLLM's ``generate`` would step them to their
end). A round the engine fails is a 500 and gives up the session's rounds: any later round is a 409 naming it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import safetensors.torch

from auto_research.engine.rollout.guard import MAX_PROMPTS, Refused, all_finite, check_generate
from auto_research.engine.rollout.partial import SUPPLY_ROUNDS, Rounds, builtin_pool, supply_target
from auto_research.engine.rollout.partial_files import BATCH_FIELDS, FINISHED_FIELDS, ROW_FIELDS
from auto_research.engine.partial_bounds import MAX_IN_FLIGHT_POOL
from auto_research.errors import one_line

KEPT_STATES = 3
"""Rounds whose state the server keeps: a checkpoint after step s reads round s + 1's, and round s + 2 may have run."""
STATE_BYTES = 2**31
"""The bound on a restored state's body whatever its settings (which bound it far below: ``_state_bytes``)."""
HEADER_BYTES = 2**26
"""The most bytes a restored state's header may have (its tensors' names and shapes, and its plain values)."""
RULES = "the state breaks a round's rules: "
"""The start of a restore's refusal by the rules of the rounds it replaces (``_state_head``, ``_check_tensors``)."""
ROUND_FIELDS = ("round", "version", "weights_version", "per_step", "oldest_allowed", "recompute_kv", "group_size",
                "settings", "supply")
OPTIONAL_FIELDS = ("pool_groups", "settle")


@dataclass
class Session:
    """One lease's rounds: its settings (fixed by its first round or its restore), and the last rounds' states."""

    lease: str
    config: dict
    rounds: object
    last_round: int = 0
    states: dict = field(default_factory=dict)
    answers: dict = field(default_factory=dict)
    """Each kept round's request (a hash) and answer, for the other ranks that send it under torchrun."""
    failed: str | None = None
    """Why a round failed in the engine: a retry or any later round is a 409 naming it (not a round that would find
    half of what the failed one did)."""


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
    """Whether a session has groups decoding on a vLLM engine, whose ``generate`` would step them to their end."""
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
        rounds = engine.rounds(group_size, settings) if hasattr(engine, "rounds") else Rounds(builtin_pool(
            engine.model, engine.tokenizer, group_size, settings))
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
    its lease's rounds keep; else ``Refused``."""
    if not isinstance(body, dict) or sorted(set(body) - set(OPTIONAL_FIELDS)) != sorted(ROUND_FIELDS):
        raise Refused(400, f"a round has the fields {', '.join(ROUND_FIELDS)} (and {', '.join(OPTIONAL_FIELDS)}, "
                           "optionally)")
    number = _integer(body["round"], "round", 1)
    version = _integer(body["version"], "version", 0, number)  # a round r decodes with version max(0, r − 2)
    per_step = _integer(body["per_step"], "per_step", 1, MAX_PROMPTS)
    pool_groups = _integer(body.get("pool_groups", per_step), "pool_groups", per_step, MAX_IN_FLIGHT_POOL * per_step)
    oldest = _integer(body["oldest_allowed"], "oldest_allowed", -(2**62))
    supply, most = body["supply"], _most_supply(per_step, pool_groups)
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
    _check_tokens(serving, pool_groups, group_size, max(map(len, prompts)), settings.max_new_tokens, "a round of ")
    keys = [tuple(item[0]) for item in supply]
    if len(set(keys)) < len(keys):
        raise Refused(400, "supply holds a group twice (its [prompt index, seed])")
    config = {"group_size": group_size, "settings": body["settings"], "recompute_kv": body["recompute_kv"],
              "per_step": per_step, "pool_groups": pool_groups}
    return number, version, per_step, oldest, [(key, item[1], item[2]) for key, item in zip(keys, supply)], config


def _check_tokens(serving, pool_groups: int, group_size: int, longest: int, max_new: int, start: str) -> None:
    """``Refused(413)`` (its line after ``start``) when a pool's worth of rows asks more than --max-request-tokens."""
    if pool_groups * group_size * (longest + max_new) > serving.limits.max_request_tokens:
        raise Refused(413, start + f"{pool_groups} groups of {group_size} with prompts of {longest} tokens and "
                                   f"{max_new} new tokens is over the server's --max-request-tokens "
                                   f"{serving.limits.max_request_tokens}")


def _most_supply(per_step: int, pool_groups: int) -> int:
    """The most groups one round may supply: four steps' worth, and the pool's extra groups."""
    return 4 * per_step + pool_groups - per_step


def _check_held(count: int, per_step: int, pool_groups: int, holder: str) -> None:
    """``Refused(400)`` when ``count`` groups are more than rounds hold at once: a round's supply, a pool's worth
    decoding and a pool's worth done but not yet handed over."""
    most = _most_supply(per_step, pool_groups) + 2 * pool_groups
    if count > most:
        raise Refused(400, f"{holder} {count} groups (queued, decoding and done); {_rounds_of(per_step, pool_groups)} "
                           f"hold at most {most}")


def _rounds_of(per_step: int, pool_groups: int) -> str:
    return f"rounds of {per_step} groups a step, {pool_groups} decoding at once,"


def _check_queue(session: Session, number: int, per_step: int, supply: list) -> None:
    """The round comes next, its groups are new, and the queue will hold enough never to run dry (and no more)."""
    if session.last_round and number != session.last_round + 1:  # a new session starts at any round
        raise Refused(409, f"round {number} after round {session.last_round}: rounds come one at a time, in order")
    held = set(session.rounds.keys()) & {key for key, _, _ in supply}
    if held:
        raise Refused(400, f"supply holds group {list(sorted(held)[0])}, which these rounds hold already")
    _check_held(len(session.rounds.keys()) + len(supply), per_step, session.config["pool_groups"],
                "the rounds would hold")
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
    """A state saved by ``/partial/state`` back into this lease's session, which goes on from its round; checked by
    the rules of the rounds it replaces (``_state_head``, ``_check_tensors``) before anything changes."""
    serving = handler.serving
    token = handler.headers.get("X-Lease")
    head: dict = {}
    body = handler.holder_body(STATE_BYTES, lambda read, length: head.update(_state_head(serving, read, length)))
    tensors, plain = read_state(body)
    number, config = head["round"], head["config"]
    _check_tensors(tensors, plain, head["version"], serving.served.vocab_size)
    try:
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


def _state_head(serving, read, length: int) -> dict:
    """A restore's body refused from its header (``read``) before the rest is read: its settings by a round's rules,
    its groups within what rounds hold, its ``length`` within what such a state can be. → {"round", "version",
    "config"}."""
    first = read(8)
    size = struct.unpack("<Q", first)[0] if len(first) == 8 else -1
    if not 0 < size <= min(HEADER_BYTES, length - 8):
        raise Refused(400, f"the body is not a saved partial-rollout state: its header of {size} bytes is not within "
                           f"the body, or over {HEADER_BYTES}")
    try:
        plain = json.loads(json.loads(read(size))["__metadata__"]["plain"])
        saved = plain["config"]
        round_body = {"round": plain["round"], "version": plain["version"], "weights_version": 0,
                      "per_step": saved["per_step"], "oldest_allowed": 0, "recompute_kv": saved["recompute_kv"],
                      "group_size": saved["group_size"], "settings": saved["settings"], "supply": [],
                      "pool_groups": saved.get("pool_groups", saved["per_step"])}  # (saved before it was one)
        pending, lanes, finished = list(plain["pending"]), list(plain.get("lanes", [])), list(plain["finished"])
        longest = max([len(item[1]) for item in pending] + [len(lane["prompt_ids"]) for lane in lanes + finished]
                      + [1])
    except RecursionError:
        raise Refused(400, "the body's header nests too deep") from None
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise Refused(400, f"the body is not a saved partial-rollout state: {type(error).__name__}: "
                           f"{str(error)[:150]}") from None
    try:
        number, version, per_step, _, _, config = _read_round(serving, round_body)
    except Refused as refused:
        raise Refused(refused.status, RULES + refused.message) from None
    pool_groups, group_size = config["pool_groups"], config["group_size"]
    max_new = int(config["settings"]["max_new_tokens"])
    if len(lanes) > pool_groups or len(finished) > pool_groups:
        raise Refused(400, RULES + f"the state holds {len(lanes)} groups decoding and {len(finished)} done; "
                                   f"{_rounds_of(per_step, pool_groups)} hold at most {pool_groups} of each")
    _check_held(len(pending) + len(lanes) + len(finished), per_step, pool_groups, RULES + "the state holds")
    _check_tokens(serving, pool_groups, group_size, longest, max_new, RULES)
    bound = 8 + size + _state_bytes(serving.served, pool_groups * group_size, longest, max_new)
    if length > bound:
        raise Refused(413, f"a state of {length} bytes is over the {bound} bytes that rounds of {per_step} groups a "
                           f"step ({pool_groups} decoding at once) of {group_size} completions of up to {max_new} new "
                           "tokens can hold")
    return {"round": number, "version": version, "config": config}


def _state_bytes(served, rows: int, longest: int, max_new: int) -> int:
    """The most bytes a state's tensors take for ``rows`` rows of up to ``longest`` + ``max_new`` tokens, every value
    at 8 bytes: the KV cache, the pending logits, the rows' and the batch's fields; and a MiB."""
    width = longest + max_new
    return 2**20 + 8 * rows * (width * _kv_width(served.spec) + served.vocab_size + 2 * width + 8 + 9 * max_new)


def _kv_width(spec: dict) -> int:
    """The KV cache's values a position, over every layer: the output rows of the model's key and value
    projections, or (a model that names them otherwise) of all its matrices, a bound far above."""
    projections = sum(shape[0] for name, (shape, _) in spec.items()
                      if name.endswith(("k_proj.weight", "v_proj.weight")) and len(shape) == 2)
    return projections or sum(shape[0] for shape, _ in spec.values() if len(shape) == 2)


def _is_index(text: str, count: int) -> bool:
    return text.isascii() and text.isdigit() and text == str(int(text)) and int(text) < count


def _known_tensor(name: str, layers: int, finished: int) -> bool:
    """Whether a round's state saves a tensor of this name (``partial_files.pool_to_files``; a state saved before
    its rows left the batch kept the batch's fields under ``rows/``)."""
    parts = name.split("/")
    if len(parts) == 2:
        return (parts[0] == "rows" and (parts[1] in ROW_FIELDS or parts[1] in set(BATCH_FIELDS) - {"row"})) or (
            parts[0] == "batch" and parts[1] in BATCH_FIELDS)
    return len(parts) == 3 and (
        (parts[0] == "cache" and _is_index(parts[1], layers) and parts[2] in ("keys", "values"))
        or (parts[0] == "finished" and _is_index(parts[1], finished) and parts[2] in FINISHED_FIELDS))


def _check_tensors(tensors: dict, plain: dict, version: int, vocab_size: int) -> None:
    """A restored state's tensors by the rules of the rounds that saved them, or ``Refused(400)`` naming a fault."""
    import torch  # noqa: PLC0415

    layers = plain.get("layers", 0)
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) else 0
    for name in sorted(tensors):
        if not _known_tensor(name, layers, len(plain["finished"])):
            raise Refused(400, RULES + f"the state holds a tensor {name[:80]!r}, which no round saves")
    for name in sorted(tensors):
        value, kind, empty = tensors[name], name.rsplit("/", 1)[1], tensors[name].numel() == 0
        integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        if kind == "logprobs" and not (value.is_floating_point() and all_finite(value)
                                       and (empty or float(value.max()) <= 0)):
            raise Refused(400, RULES + f"{name} holds log-probs that are NaN, infinite or above 0")
        if kind in ("versions", "logits_version") and not (
                integer and (empty or (int(value.min()) >= -1 and int(value.max()) <= version))):
            raise Refused(400, RULES + f"{name} holds versions outside -1..{version} (the state's version)")
        if kind == "tokens" and not (integer and (empty or 0 <= int(value.min()) <= int(value.max()) < vocab_size)):
            raise Refused(400, RULES + f"{name} holds token ids outside this vocabulary of {vocab_size}")
        if kind in ("entropies", "logits", "uniforms", "keys", "values") and not (
                value.is_floating_point() and all_finite(value)):
            raise Refused(400, RULES + f"{name} holds values that are not finite floats")
        if kind == "uniforms" and not (empty or 0 <= float(value.min()) <= float(value.max()) <= 1):
            raise Refused(400, RULES + f"{name} holds uniforms outside [0, 1]")


def _check_prompts(plain: dict, vocab_size: int) -> None:
    """Every prompt a restored state holds is token ids of this vocabulary, else ``ValueError``."""
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
