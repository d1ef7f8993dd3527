"""What a rollout server accepts, checked before anything touches its engine: the lease, the shape and size of a
``/generate`` or ``/logprobs`` request, and every tensor of a weight push. Every check raises ``Refused(status,
message)``: the server answers one JSON line ``{"error": message}`` and its engine and weights stay as they were.

The lease (docs/vllm.md): two trainers on one server would each train on samples drawn by the other's weights
(seen: a per-token mismatch of 9.7 nats at one step, silently trained on). A claim with the holder's own run secret
(the server keeps its SHA-256) takes a live lease over, for ``--resume``; the host, PID and run folder a claim names
are the client's own word, so they describe the holder and prove nothing, and are shown only behind an API key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import secrets
import threading
import time
from dataclasses import dataclass, field

from auto_research.engine.temperature import temperature_problem

MAX_GROUP_SIZE = 256
"""Completions per prompt a request may ask for (``--max-group-size`` raises it)."""
MAX_PROMPTS = 4096
"""Prompts in one ``/generate`` request."""
GENERATE_BYTES = 64 * 2**20
"""Largest ``/generate`` body."""
MAX_REQUEST_TOKENS = 2**20
"""Tokens one ``/generate`` may ask for (``request_tokens``, ``--max-request-tokens``; the trainer splits to fit)."""
MAX_SERVER_TOKENS = 2**22
"""Tokens the requests of clients without the lease may hold at once (``--max-server-tokens``)."""
SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k")
HOLDER = (("host", str, "text"), ("pid", int, "an integer"), ("run", str, "text"))
"""A lease claim's holder: each field, its type, and the type's name in a refusal."""
SECRET = "a lease claim carries the run's secret: 32..256 ASCII characters (the trainer keeps it in its run folder)"


class Refused(Exception):
    """A request the server answers with a 4xx status and one line, before touching its engine."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# --- the lease ------------------------------------------------------------------------------------------


def describe(holder: dict, reveal: bool = True) -> str:
    """The holder as a refusal or a log line names it; without ``reveal`` (no API key) its host alone."""
    if not reveal:
        return f"host {holder.get('host')}"
    return f"host {holder.get('host')}, PID {holder.get('pid')}, run folder {holder.get('run')}"


