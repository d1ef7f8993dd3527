"""vLLM as the rollout engine in a process of its own (``--vllm-mode server``).

    auto-research vllm-serve --model M --port 8000            # one vLLM engine behind a small HTTP server
    auto-research post-train --model M --sampler vllm --vllm-mode server --vllm-server 127.0.0.1:8000

The protocol, all on one HTTP port (our own: vLLM's OpenAI server has no in-place weight push that works on
the CPU):

- ``GET /health`` → ``{"model", "fingerprint", "weights_version", "max_model_len"}``. The fingerprint hashes
  the architecture's shape and the tokenizer's vocabulary: a trainer whose ``--model`` differs is refused.
- ``POST /generate`` with ``{"prompt_ids", "group_size", "seeds", "settings"}`` (token ids, so both sides
  tokenize nothing differently; every sampling setting explicit) → ``{"completions", "logprobs",
  "weights_version"}``: vLLM's processed log-probs of the drawn tokens, as colocated.
- ``POST /weights?part=N&last=0|1`` with a safetensors body: the policy's weights in parts of at most
  ``PART_BYTES``, gathered one parameter at a time on the trainer (FSDP2 shards too); at the last part the
  engine reloads them in place and empties its prefix cache → ``{"weights_version", "seconds"}``.

Requests are served one at a time (one engine). Under torchrun every rank sends its own prompts (per-request
seeds make the draws independent of which rank asks) and rank 0 pushes the weights after every optimizer step,
with a barrier before anyone samples again. Weight transfer is HTTP on the CPU and on GPUs alike here (NCCL
between trainer and server is not built: see docs/vllm.md).
"""

from __future__ import annotations

import hashlib
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock
from urllib.parse import parse_qs, urlparse

import torch

from auto_research.engine.rollout import Rollout, SamplingSettings, eos_ids
from auto_research.engine.rollout.remote import build_rollout, pushed_weights
from auto_research.errors import UserError
from auto_research.http import RequestFailed, request

PART_BYTES = 256 * 2**20


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


def make_server(sampler, model_name: str, model_fingerprint: str, host: str, port: int):
    """An HTTP server in front of one engine (a ``VLLMSampler`` with ``generate`` and ``load_named``)."""
    from safetensors.torch import load  # noqa: PLC0415

    lock, state = Lock(), {"version": 0, "parts": {}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if urlparse(self.path).path != "/health":
                return self._answer(404, {"error": f"no such path {self.path}"})
            self._answer(200, {"model": model_name, "fingerprint": model_fingerprint,
                               "weights_version": state["version"], "max_model_len": sampler.max_model_len})

        def do_POST(self):
            url = urlparse(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if url.path == "/generate":
                    request = json.loads(body)
                    settings = SamplingSettings(**request["settings"])
                    with lock:
                        completions, logprobs = sampler.generate(request["prompt_ids"], int(request["group_size"]),
                                                                 [int(seed) for seed in request["seeds"]], settings)
                        version = state["version"]
                    return self._answer(200, {"completions": completions, "logprobs": logprobs,
                                              "weights_version": version})
                if url.path == "/weights":
                    query = parse_qs(url.query)
                    part, last = int(query["part"][0]), query.get("last", ["0"])[0] == "1"
                    with lock:
                        if part == 0:
                            state["parts"] = {}
                        state["parts"].update(load(body))
                        if not last:
                            return self._answer(200, {"received": len(state["parts"])})
                        started = time.perf_counter()
                        weights, state["parts"] = state["parts"], {}
                        sampler.load_named(iter(weights.items()))
                        state["version"] += 1
                        return self._answer(200, {"weights_version": state["version"],
                                                  "seconds": time.perf_counter() - started})
                return self._answer(404, {"error": f"no such path {url.path}"})
            except (KeyError, ValueError, TypeError) as error:
                return self._answer(400, {"error": f"{type(error).__name__}: {error}"})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(config, log=print) -> None:
    """``auto-research vllm-serve``: load the model, start the engine, answer until interrupted."""
    from auto_research.engine.models import context_length, load_policy, resolve_device, resolve_dtype
    from auto_research.engine.rollout.vllm import VLLMSampler, check_servable

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
    settings = SamplingSettings(max_new_tokens=16)
    log(f"starting a vLLM engine for {name} ({memory:g} of the "
        f"{'host memory for its KV cache' if device == 'cpu' else 'device memory'}, max_model_len {longest})")
    sampler = VLLMSampler(model, tokenizer, settings, memory, resolve_dtype(config.dtype, device), longest,
                          config.seed)
    server = make_server(sampler, name, fingerprint(model.config, tokenizer), config.host, config.port)
    del model
    log(f"serving {name} on http://{config.host}:{server.server_address[1]} (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# --- the trainer's side -------------------------------------------------------------------------------


class VLLMServerSampler:
    """The Sampler seam over a vLLM server (see the module docstring)."""

    def __init__(self, model, tokenizer, settings: SamplingSettings, address: str, model_name: str, world,
                 dtype: torch.dtype, timeout: float = 600.0, retries: int = 3):
        host, port = split_address(address)
        self.base, self.address = f"http://{host}:{port}", address
        self.tokenizer, self.settings, self.world, self.dtype = tokenizer, settings, world, dtype
        self.timeout, self.retries = timeout, retries
        self.eos = eos_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        try:
            health = json.loads(request(self.base + "/health", None, "application/json", 10.0, 1, 0.5))
        except (RequestFailed, ValueError) as error:
            raise UserError(f"--vllm-server {address}: no vLLM server answers there ({error}); start one with "
                            f"auto-research vllm-serve --model {model_name} --port {port}") from None
        config = model.get_base_model().config if hasattr(model, "peft_config") else model.config
        if health.get("fingerprint") != fingerprint(config, tokenizer):
            raise UserError(f"--vllm-server {address} serves {health.get('model')!r}, another model than --model "
                            f"{model_name} (a different architecture or tokenizer)")
        self.weight_sync_seconds = 0.0
        self.load_weights(model)

    def _call(self, path: str, body: bytes, content_type: str = "application/json") -> dict:
        """The server's JSON answer; one line naming the path and the last failure otherwise."""
        try:
            answer = request(self.base + path, body, content_type, self.timeout, self.retries, 0.5)
        except RequestFailed as failed:
            raise UserError(f"--vllm-server {self.address}: {path} failed ({failed.failure} after {failed.attempts} "
                            "attempt(s))") from None
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
        rank 0 sends them in parts; nobody samples before the server has them."""
        from safetensors.torch import save  # noqa: PLC0415

        started = time.perf_counter()
        part, size, batch, seen = 0, 0, {}, set()

        def send(last: bool) -> None:
            nonlocal part, size, batch, seen
            self._call(f"/weights?part={part}&last={int(last)}", save(batch), "application/octet-stream")
            part, size, batch, seen = part + 1, 0, {}, set()

        for name, tensor in pushed_weights(model, self.dtype):
            if not self.world.main:
                continue
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # tied weights: safetensors keeps one name per storage
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            if size and size + tensor.numel() * tensor.element_size() > PART_BYTES:
                send(last=False)
            batch[name] = tensor
            size += tensor.numel() * tensor.element_size()
        if self.world.main:
            send(last=True)
        self.world.barrier()
        self.weight_sync_seconds = time.perf_counter() - started
