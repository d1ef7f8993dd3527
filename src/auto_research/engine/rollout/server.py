"""A rollout engine (vLLM, or the builtin sampler) in a process of its own (``--rollout-mode server``), behind our
own HTTP protocol (vLLM's OpenAI server has no in-place weight push that works on the CPU); docs/vllm.md describes
it in full. With a key (``AUTO_RESEARCH_API_KEY``, ``rollout-serve --api-key-file``) every request carries
``Authorization: Bearer KEY``.

- ``GET /health``: the model, its fingerprint (architecture and vocabulary: another ``--model`` is refused), the
  weights' version, this server start's random ``instance``, its limits and what it offers, the lease's holder.
- ``POST /lease`` (``/lease/renew``, ``/lease/release``: the lease in ``X-Lease``): one trainer per server
  (``guard.Leases``); the run's secret takes a live lease over for ``--resume``.
- ``POST /generate`` and ``/logprobs``: token ids in, completions and the engine's processed log-probs (or a
  teacher's temperature-1 scores) out, with the version and instance they came from. Open to any client with the
  key; at most ``--max-request-tokens`` a request (413), other clients' at most ``--max-server-tokens`` at once (429).
- ``POST /weights?part=N&last=0|1``, ``/weights/shared``, ``/weights/collective[/push]``, ``/weights/adapter`` with
  the lease: a push (HTTP parts, the shared-memory buffer, a group of two: ``pushes.py``, a LoRA adapter), every
  tensor checked before the engine reloads in place; a push that fails a check is dropped whole (a reload missing
  tensors would leave vLLM sampling from unprocessed ones).
- ``POST /partial/round``, ``/partial/state``, ``/partial/restore`` with the lease: ``partial_serve.py``.

Every refusal is a 4xx with one JSON line ``{"error": ...}`` and leaves the engine as it was; an engine failure is
a 500. Each connection has its own thread and a read timeout. The engine serves one request at a time, the lease
holder's first (``Turns``); another client's request is drawn in slices of at most ``SLICE_TOKENS``. Priority
rather than a time limit: an engine call cannot be cut short (vLLM's ``generate`` is one blocking call), so a
deadline would bound nothing while it runs and would throw away its work; slices only make the other client wait.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from auto_research.engine.rollout.guard import (GENERATE_BYTES, MAX_GROUP_SIZE, MAX_REQUEST_TOKENS, MAX_SERVER_TOKENS,
                                                Leases, Refused, Turns, check_claim, check_generate,
                                                check_logprobs, check_size, describe, slices)
from auto_research.engine.rollout.served import Served, fingerprint, vocabulary  # noqa: F401 - re-exported
from auto_research.engine.rollout.pushes import (adapter_push, backends, collective_join, collective_push,
                                                takes_adapters)
from auto_research.engine.rollout.transfer import SHARED_FOLDER, Intake
from auto_research.errors import is_decimal, one_line
from auto_research.http import authorization

PART_BYTES = 256 * 2**20
SLICE_TOKENS = 2**14
"""A request without the lease is drawn in slices of whole prompts asking at most this many tokens (one prompt's
group alone when it asks more): between two slices the lease holder's waiting requests go first."""
LARGE_BODY_BYTES = 2**20
LARGE_BODIES = 4
"""Bodies over LARGE_BODY_BYTES that clients without the lease may hold at once: connections are not bounded, the
memory their bodies take is. One more waits up to --read-timeout for a slot, then gets 503; the holder's never do."""


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None
    lease_seconds: float = 60.0
    read_timeout: float = 30.0
    max_group_size: int = MAX_GROUP_SIZE
    shared_folder: Path | None = SHARED_FOLDER
    """Where a lease's shared-memory buffer is made (None: HTTP only)."""
    max_request_tokens: int = MAX_REQUEST_TOKENS
    max_server_tokens: int = MAX_SERVER_TOKENS
    slice_tokens: int = SLICE_TOKENS
    large_bodies: int = LARGE_BODIES