def check_claim(claim) -> tuple[dict, str]:
    """``(holder, secret)`` of a well-formed ``POST /lease`` body, or ``Refused(400)`` naming the first fault."""
    if not isinstance(claim, dict) or not isinstance(claim.get("holder"), dict):
        raise Refused(400, 'a lease claim is {"holder": {"host", "pid", "run"}, "secret"}')
    holder = claim["holder"]
    for key, kind, named in HOLDER:
        if key not in holder:
            raise Refused(400, f"a lease claim needs the holder's host, pid and run folder; {key!r} is missing")
        value = holder[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise Refused(400, f"{key!r} must be {named}, got {json.dumps(value)[:40]}")
        if isinstance(value, str) and not 0 < len(value) <= 4096:
            raise Refused(400, f"{key!r} must be 1..4096 characters, got {len(value)}")
    secret = claim.get("secret")
    if not isinstance(secret, str) or not secret.isascii() or not 32 <= len(secret) <= 256:
        raise Refused(400, SECRET)
    return {key: holder[key] for key, _, _ in HOLDER}, secret


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class Leases:
    """At most one lease at a time; ``clock`` is injectable so that expiry is tested without waiting."""

    seconds: float
    clock: object = time.monotonic
    reveal: bool = False
    token: str | None = None
    holder: dict = field(default_factory=dict)
    digest: str = ""
    """The SHA-256 of the holder's run secret: a claim with the same secret takes the lease over."""
    renewed: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _live(self) -> bool:
        return self.token is not None and self.clock() - self.renewed < self.seconds

    def claim(self, holder: dict, secret: str) -> str:
        """A new token for ``holder``, or ``Refused(409)`` while another ``secret`` holds it live."""
        digest = _digest(secret)
        with self._lock:
            if self._live() and not hmac.compare_digest(digest, self.digest):
                raise Refused(409, self._serving_another())
            self.token, self.renewed, self.digest = secrets.token_hex(16), self.clock(), digest
            self.holder = dict(holder)
            return self.token

    def _serving_another(self) -> str:
        left = self.seconds - (self.clock() - self.renewed)
        stop = (f"stop that run (kill {self.holder.get('pid')} on {self.holder.get('host')})" if self.reveal
                else "stop that run (the server's log names its PID and run folder)")
        return (f"this server serves another trainer ({describe(self.holder, self.reveal)}); {stop}, or wait: its "
                f"lease lapses {left:.0f} s after it stops renewing it, or start another server")

    def check(self, token: str | None) -> None:
        """The request carries the live lease (and so renews it), or ``Refused(409)``."""
        with self._lock:
            if not self._holds(token):
                now = f"it is held by {describe(self.holder, self.reveal)}" if self._live() else "nobody holds it now"
                raise Refused(409, f"this request does not carry the server's lease ({now}); weights are taken only "
                                   "from the trainer holding it")
            self.renewed = self.clock()

    def _holds(self, token) -> bool:
        # bytes: a header's text may be any Latin-1, which compare_digest refuses as str
        return token is not None and self._live() and hmac.compare_digest(str(token).encode(), self.token.encode())

    def holds(self, token: str | None) -> bool:
        """Whether ``token`` is the live lease (renews nothing)."""
        with self._lock:
            return self._holds(token)

    def release(self, token: str | None) -> None:
        self.check(token)
        with self._lock:
            self.token, self.holder, self.digest = None, {}, ""

    def status(self) -> dict:
        """``{"held"}``, with the holder as ``describe`` names it while it is live."""
        with self._lock:
            if not self._live():
                return {"held": False}
            shown = self.holder if self.reveal else {"host": self.holder.get("host")}
            return {"held": True, "holder": dict(shown)}


# --- /generate --------------------------------------------------------------------------------------------


def _integer(value, name: str, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refused(400, f"{name} must be an integer, got {value!r}"[:300])
    if high is None and value < low:
        raise Refused(400, f"{name} must be at least {low}, got {value}")
    if high is not None and not low <= value <= high:
        raise Refused(400, f"{name} must be in {low}..{high}, got {value}")
    return value


def _number(value, name: str, low: float, high: float, low_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise Refused(400, f"{name} must be a finite number, got {value!r}"[:300])
    if value > high or value < low or (low_open and value == low):
        raise Refused(400, f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
    return float(value)


def check_generate(request, vocab_size: int, max_model_len: int, max_group_size: int = MAX_GROUP_SIZE):
    """``(prompt_ids, group_size, seeds, settings)`` of a well-formed request, or ``Refused(400)`` naming a fault."""
    if not isinstance(request, dict):
        raise Refused(400, "the body must be a JSON object")
    expected = ("prompt_ids", "group_size", "seeds", "settings")
    for key in expected:
        if key not in request:
            raise Refused(400, f"missing field {key!r} (a request has {', '.join(expected)})")
    unknown = sorted(set(request) - set(expected))
    if unknown:
        raise Refused(400, f"unknown field {unknown[0]!r} (a request has {', '.join(expected)})")
    prompts = request["prompt_ids"]
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS:
        raise Refused(400, f"prompt_ids must be a list of 1..{MAX_PROMPTS} prompts (lists of token ids)")
    for index, ids in enumerate(prompts):
        _token_ids(ids, f"prompt {index}", vocab_size)
    group_size = _integer(request["group_size"], "group_size", 1, max_group_size)
    seeds = request["seeds"]
    if not isinstance(seeds, list) or len(seeds) != len(prompts):
        raise Refused(400, f"seeds must be a list of one integer per prompt ({len(prompts)})")
    seeds = [_integer(seed, "a seed", -(2**63), 2**63 - 1) for seed in seeds]
    settings = request["settings"]
    if not isinstance(settings, dict) or "max_new_tokens" not in settings:
        raise Refused(400, f"settings must be an object with max_new_tokens (and {', '.join(SETTINGS[1:])})")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise Refused(400, f"unknown sampling setting {unknown[0]!r} (settings are {', '.join(SETTINGS)})")
    longest = max(len(ids) for ids in prompts)
    room = max_model_len - longest
    new_tokens = _integer(settings["max_new_tokens"], "max_new_tokens", 1)
    if new_tokens > room:
        raise Refused(400, f"max_new_tokens {new_tokens} with a prompt of {longest} tokens exceeds the server's "
                           f"max_model_len {max_model_len}")
    from auto_research.engine.rollout import SamplingSettings  # noqa: PLC0415 - torch, only once checked

    temperature = _number(settings.get("temperature", 1.0), "temperature", 0.0, 100.0)
    if temperature_problem(temperature):  # 0 is greedy; (0, MIN_TEMPERATURE) is refused, as by the trainer's flag
        raise Refused(400, f"temperature {temperature_problem(temperature)}")
    checked = SamplingSettings(
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_p=_number(settings.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
        top_k=_integer(settings.get("top_k", 0), "top_k", 0, vocab_size))
    return prompts, group_size, seeds, checked


def _token_ids(ids, name: str, vocab_size: int) -> None:
    """``Refused(400)`` unless ``ids`` is a non-empty list of token ids of the vocabulary."""
    if not isinstance(ids, list) or not ids:
        raise Refused(400, f"{name} is empty or not a list of token ids")
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise Refused(400, f"{name} has token id {token!r}, outside the vocabulary 0..{vocab_size - 1}"[:300])


def check_logprobs(request, vocab_size: int, longest: int, bound: int) -> tuple[list, list, int]:
    """``(prompt_ids, completion_ids, tokens)`` of a well-formed ``POST /logprobs``, or ``Refused``: 400 for its form
    or a row over ``longest`` tokens, 413 for over ``bound`` tokens in all."""
    if not isinstance(request, dict) or set(request) != {"prompt_ids", "completion_ids"}:
        raise Refused(400, 'a /logprobs request is {"prompt_ids": [[id, ...], ...], "completion_ids": [[id, ...], '
                           '...]}: a prompt and a completion a row, nothing else')
    prompts, completions = request["prompt_ids"], request["completion_ids"]
    if not isinstance(prompts, list) or not isinstance(completions, list) \
            or not 1 <= len(prompts) == len(completions) <= MAX_PROMPTS:
        raise Refused(400, f"prompt_ids and completion_ids must be lists of 1..{MAX_PROMPTS} rows, as many of each")
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        _token_ids(prompt, f"prompt {index}", vocab_size)
        _token_ids(completion, f"completion {index}", vocab_size)
        if len(prompt) + len(completion) > longest:
            raise Refused(400, f"row {index} has {len(prompt) + len(completion)} tokens (prompt + completion), over "
                               f"the {longest} a row that this server scores (vLLM's: max_model_len less one)")
    tokens = sum(map(len, prompts)) + sum(map(len, completions))
    if tokens > bound:
        raise Refused(413, f"this request holds {tokens} tokens (prompts + completions), over the server's bound of "
                           f"{bound} a request: send it in parts, or raise rollout-serve's --max-request-tokens")
    return prompts, completions, tokens


def request_tokens(prompts: list, group_size: int, new_tokens: int) -> int:
    """What a ``/generate`` asks of the engine: Σ over its prompts of group size × (prompt + max new tokens)."""
    return group_size * sum(len(ids) + new_tokens for ids in prompts)


def check_size(prompts: list, group_size: int, new_tokens: int, bound: int) -> int:
    """The request's tokens (``request_tokens``), or ``Refused(413)`` naming them and ``bound``."""
    tokens = request_tokens(prompts, group_size, new_tokens)
    if tokens > bound:
        raise Refused(413, f"this request asks for {tokens} tokens (over its prompts, group size × (prompt + "
                           f"max_new_tokens)), over the server's bound of {bound} a request: "
                           "send it in parts, or raise rollout-serve's --max-request-tokens")
    return tokens


def slices(prompts: list, group_size: int, new_tokens: int, bound: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: runs of whole prompts (a group shares one seed) of at most ``bound`` tokens, or one."""
    parts, start, size = [], 0, 0
    for index, ids in enumerate(prompts):
        cost = request_tokens([ids], group_size, new_tokens)
        if index > start and size + cost > bound:
            parts.append((start, index))
            start, size = index, 0
        size += cost
    return parts + [(start, len(prompts))] if prompts else []


# --- /weights ---------------------------------------------------------------------------------------------


@dataclass
class WeightPush:
    """One trainer's push in progress: parts checked one by one against ``spec`` ({name: (shape, dtype name)}),
    applied only once every expected tensor is in."""

    spec: dict
    token: str
    next_part: int = 0
    tensors: dict = field(default_factory=dict)
    bytes: int = 0

    @property
    def limit(self) -> int:
        """The whole push's size: every expected tensor once."""
        return sum(math.prod(shape) * ITEMSIZE.get(dtype, 4) for shape, dtype in self.spec.values())

    def add(self, part: int, body: bytes) -> None:
        """Check one part's tensors against the spec and keep them, or ``Refused`` naming the first that fails."""
        from safetensors.torch import load  # noqa: PLC0415

        if part != self.next_part:
            raise Refused(400, f"weight part {part} arrived, part {self.next_part} was expected (a push starts at part "
                               "0 and sends its parts in order)")
        if self.bytes + len(body) > self.limit + 2**20 * (part + 1):
            raise Refused(413, f"this push is larger than the model's {self.limit} bytes of weights")
        try:
            tensors = load(body)
        except Exception as error:  # noqa: BLE001 - safetensors raises its own types for a corrupt body
            raise Refused(400, f"weight part {part} is not a safetensors file ({type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''})"[:300]) from None
        for name, tensor in tensors.items():
            if name not in self.spec:
                raise Refused(400, f"unknown tensor {name!r}: the served model has no weight of that name"[:300])
            if name in self.tensors:
                raise Refused(400, f"tensor {name!r} was sent twice in one push")
            shape, dtype = self.spec[name]
            if list(tensor.shape) != list(shape):
                raise Refused(400, f"tensor {name!r} has shape {list(tensor.shape)}, the served model's is "
                                   f"{list(shape)}")
            if str(tensor.dtype).removeprefix("torch.") != dtype:
                raise Refused(400, f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, the server "
                                   f"takes {dtype}")
            if not all_finite(tensor):
                raise Refused(400, f"tensor {name!r} has NaN or infinite values")
        self.tensors.update(tensors)
        self.bytes += len(body)
        self.next_part += 1

    def complete(self) -> dict:
        """Every expected tensor, or ``Refused(400)`` naming those missing."""
        missing = sorted(set(self.spec) - set(self.tensors))
        if missing:
            shown = ", ".join(repr(name) for name in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                                                     else "")
            raise Refused(400, f"the push ended without {len(missing)} of the model's tensors: {shown}")
        return self.tensors


def all_finite(tensor) -> bool:
    """No NaN and no ±inf: the smallest and largest values are finite (both carry a NaN through). One pass
    without a boolean tensor the size of the weights: 0.05–0.2 s on SmolLM2's 0.5 GB on 2 cores, where
    ``isfinite(t).all()`` took 1.3–1.6 s."""
    import torch  # noqa: PLC0415

    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_ties(tied, spec: dict) -> dict:
    """A push's ``tied`` ({name: the earlier name it repeats}, sent once): both served, one shape and dtype, the
    source sent and earlier; else Refused."""
    if not isinstance(tied, dict):
        raise Refused(400, "\"tied\" must map names to the earlier names they repeat")
    order = {name: index for index, name in enumerate(spec)}
    for name, source in tied.items():
        if not isinstance(source, str) or name not in order or source not in order:
            raise Refused(400, f"\"tied\" names a weight this server does not serve ({str(name)[:100]!r} → "
                               f"{str(source)[:100]!r})")
        if source in tied or order[source] >= order[name] or tuple(spec[source][0]) != tuple(spec[name][0]) \
                or spec[source][1] != spec[name][1]:
            raise Refused(400, f"{name[:100]!r} cannot repeat {source[:100]!r} (another shape or dtype, a later "
                               "weight, or itself a repeat)")
    return dict(tied)


ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes an element of each dtype a pushed weight may have."""


def weight_spec(named) -> dict:
    """``{name: (shape, dtype name)}`` of the weights an engine loads (``pushed_weights``' names)."""
    return {name: (list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named}


class Turns:
    """The engine, one request (or slice) at a time, the lease holder's first; other clients' tokens, bounded."""

    def __init__(self, bound: int):
        self.bound, self.others = bound, 0
        self.busy, self.waiting_first = False, 0
        self.version = 0
        """The engine's weights' version: read and moved only while holding a turn."""
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def turn(self, first: bool):
        """The engine is the caller's alone inside; ``first``: the lease holder's, served before any other waiting."""
        with self._changed:
            self.waiting_first += first
            try:
                self._changed.wait_for(lambda: not self.busy and (first or not self.waiting_first))
            finally:
                self.waiting_first -= first
            self.busy = True
        try:
            yield
        finally:
            with self._changed:
                self.busy = False
                self._changed.notify_all()

    @contextlib.contextmanager
    def admitted(self, tokens: int, first: bool):
        """Count ``tokens`` in hand while inside, or ``Refused(429)`` when another client's would go over the bound."""
        with self._changed:
            if not first and self.others + tokens > self.bound:
                raise Refused(429, f"the server has {self.others} tokens of other clients' requests in hand; {tokens} "
                                   f"more would go over its bound of {self.bound} (rollout-serve --max-server-tokens): "
                                   "try again when they are answered")
            self.others += 0 if first else tokens
        try:
            yield
        finally:
            with self._changed:
                self.others -= 0 if first else tokens
