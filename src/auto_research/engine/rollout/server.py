"""vLLM as the rollout engine in a process of its own (``--vllm-mode server``).

    auto-research vllm-serve --model M --port 8000            # one vLLM engine behind a small HTTP server
    auto-research post-train --model M --sampler vllm --vllm-mode server --vllm-server 127.0.0.1:8000

The protocol, all on one HTTP port (our own: vLLM's OpenAI server has no in-place weight push that works on
the CPU). With ``--api-key`` (or ``AUTO_RESEARCH_API_KEY``) every request carries ``Authorization: Bearer KEY``.

- ``GET /health`` → ``{"model", "fingerprint", "weights_version", "instance", "max_model_len", "dtype",
  "vocab_size", "max_group_size", "lease"}`` (``instance``: random, one per server start). The fingerprint hashes the architecture's shape and the tokenizer's vocabulary:
  a trainer whose ``--model`` differs is refused.
- ``POST /lease`` with ``{"holder": {"host", "pid", "run"}}`` → ``{"lease", "seconds", "shared"}`` (the lease's
  shared-memory buffer, or null), or 409 naming the trainer that holds it (``guard.Leases``: one per server).
  ``/lease/renew`` and ``/lease/release`` carry the lease in an ``X-Lease`` header.
- ``POST /generate`` with ``{"prompt_ids", "group_size", "seeds", "settings"}`` (token ids, so both sides
  tokenize nothing differently; every sampling setting explicit) → ``{"completions", "logprobs",
  "weights_version", "instance"}``: the engine's processed log-probs of the drawn tokens, as colocated; the
  trainer checks the version and the instance against what it pushed. Open to any client (with the key):
  drawing samples changes nothing.
- ``POST /weights?part=N&last=0|1`` with the lease and a safetensors body: the policy's weights in parts of at
  most ``PART_BYTES``, gathered one parameter at a time on the trainer (FSDP2 shards too). Each part is checked
  as it comes (known names, shapes, dtype, finite values; ``guard.WeightPush``); at the last part, once every
  expected tensor is in, the engine reloads them in place and empties its prefix cache →
  ``{"weights_version", "seconds"}``. A push that fails a check is dropped whole and the engine keeps its
  weights: a reload that misses tensors would leave vLLM sampling from unprocessed ones.
- ``POST /weights/shared`` with the lease and ``{"nonce", "names", "checksums"}``: the same push through the
  shared-memory buffer the lease's answer offered (``"shared"``), for a trainer on the server's host; each slot is
  checked against the checksum the trainer took after its copy (``transfer.py``).

Every refusal is a 4xx with one JSON line ``{"error": ...}`` and leaves the engine as it was; an engine failure
is a 500 with its one-line cause. Each connection has its own thread and a read timeout, so a client that never
sends its body blocks nobody; the engine serves one request at a time. Under torchrun every rank sends its own
prompts (per-request seeds make the draws independent of which rank asks) and rank 0 holds the lease and pushes
the weights after every optimizer step; every rank learns whether the push went in before anyone samples again.
Between hosts weights go over HTTP, on the CPU and on GPUs alike (NCCL between trainer and server is not
built: see docs/vllm.md).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Lock
from urllib.parse import parse_qs, urlparse

import torch

from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.guard import (GENERATE_BYTES, MAX_GROUP_SIZE, Leases, Refused, check_generate,
                                                describe, weight_spec)
from auto_research.engine.rollout.transfer import SHARED_FOLDER, Intake
from auto_research.engine.rollout.remote import pushed_weights
from auto_research.errors import UserError, one_line

PART_BYTES = 256 * 2**20
API_KEY_VARIABLE = "AUTO_RESEARCH_API_KEY"
"""The shared secret, on the server and the trainer alike (a flag would land in config.yaml and shell history)."""


def fingerprint(config, tokenizer) -> str:
    """What must agree between trainer and server: the architecture's shape and the tokenizer's vocabulary."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    shape = {key: getattr(config, key, None) for key in keys}
    vocabulary = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([shape, vocabulary], sort_keys=True, default=str).encode()).hexdigest()[:16]


