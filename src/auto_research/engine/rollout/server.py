"""vLLM as the rollout engine in a process of its own (``--vllm-mode server``).

    auto-research vllm-serve --model M --port 8000            # one vLLM engine behind a small HTTP server
    auto-research post-train --model M --sampler vllm --vllm-mode server --vllm-server 127.0.0.1:8000

The protocol, all on one HTTP port (our own: vLLM's OpenAI server has no in-place weight push that works on
the CPU). With ``--api-key`` (or ``AUTO_RESEARCH_API_KEY``) every request carries ``Authorization: Bearer KEY``.

- ``GET /health`` → ``{"model", "fingerprint", "weights_version", "max_model_len", "dtype", "vocab_size",
  "max_group_size", "lease"}``. The fingerprint hashes the architecture's shape and the tokenizer's vocabulary:
  a trainer whose ``--model`` differs is refused.
- ``POST /lease`` with ``{"holder": {"host", "pid", "run"}}`` → ``{"lease", "seconds"}``, or 409 naming the
  trainer that holds it (``guard.Leases``: one trainer per server). ``/lease/renew`` and ``/lease/release``
  carry the lease in an ``X-Lease`` header.
- ``POST /generate`` with ``{"prompt_ids", "group_size", "seeds", "settings"}`` (token ids, so both sides
  tokenize nothing differently; every sampling setting explicit) → ``{"completions", "logprobs",
  "weights_version"}``: vLLM's processed log-probs of the drawn tokens, as colocated. Open to any client (with
  the key): drawing samples changes nothing.
- ``POST /weights?part=N&last=0|1`` with the lease and a safetensors body: the policy's weights in parts of at
  most ``PART_BYTES``, gathered one parameter at a time on the trainer (FSDP2 shards too). Each part is checked
  as it comes (known names, shapes, dtype, finite values; ``guard.WeightPush``); at the last part, once every
  expected tensor is in, the engine reloads them in place and empties its prefix cache →
  ``{"weights_version", "seconds"}``. A push that fails a check is dropped whole and the engine keeps its
  weights: a reload that misses tensors would leave vLLM sampling from unprocessed ones.

Every refusal is a 4xx with one JSON line ``{"error": ...}`` and leaves the engine as it was; an engine failure
is a 500 with its one-line cause. Each connection has its own thread and a read timeout, so a client that never
sends its body blocks nobody; the engine serves one request at a time. Under torchrun every rank sends its own
prompts (per-request seeds make the draws independent of which rank asks) and rank 0 holds the lease and pushes
the weights after every optimizer step; every rank learns whether the push went in before anyone samples again.
Weight transfer is HTTP on the CPU and on GPUs alike here (NCCL between trainer and server is not built: see
docs/vllm.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Lock
from urllib.parse import parse_qs, urlparse

import torch

from auto_research.engine.rollout import Rollout, SamplingSettings, eos_ids
from auto_research.engine.rollout.guard import (GENERATE_BYTES, MAX_GROUP_SIZE, Leases, Refused, WeightPush,
                                                check_generate, describe, weight_spec)
from auto_research.engine.rollout.vllm import build_rollout, pushed_weights
from auto_research.errors import RolloutEngineError, UserError, one_line
from auto_research.http import RequestFailed, request

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


def split_address(address: str, flag: str = "--vllm-server") -> tuple[str, int]:
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


def make_server(sampler, served: Served, host: str, port: int, limits: Limits = Limits(), log=None):
    """An HTTP server in front of one engine (a ``VLLMSampler`` with ``generate``, ``load_named`` and
    ``max_model_len``). Each connection has a thread of its own (a slow client blocks nobody else) and a read
    timeout; the engine serves one request at a time."""
    engine, pushing = Lock(), Lock()
    leases = Leases(limits.lease_seconds)
    state = {"version": 0, "push": None}
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
                         "max_model_len": sampler.max_model_len, "dtype": served.dtype,
                         "vocab_size": served.vocab_size, "max_group_size": limits.max_group_size,
                         "lease_seconds": limits.lease_seconds, "lease": leases.status()}

        def _post(self):
            url = urlparse(self.path)
            if url.path == "/generate":
                prompt_ids, group_size, seeds, settings = check_generate(
                    self._json(), served.vocab_size, sampler.max_model_len, limits.max_group_size)
                with engine:
                    completions, logprobs = sampler.generate(prompt_ids, group_size, seeds, settings)
                    version = state["version"]
                return 200, {"completions": completions, "logprobs": logprobs, "weights_version": version}
            if url.path == "/lease":
                claim = self._json(2**16)
                holder = claim.get("holder") if isinstance(claim, dict) else None
                token = leases.claim(holder if isinstance(holder, dict) else {})
                say(f"lease taken by {describe(leases.holder)}")
                return 200, {"lease": token, "seconds": limits.lease_seconds}
            if url.path == "/lease/renew":
                self._body(2**16)
                leases.check(self.headers.get("X-Lease"))
                return 200, {"seconds": limits.lease_seconds}
            if url.path == "/lease/release":
                self._body(2**16)
                holder = leases.status().get("holder", {})
                leases.release(self.headers.get("X-Lease"))
                say(f"lease released by {describe(holder)}")
                return 200, {}
            if url.path == "/weights":
                return self._weights(url)
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
            with pushing:
                push = state["push"]
                if part == 0 or push is None or push.token != token:
                    push = state["push"] = WeightPush(served.spec, token)
                try:
                    push.add(part, body)
                    weights = push.complete() if last else None
                except Refused:
                    state["push"] = None  # the push in progress is dropped whole; the engine keeps its weights
                    raise
                if not last:
                    return 200, {"received": len(push.tensors)}
                state["push"] = None
            started = time.perf_counter()
            with engine:
                sampler.load_named(iter(weights.items()))
                state["version"] += 1
                version = state["version"]
            return 200, {"weights_version": version, "seconds": time.perf_counter() - started}

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def serve(config, log=print) -> None:
    """``auto-research vllm-serve``: load the model, start the engine, answer until interrupted."""
    from auto_research.engine.models import context_length, load_policy, resolve_device, resolve_dtype
    from auto_research.engine.rollout.vllm import VLLMSampler, check_servable

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
    check_servable(model.config, device, name, "vllm-serve", "serve it from a GPU, or train with --sampler builtin")
    memory = config.vllm_memory or (0.05 if device == "cpu" else 0.3)
    longest = config.max_model_len or min(context_length(model) or 4096, 4096)
    dtype = resolve_dtype(config.dtype, device)
    settings = SamplingSettings(max_new_tokens=16)
    log(f"starting a vLLM engine for {name} ({memory:g} of the "
        f"{'host memory for its KV cache' if device == 'cpu' else 'device memory'}, max_model_len {longest})")
    sampler = VLLMSampler(model, tokenizer, settings, memory, dtype, longest, config.seed)
    served = Served(name, fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, dtype)),
                    int(model.config.vocab_size), str(dtype).removeprefix("torch."))
    limits = Limits(api_key, config.lease_seconds, config.read_timeout, config.max_group_size)
    server = make_server(sampler, served, config.host, config.port, limits, log)
    del model
    log(f"serving {name} on http://{config.host}:{server.server_address[1]} "
        f"({'API key required, ' if api_key else ''}a trainer's lease lapses {config.lease_seconds:g} s after its "
        "last renewal; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# --- the trainer's side -------------------------------------------------------------------------------


class VLLMServerSampler:
    """The Sampler seam over a vLLM server (see the module docstring). Rank 0 holds the server's lease for the
    run's life (renewed by its pushes and a heartbeat) and releases it in ``close``."""

    def __init__(self, model, tokenizer, settings: SamplingSettings, address: str, model_name: str, world,
                 run_dir, timeout: float = 600.0, retries: int = 3):
        host, port = split_address(address)
        self.base, self.address = f"http://{host}:{port}", address
        self.tokenizer, self.settings, self.world = tokenizer, settings, world
        self.timeout, self.retries = timeout, retries
        self.eos = eos_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        key = os.environ.get(API_KEY_VARIABLE)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            health = json.loads(request(self.base + "/health", None, "application/json", 10.0, 1, 0.5,
                                        self.headers))
        except RequestFailed as error:
            if error.status == 401:
                raise UserError(f"--vllm-server {address} wants an API key: set {API_KEY_VARIABLE} to the key the "
                                "server was started with") from None
            raise UserError(f"--vllm-server {address}: no vLLM server answers there ({error}); start one with "
                            f"auto-research vllm-serve --model {model_name} --port {port}") from None
        except ValueError:
            raise UserError(f"--vllm-server {address}: what answers there is not a vLLM server") from None
        config = model.get_base_model().config if hasattr(model, "peft_config") else model.config
        if health.get("fingerprint") != fingerprint(config, tokenizer):
            raise UserError(f"--vllm-server {address} serves {health.get('model')!r}, another model than --model "
                            f"{model_name} (a different architecture or tokenizer)")
        self.dtype = getattr(torch, health.get("dtype", "float32"))
        self.lease, self.lease_seconds, self._stop = None, float(health.get("lease_seconds", 60)), threading.Event()
        self.world.agree(self._claim(run_dir) if world.main else None)
        self.weight_sync_seconds = 0.0
        self.load_weights(model)

    def _claim(self, run_dir) -> UserError | None:
        """Rank 0 takes the server's lease and starts its heartbeat; the refusal, for every rank to raise."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "run": str(Path(run_dir).resolve())}
        try:
            answer = self._call("/lease", json.dumps({"holder": holder}).encode())
        except UserError as error:
            return error
        self.lease, self.lease_seconds = answer["lease"], float(answer["seconds"])
        threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True).start()
        return None

    def _heartbeat(self) -> None:
        """Renew the lease a few times per its lapse time, whatever the step is doing; a lost lease shows at the
        next push (refused), so this thread only keeps trying."""
        while not self._stop.wait(self.lease_seconds / 4):
            with contextlib.suppress(UserError):
                self._call("/lease/renew", b"{}", retries=0)

    def close(self) -> None:
        """The run is over: stop the heartbeat and give the lease back (a server that is gone by now needs none)."""
        self._stop.set()
        if self.lease is not None:
            with contextlib.suppress(UserError):
                self._call("/lease/release", b"{}", retries=0)
            self.lease = None

    def _call(self, path: str, body: bytes, content_type: str = "application/json", retries: int | None = None
              ) -> dict:
        """The server's JSON answer; one line naming the server, the path and the last failure otherwise."""
        headers = {**self.headers, **({"X-Lease": self.lease} if self.lease else {})}
        try:
            answer = request(self.base + path, body, content_type, self.timeout,
                             self.retries if retries is None else retries, 0.5, headers)
        except RequestFailed as failed:
            if failed.status is not None and failed.status < 500:
                raise RolloutEngineError(f"--vllm-server {self.address} refused {path.split('?')[0]}: "
                                         f"{failed.detail or failed.failure}") from None
            raise RolloutEngineError(f"--vllm-server {self.address}: {path.split('?')[0]} failed ({failed.failure} "
                                     f"after {failed.attempts} attempt(s)); the server is gone or failing") from None
        return json.loads(answer)

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        prompt_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        s = self.settings
        answer = self._call("/generate", json.dumps({
            "prompt_ids": prompt_ids, "group_size": group_size, "seeds": [int(seed) for seed in seeds],
            "settings": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "top_k": s.top_k}}).encode())
        return build_rollout(self.tokenizer, self.eos, self.pad, prompt_ids, answer["completions"],
                             answer["logprobs"], group_size)

    def load_weights(self, model) -> None:
        """Every rank walks the weights (FSDP2 gathers one parameter at a time, in the same order on each);
        rank 0 sends them in parts under its lease; nobody samples before the server has them, and a failed
        push stops every rank."""
        from safetensors.torch import save  # noqa: PLC0415

        started = time.perf_counter()
        part, size, batch, seen, failure = 0, 0, {}, set(), None

        def send(last: bool) -> None:
            nonlocal part, size, batch, seen, failure
            try:
                self._call(f"/weights?part={part}&last={int(last)}", save(batch), "application/octet-stream")
            except UserError as error:
                failure = error
            part, size, batch, seen = part + 1, 0, {}, set()

        for name, tensor in pushed_weights(model, self.dtype):
            if not self.world.main or failure is not None:  # every rank still takes part in each gather
                continue
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # tied weights: safetensors keeps one name per storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            if size and size + tensor.numel() * tensor.element_size() > PART_BYTES:
                send(last=False)
            batch[name] = tensor
            size += tensor.numel() * tensor.element_size()
        if self.world.main and failure is None:
            send(last=True)
        self.world.agree(failure, RolloutEngineError)
        self.weight_sync_seconds = time.perf_counter() - started