@dataclass
class Serving:
    """What every request's handler shares: the engine and what guards it."""

    sampler: object
    served: Served
    limits: Limits
    leases: Leases
    intake: Intake
    turns: Turns
    say: object
    instance: str = ""
    """This server's life (random): another one tells a trainer the server restarted without its weights."""
    large: threading.BoundedSemaphore | None = None
    """Slots for the bodies over ``LARGE_BODY_BYTES`` of clients without the lease, read and held at once."""
    links: dict = field(default_factory=dict)
    """The lease holder's group, by lease: one ``pushes.Link`` at a time (``pushes.collective_join``)."""
    partial: object = None
    """The lease holder's partial rollouts (``partial_serve.Session``), once it ran a round or restored one."""


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (a thread each); ``self.server.serving`` is the engine and its guards."""

    POSTS = {"/generate": "_generate", "/lease": "_lease", "/lease/renew": "_renew", "/lease/release": "_release",
             "/weights": "_weights", "/weights/shared": "_shared", "/logprobs": "_logprobs"}
    PUSHES = {"/weights/adapter": lambda handler: adapter_push(handler, PART_BYTES + 2**20),
              "/weights/collective": collective_join, "/weights/collective/push": collective_push}
    """Paths answered by ``pushes.py``'s functions, given the handler."""
    PARTIAL = {"/partial/round": "partial_round", "/partial/state": "partial_state",
               "/partial/restore": "partial_restore"}
    """Paths answered by ``partial_serve.py``'s functions of these names."""

    def setup(self):
        self.serving: Serving = self.server.serving
        self.timeout = self.serving.limits.read_timeout  # the socket's: a client that never sends blocks nobody
        super().setup()

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._respond(self._health)

    def do_POST(self):
        self._respond(self._post)

    def _respond(self, work) -> None:
        """``work()``'s (status, payload); a refusal as its 4xx line, an engine failure as a 500 line."""
        self._holding_large = False
        try:
            self._authorised()
            status, payload = work()
        except Refused as refused:
            self.close_connection = True  # whatever of the body is unread is not read (HTTP/1.0 closes anyway)
            self.serving.say(f"refused {self.command} {self._path()}: {refused.status} {refused.message}")
            status, payload = refused.status, {"error": refused.message}
        except Exception as error:  # noqa: BLE001 - the engine's own failure: one line, the server stays up
            self.serving.say(f"engine failure on {self.command} {self._path()}: {one_line(error)}")
            status, payload = 500, {"error": f"the engine failed: {one_line(error)}"[:500]}
        finally:
            if self._holding_large:
                self.serving.large.release()
        try:
            self._answer(status, payload)
        except OSError:  # the client went away
            self.close_connection = True

    def _answer(self, status: int, payload: dict | bytes) -> None:
        """A JSON answer, or a binary one (``/partial/state``'s safetensors)."""
        binary = isinstance(payload, bytes)
        body = payload if binary else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if binary else "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 429:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(body)

    def _path(self) -> str:
        return urlparse(self.path).path

    def _authorised(self) -> None:
        key = self.serving.limits.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "").encode("latin-1")  # the bytes sent (read as Latin-1)
        if not hmac.compare_digest(given, authorization(key).encode("latin-1")):
            raise Refused(401, "missing or wrong API key (send the header Authorization: Bearer KEY; the "
                               "trainer reads KEY from AUTO_RESEARCH_API_KEY)")

    def _refuse(self, status: int, message: str):
        """A refusal after which the rest of the body, if any, is not read: the connection closes."""
        self.close_connection = True
        raise Refused(status, message)

    def _body(self, limit: int, head=None) -> bytes:
        """The body, ``limit`` bytes at most. ``head(read, length)`` may refuse it from its first bytes: the rest is
        then read and dropped, never held, so that a client still sending gets the refusal."""
        length = self.headers.get("Content-Length")
        if length is None:
            self._refuse(411, "a request body needs a Content-Length")
        if not is_decimal(length):
            self._refuse(400, f"Content-Length must be a decimal number of bytes, got {length[:40]!r}")
        if len(length) > 18 or int(length) > limit:
            self._refuse(413, f"a body of {length[:40]} bytes is over this path's limit of {limit} bytes")
        if int(length) > LARGE_BODY_BYTES and not self.serving.leases.holds(self.headers.get("X-Lease")):
            self._large_slot()
        total, parts = int(length), []

        def read(count: int) -> bytes:
            count = min(count, total - sum(map(len, parts)))
            try:
                part = self.rfile.read(count)
            except (TimeoutError, OSError):
                self._refuse(408, f"the body did not arrive within {self.serving.limits.read_timeout:g} s")
            parts.append(part)
            if len(part) < count:
                self._refuse(400, f"the body ended after {sum(map(len, parts))} of {total} bytes")
            return part

        if head is not None:
            try:
                head(read, total)
            except Refused:
                self.close_connection = True
                self._drop(total - sum(map(len, parts)))
                raise
        read(total)
        return b"".join(parts)

    def _large_slot(self) -> None:
        """One of the slots for large bodies (``LARGE_BODIES``), waited for up to the read timeout."""
        if not self.serving.large.acquire(timeout=self.serving.limits.read_timeout):
            self._refuse(503, f"{self.serving.limits.large_bodies} requests of over {LARGE_BODY_BYTES} bytes from "
                              "clients without the lease are being served; send it again later")
        self._holding_large = True

    def _drain(self, limit: int) -> None:
        """Read and drop the body (at most ``limit`` bytes), so that a refusal reaches a client still sending."""
        length = self.headers.get("Content-Length", "")
        self._drop(min(int(length), limit) if is_decimal(length) and len(length) <= 18 else 0)

    def _drop(self, left: int) -> None:
        """Read and drop ``left`` bytes of the body, a MiB at a time (the connection closes if it stops)."""
        try:
            while left > 0 and (chunk := self.rfile.read(min(left, 2**20))):
                left -= len(chunk)
        except (TimeoutError, OSError):
            self.close_connection = True

    def _json(self, limit: int = GENERATE_BYTES):
        body = self._body(limit)
        try:
            return json.loads(body)
        except RecursionError:
            raise Refused(400, "the body nests too deep (JSON arrays and objects within each other, far beyond "
                               "what any request of this server holds)") from None
        except ValueError as error:
            raise Refused(400, f"the body is not JSON ({str(error)[:100]})") from None

    def _health(self):
        if self._path() != "/health":
            raise Refused(404, f"no such path {self._path()}")
        serving, limits = self.serving, self.serving.limits
        return 200, {"model": serving.served.name, "fingerprint": serving.served.fingerprint,
                     "vocabulary": serving.served.vocabulary,
                     "weights_version": serving.turns.version, "instance": serving.instance,
                     "max_model_len": serving.sampler.max_model_len, "dtype": serving.served.dtype,
                     "vocab_size": serving.served.vocab_size, "max_group_size": limits.max_group_size,
                     "max_request_tokens": limits.max_request_tokens, "lease_seconds": limits.lease_seconds,
                     "adapters": takes_adapters(serving.sampler),
                     "collective": backends(serving.served.device),
                     "partial": bool(getattr(serving.sampler, "partial_rollouts", False)),
                     "lease": serving.leases.status()}

    def _post(self):
        path = self._path()
        self.serving.intake.prune(self.serving.leases.holds)  # a lapsed lease's buffer goes
        if self.serving.partial is not None or path in self.PARTIAL:
            from auto_research.engine.rollout import partial_serve  # noqa: PLC0415 - torch, only when asked

            partial_serve.prune(self.serving)  # and its partial rollouts
            if path in self.PARTIAL:
                return getattr(partial_serve, self.PARTIAL[path])(self)
        if path in self.PUSHES:
            return self.PUSHES[path](self)
        if path not in self.POSTS:
            raise Refused(404, f"no such path {path}")
        return getattr(self, self.POSTS[path])()

    def _generate(self):
        """Drawn whole for the lease holder, in slices between its turns for anyone else (see the module)."""
        serving, limits = self.serving, self.serving.limits
        prompts, group_size, seeds, settings = check_generate(
            self._json(), serving.served.vocab_size, serving.sampler.max_model_len, limits.max_group_size)
        new = settings.max_new_tokens
        tokens = check_size(prompts, group_size, new, limits.max_request_tokens)
        answers, version = self._in_turns(tokens, slices(prompts, group_size, new, limits.slice_tokens), lambda s, e: (
            serving.sampler.generate(prompts[s:e], group_size, seeds[s:e], settings)))
        return 200, {"completions": [row for drawn, _ in answers for row in drawn],
                     "logprobs": [row for _, values in answers for row in values], "weights_version": version,
                     "instance": serving.instance}

    def _logprobs(self):
        """Each completion token's log-prob at temperature 1 (a teacher's scores), scheduled as ``/generate``."""
        serving, limits = self.serving, self.serving.limits
        prompts, completions, tokens = check_logprobs(self._json(), serving.served.vocab_size,
                                                      serving.sampler.longest_scored, limits.max_request_tokens)
        rows = [prompt + completion for prompt, completion in zip(prompts, completions)]
        answers, version = self._in_turns(tokens, slices(rows, 1, 0, limits.slice_tokens), lambda s, e: (
            serving.sampler.logprobs(prompts[s:e], completions[s:e])))
        return 200, {"logprobs": [row for values in answers for row in values], "weights_version": version,
                     "instance": serving.instance}

    def _in_turns(self, tokens: int, parts: list, work) -> tuple[list, int]:
        """``work(start, end)`` of each part (the whole request for the lease holder), each in a turn of the engine;
        their answers, and the one weights version they came from."""
        serving = self.serving
        first = serving.leases.holds(self.headers.get("X-Lease"))
        answers, version = [], None
        with serving.turns.admitted(tokens, first):
            for start, end in [(0, parts[-1][1])] if first else parts:
                with serving.turns.turn(first):
                    _check_no_partial_rollouts(serving)  # in the turn: a round may have begun while this waited
                    if version not in (None, serving.turns.version):  # stop: the answer is void
                        raise Refused(409, "the lease holder pushed new weights while this request was drawn (in "
                                           "slices, between its requests): its samples would come from two versions; "
                                           "send it again")
                    version = serving.turns.version
                    answers.append(work(start, end))
        return answers, version

    def _lease(self):
        holder, secret = check_claim(self._json(2**16))
        token = self.serving.leases.claim(holder, secret)
        self.serving.say(f"lease taken by {describe(holder)}")
        return 200, {"lease": token, "seconds": self.serving.limits.lease_seconds,
                     "shared": self.serving.intake.offer(token)}

    def _renew(self):
        self._body(2**16)
        self.serving.leases.check(self.headers.get("X-Lease"))
        return 200, {"seconds": self.serving.limits.lease_seconds}

    def _release(self):
        self._body(2**16)
        leases = self.serving.leases
        holder = dict(leases.holder)
        leases.release(self.headers.get("X-Lease"))
        self.serving.intake.prune(leases.holds)
        self.serving.say(f"lease released by {describe(holder)}")
        return 200, {}

    def _weights(self):
        token, body = self.headers.get("X-Lease"), self.holder_body(PART_BYTES + 2**20)
        query = parse_qs(urlparse(self.path).query)
        try:
            part, last = int(query["part"][0]), query.get("last", ["0"])[0] == "1"
        except (KeyError, ValueError):
            raise Refused(400, "/weights needs ?part=N (0, 1, ...) and last=0 or 1") from None
        weights = self.serving.intake.part(token, part, last, body)
        return self.load_checked(weights) if last else (200, {"received": self.serving.intake.received()})

    def holder_body(self, limit: int, head=None) -> bytes:
        """The lease holder's body (as ``_body``); another client's is read, dropped and refused."""
        try:  # the lease first: a push of any other client is never held in memory
            self.serving.leases.check(self.headers.get("X-Lease"))
        except Refused:
            self._drain(limit)  # read and dropped, so that a client still sending gets the refusal
            raise
        return self._body(limit, head)

    def _shared(self):
        body = self._json(2**22)
        token = self.headers.get("X-Lease")
        self.serving.leases.check(token)
        with self.serving.intake.lock:  # the views are read while the engine reloads: no other push meanwhile
            return self.load_checked(self.serving.intake.take_shared(token, body))

    def load_checked(self, weights: dict, adopt: bool = False):
        """Every checked tensor into the engine, in place; ``adopt``: the engine serves the tensors themselves
        (``adopt_named``, ``pushes.collective_push``)."""
        sampler = self.serving.sampler
        return self.loaded(lambda: (sampler.adopt_named if adopt else sampler.load_named)(iter(weights.items())))

    def loaded(self, load):
        """``load()`` puts new weights into the engine in the holder's turn; only then does the version move."""
        started, turns = time.perf_counter(), self.serving.turns
        with turns.turn(first=True):
            load()
            turns.version += 1
            version = turns.version
        return 200, {"weights_version": version, "seconds": time.perf_counter() - started}


def _check_no_partial_rollouts(serving) -> None:
    """``Refused(409)`` while a run's partial rollouts decode on a vLLM engine (``partial_serve.blocks_generate``)."""
    if serving.partial is not None:
        from auto_research.engine.rollout.partial_serve import blocks_generate  # noqa: PLC0415

        if blocks_generate(serving):
            raise Refused(409, "this vLLM server is decoding a run's partial rollouts (--in-flight-updates), "
                               "which vLLM's generate would run to their end; use another server")


def make_server(sampler, served: Served, host: str, port: int, limits: Limits = Limits(), log=None,
                clock=time.monotonic):
    """An HTTP server in front of one engine (``generate``, ``load_named``, ``max_model_len``: a ``VLLMSampler`` or
    ``BuiltinEngine``). ``clock`` times the leases (tests move it by hand)."""
    serving = Serving(sampler, served, limits, Leases(limits.lease_seconds, clock, reveal=limits.api_key is not None),
                      Intake(served.spec, limits.shared_folder), Turns(limits.max_server_tokens),
                      log or (lambda line: None), secrets.token_hex(8), threading.BoundedSemaphore(limits.large_bodies))
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads, server.serving, server.intake = True, serving, serving.intake
    return server