def split_address(address: str, flag: str = "--rollout-server") -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{flag} {address!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host, int(port)


# --- the server ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """What the server knows of its model: the trainer's pushes and requests are checked against it."""

    name: str
    fingerprint: str
    spec: dict
    """``{checkpoint name: (shape, dtype name)}`` of every weight the engine loads."""
    vocab_size: int
    dtype: str


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None
    lease_seconds: float = 60.0
    read_timeout: float = 30.0
    max_group_size: int = MAX_GROUP_SIZE
    shared_folder: Path | None = SHARED_FOLDER
    """Where a lease's shared-memory buffer is made (None: HTTP only)."""


def make_server(sampler, served: Served, host: str, port: int, limits: Limits = Limits(), log=None,
                clock=time.monotonic):
    """An HTTP server in front of one engine (a ``VLLMSampler`` with ``generate``, ``load_named`` and
    ``max_model_len``). Each connection has a thread of its own (a slow client blocks nobody else) and a read
    timeout; the engine serves one request at a time. ``clock`` times the leases (tests move it by hand)."""
    engine = Lock()
    leases = Leases(limits.lease_seconds, clock)
    intake = Intake(served.spec, limits.shared_folder)
    state = {"version": 0, "instance": secrets.token_hex(8)}
    """``instance``: this server's life; a trainer that sees another one knows the server restarted without its
    weights."""
    say = log or (lambda line: None)

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.read_timeout

        def log_message(self, *args):
            pass

        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self) -> None:
            if limits.api_key is None:
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {limits.api_key}".encode()):
                raise Refused(401, "missing or wrong API key (send the header Authorization: Bearer KEY; the "
                                   "trainer reads KEY from AUTO_RESEARCH_API_KEY)")

        def _body(self, limit: int) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                self.close_connection = True
                raise Refused(411, "a request body needs a Content-Length")
            if not length.strip().isdigit():
                self.close_connection = True
                raise Refused(400, f"Content-Length {length[:40]!r} is not a number of bytes")
            if int(length) > limit:
                self.close_connection = True
                raise Refused(413, f"a body of {int(length)} bytes is over this path's limit of {limit} bytes")
            try:
                body = self.rfile.read(int(length))
            except (TimeoutError, OSError):
                self.close_connection = True
                raise Refused(408, f"the body did not arrive within {limits.read_timeout:g} s") from None
            if len(body) < int(length):
                self.close_connection = True
                raise Refused(400, f"the body ended after {len(body)} of {int(length)} bytes")
            return body

        def _json(self, limit: int = GENERATE_BYTES):
            try:
                return json.loads(self._body(limit))
            except ValueError as error:
                raise Refused(400, f"the body is not JSON ({str(error)[:100]})") from None

        def _respond(self, work) -> None:
            """``work()``'s (status, payload); a refusal as its 4xx line, an engine failure as a 500 line."""
            try:
                self._authorised()
                status, payload = work()
            except Refused as refused:
                say(f"refused {self.command} {urlparse(self.path).path}: {refused.status} {refused.message}")
                status, payload = refused.status, {"error": refused.message}
            except Exception as error:  # noqa: BLE001 - the engine's own failure: one line, the server stays up
                say(f"engine failure on {self.command} {urlparse(self.path).path}: {one_line(error)}")
                status, payload = 500, {"error": f"the engine failed: {one_line(error)}"[:500]}
            try:
                self._answer(status, payload)
            except OSError:  # the client went away
                self.close_connection = True

        def do_GET(self):
            self._respond(self._get)

        def do_POST(self):
            self._respond(self._post)

        def _get(self):
            if urlparse(self.path).path != "/health":
                raise Refused(404, f"no such path {urlparse(self.path).path}")
            return 200, {"model": served.name, "fingerprint": served.fingerprint, "weights_version": state["version"],
                         "instance": state["instance"],
                         "max_model_len": sampler.max_model_len, "dtype": served.dtype,
                         "vocab_size": served.vocab_size, "max_group_size": limits.max_group_size,
                         "lease_seconds": limits.lease_seconds, "lease": leases.status()}

        def _post(self):
            url = urlparse(self.path)
            intake.prune(leases.holds)  # a lapsed lease's buffer goes
            if url.path == "/generate":
                prompt_ids, group_size, seeds, settings = check_generate(
                    self._json(), served.vocab_size, sampler.max_model_len, limits.max_group_size)
                with engine:
                    completions, logprobs = sampler.generate(prompt_ids, group_size, seeds, settings)
                    version = state["version"]
                return 200, {"completions": completions, "logprobs": logprobs, "weights_version": version,
                             "instance": state["instance"]}
            if url.path == "/lease":
                claim = self._json(2**16)
                holder = claim.get("holder") if isinstance(claim, dict) else None
                token = leases.claim(holder if isinstance(holder, dict) else {})
                say(f"lease taken by {describe(leases.holder)}")
                return 200, {"lease": token, "seconds": limits.lease_seconds, "shared": intake.offer(token)}
            if url.path == "/lease/renew":
                self._body(2**16)
                leases.check(self.headers.get("X-Lease"))
                return 200, {"seconds": limits.lease_seconds}
            if url.path == "/lease/release":
                self._body(2**16)
                holder = leases.status().get("holder", {})
                leases.release(self.headers.get("X-Lease"))
                intake.prune(leases.holds)
                say(f"lease released by {describe(holder)}")
                return 200, {}
            if url.path == "/weights":
                return self._weights(url)
            if url.path == "/weights/shared":
                body = self._json(2**22)
                token = self.headers.get("X-Lease")
                leases.check(token)
                with intake.lock:  # the views are read while the engine reloads: no other push meanwhile
                    return self._load(intake.take_shared(token, body))
            raise Refused(404, f"no such path {url.path}")

        def _weights(self, url):
            body = self._body(PART_BYTES + 2**20)  # read first: a client still sending would miss the answer
            token = self.headers.get("X-Lease")
            leases.check(token)
            query = parse_qs(url.query)
            try:
                part, last = int(query["part"][0]), query.get("last", ["0"])[0] == "1"
            except (KeyError, ValueError):
                raise Refused(400, "/weights needs ?part=N (0, 1, ...) and last=0 or 1") from None
            weights = intake.part(token, part, last, body)
            return self._load(weights) if last else (200, {"received": intake.received()})

        def _load(self, weights: dict):
            """Every checked tensor into the engine, in place; only then does the version move."""
            started = time.perf_counter()
            with engine:
                sampler.load_named(iter(weights.items()))
                state["version"] += 1
                version = state["version"]
            return 200, {"weights_version": version, "seconds": time.perf_counter() - started}

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads, server.intake = True, intake
    return server


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def serve(config, log=print) -> None:
    """``auto-research rollout-serve``: load the model, start the engine (vLLM or the builtin sampler), answer
    until interrupted."""
    from auto_research.engine.models import context_length, load_policy, resolve_device, resolve_dtype

    api_key = config.api_key or os.environ.get(API_KEY_VARIABLE) or None
    if api_key is None and not is_loopback(config.host):
        log(f"warning: serving on {config.host}, beyond this machine, without an API key: anyone who reaches the "
            f"port can sample from the model and, while no trainer holds the lease, replace its weights; set "
            f"{API_KEY_VARIABLE} (or --api-key) here and for the trainer")
    device = resolve_device(config.device)
    if config.model is None:
        from auto_research.engine.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model, name = build_model(tokenizer, seed=0), "embedded"
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        model, tokenizer = load_policy(config.model, device, torch.float32, config.offline, log=log)
        name = config.model
    longest = config.max_model_len or min(context_length(model) or 4096, 4096)
    if config.engine == "builtin":
        from auto_research.engine.rollout.builtin import BuiltinEngine

        # fp32, the trainer's own kernels: its draws are the builtin sampler's in the trainer's process.
        dtype = torch.float32
        log(f"starting the builtin sampler for {name} on {device} (max_model_len {longest})")
        sampler = BuiltinEngine(model.to(device), tokenizer)
        sampler.max_model_len = min(sampler.max_model_len, longest)
    else:
        from auto_research.engine.rollout.vllm import VLLMSampler, check_servable

        check_servable(model.config, device, name, "rollout-serve",
                       "serve it from a GPU, with --engine builtin, or train with --sampler builtin")
        memory = config.vllm_memory or (0.05 if device == "cpu" else 0.3)
        dtype = resolve_dtype(config.dtype, device)
        log(f"starting a vLLM engine for {name} ({memory:g} of the "
            f"{'host memory for its KV cache' if device == 'cpu' else 'device memory'}, max_model_len {longest})")
        sampler = VLLMSampler(model, tokenizer, SamplingSettings(max_new_tokens=16), memory, dtype, longest,
                              config.seed)
    served = Served(name, fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, dtype)),
                    int(model.config.vocab_size), str(dtype).removeprefix("torch."))
    limits = Limits(api_key, config.lease_seconds, config.read_timeout, config.max_group_size)
    server = make_server(sampler, served, config.host, config.port, limits, log)
    del model
    log(f"serving {name} on http://{config.host}:{server.server_address[1]} "
        f"({'API key required, ' if api_key else ''}a trainer's lease lapses {config.lease_seconds:g} s after its "
        "last renewal; Ctrl-C stops)")
    signal.signal(signal.SIGTERM, _interrupt)  # a plain kill stops it as Ctrl-C does: its shared buffer goes
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.intake.close()
        server.server_close()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt

