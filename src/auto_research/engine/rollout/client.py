"""The trainer's side of ``--rollout-mode server`` (the protocol: ``server.py``): rank 0 holds the server's lease for
the run's life and pushes the policy's weights after every optimizer step (``links.py``); every rank samples its own
prompts, carrying the lease so that the server draws them first. The lease is claimed with the run's secret
(``run_secret``, kept in its run folder): ``--resume`` so takes over the lease its SIGKILLed process left, at once."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import torch

from auto_research.engine.rollout import Rollout, SamplingSettings, eos_ids
from auto_research.engine.rollout.guard import MAX_REQUEST_TOKENS, slices
from auto_research.engine.rollout.links import AdapterLink, HttpLink, Offer, _attempt, choose_link
from auto_research.engine.rollout.served import fingerprint
from auto_research.engine.rollout.served import health as served_health
from auto_research.engine.rollout.remote import adapter_factors, pushed_weights, sample_by_ids, tied_weights
from auto_research.errors import RolloutEngineError, UserError
from auto_research.files import atomic_write_bytes
from auto_research.http import RequestFailed, authorization, is_loopback, request, split_address
from auto_research.http import api_key as http_api_key

SECRET_NAME = ".lease-secret"
HEARTBEAT_SECONDS = 5.0
"""The lease's renewal (the server's health check) comes at least this often, and waits this long for its answer."""
SILENT_BEATS = 2
"""Heartbeats in a row without an answer after which a server counts as stopped (``ServerSampler.answering``)."""


def run_secret(run_dir) -> str:
    """The run's lease secret from ``run_dir/.lease-secret``, made there (mode 0600) when missing, unreadable or
    readable by others (a secret others can read proves nothing)."""
    path = Path(run_dir) / SECRET_NAME
    with contextlib.suppress(OSError, UnicodeDecodeError):
        secret = path.read_text().strip()
        if len(secret) == 64 and not path.stat().st_mode & 0o077:
            return secret
    secret = secrets.token_hex(32)
    try:
        atomic_write_bytes(path, secret.encode(), private=True)
    except OSError as error:
        raise UserError(f"cannot write the run's lease secret to {path}: {error.strerror or error}") from None
    return secret


class ServerSampler:
    """The Sampler seam over a rollout server. ``chunk_prompts``: prompts per request (the builtin engine's batches
    then have the trainer's own shapes on any number of ranks); ``engine``: for the line that says how to start one;
    ``api_key`` (default: ``AUTO_RESEARCH_API_KEY``)."""

    streams = False

    def __init__(self, model, tokenizer, settings: SamplingSettings, address: str, model_name: str, world,
                 run_dir, timeout: float = 600.0, retries: int = 3, shared: bool = True, engine: str = "vllm",
                 chunk_prompts: int | None = None, api_key: str | None = None, sync: str = "auto"):
        host, port = split_address(address)
        self.base, self.address = f"http://{host}:{port}", address
        self.tokenizer, self.settings, self.world = tokenizer, settings, world
        self.timeout, self.retries, self.chunk_prompts = timeout, retries, chunk_prompts
        self.eos = eos_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        key = http_api_key(api_key, "the API key")
        self.headers = {"Authorization": authorization(key)} if key else {}
        health = served_health(self.base, self.headers, f"--rollout-server {address}",
                               f"auto-research rollout-serve --engine {engine} --model {model_name} --port {port}")
        config = model.get_base_model().config if hasattr(model, "peft_config") else model.config
        if health.get("fingerprint") != fingerprint(config, tokenizer):
            raise UserError(f"--rollout-server {address} serves {health.get('model')!r}, another model than --model "
                            f"{model_name} (a different architecture or tokenizer)")
        self.dtype = getattr(torch, health.get("dtype", "float32"))
        self.max_request_tokens = int(health.get("max_request_tokens", MAX_REQUEST_TOKENS))
        self.lease, self.lease_seconds, self._stop = None, float(health.get("lease_seconds", 60)), threading.Event()
        """``lease``: rank 0's, sent by every rank (its requests go first); rank 0 alone renews and releases it."""
        self.unanswered = 0
        """Heartbeats in a row that got no answer (``answering``)."""
        self.link, self.transfer = None, "HTTP"
        """Rank 0's way for the weights to the server (``links.py``: its shared buffer, a group with it, HTTP)."""
        self.device = next(model.parameters()).device
        self.tied = tied_weights(model)
        """Weights the policy ties (``remote.tied_weights``): a group or a shared buffer takes them once."""
        self.world.agree(self._claim(run_dir, sync, shared, health.get("collective")) if world.main else None)
        self.lease = self.world.gather_objects(self.lease)[0]
        self.weight_sync_seconds, self.pushed_bytes = 0.0, 0
        """The last push's time, and the bytes of tensors it sent."""
        self.adapters = bool(health.get("adapters")) and health.get("dtype") == "float32"
        """The server merges a LoRA run's adapter itself: after the base weights once, only the adapter is pushed."""
        self.base_pushed = False
        self.partial = bool(health.get("partial"))
        """The server decodes partial rollouts (``partial_serve.py``: a builtin or vLLM server of this version)."""
        # Every draw must come from the weights this run pushed: the server's life and its version after them.
        self.instance, self.version = health.get("instance"), int(health.get("weights_version", 0))
        self.load_weights(model)

    def _claim(self, run_dir, sync: str, shared: bool, collective) -> UserError | None:
        """Rank 0 takes the lease, chooses the weights' path and starts its heartbeat; the refusal, for every rank."""
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "run": str(Path(run_dir).resolve())}
        try:
            claim = {"holder": holder, "secret": run_secret(run_dir)}
            answer = self._call("/lease", json.dumps(claim).encode())
            self.lease, self.lease_seconds = answer["lease"], float(answer["seconds"])
            threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True).start()
            host, port = split_address(self.address)
            offer = Offer(answer.get("shared") if shared else None, collective, host, port, is_loopback(host))
            self.link = choose_link(self, sync, offer)
        except UserError as error:
            return error
        self.transfer = self.link.transfer
        return None

    def _heartbeat(self) -> None:
        """Renew the lease a few times per its lapse time, whatever the step is doing (a lost lease shows at the next
        push), counting the renewals in a row that got no answer (``answering``)."""
        while not self._stop.wait(min(self.lease_seconds / 4, HEARTBEAT_SECONDS)):
            try:
                request(self.base + "/lease/renew", b"{}", "application/json", HEARTBEAT_SECONDS, 0, 0.5,
                        self._lease_headers())
                self.unanswered = 0
            except RequestFailed as failed:  # a refusal (a lapsed lease) is an answer; a 5xx or silence is not
                answered = failed.status is not None and failed.status < 500
                self.unanswered = 0 if answered else self.unanswered + 1

    @property
    def answering(self) -> bool:
        """False once ``SILENT_BEATS`` heartbeats in a row got no answer at all (rank 0's view; True elsewhere)."""
        return self.unanswered < SILENT_BEATS

    def abandon(self) -> str | None:
        """Leave the server without a word (it failed or stopped answering), the lease left to lapse; returns it."""
        self._stop.set()
        if self.link is not None:
            self.link.close()
        lease, self.lease, self.link = self.lease, None, None
        return lease

    def give_back(self, lease: str | None) -> None:
        """At the run's end, the lease of a server ``abandon`` left (it may only have been slow), in one try of 5 s."""
        if lease and self.world.main:
            with contextlib.suppress(RequestFailed):
                request(self.base + "/lease/release", b"{}", "application/json", 5, 0, 0.5,
                        {**self.headers, "X-Lease": lease})

    def close(self) -> None:
        """The run is over: give the lease back (where the server still answers), then leave as ``abandon`` does."""
        self._stop.set()
        if self.lease is not None and self.world.main:
            with contextlib.suppress(UserError):
                self._call("/lease/release", b"{}", retries=0)
        self.abandon()

    def _lease_headers(self) -> dict:
        return {**self.headers, **({"X-Lease": self.lease} if self.lease else {})}

    def _call(self, path: str, body: bytes, content_type: str = "application/json", retries: int | None = None
              ) -> dict:
        """The server's JSON answer; one line naming the server, the path and the last failure otherwise."""
        return json.loads(self._answer(path, body, content_type, retries))

    def _answer(self, path: str, body: bytes, content_type: str = "application/json", retries: int | None = None
                ) -> bytes:
        """The server's answer, as bytes (``_call``)."""
        try:
            answer = request(self.base + path, body, content_type, self.timeout,
                             self.retries if retries is None else retries, 0.5, self._lease_headers())
        except RequestFailed as failed:
            if failed.status is not None and failed.status < 500:
                raise RolloutEngineError(f"--rollout-server {self.address} refused {path.split('?')[0]}: "
                                         f"{failed.detail or failed.failure}") from None
            raise RolloutEngineError(f"--rollout-server {self.address}: {path.split('?')[0]} failed ({failed.failure} "
                                     f"after {failed.attempts} attempt(s)); the server is gone or failing") from None
        return answer

    # --- partial rollouts (--in-flight-updates; partial_serve.py) ---------------------------------------------------

    def partial_round(self, body: dict) -> dict:
        """One round of the server's continuous batch, on the weights this run pushed last."""
        answer = self._call("/partial/round", json.dumps({**body, "weights_version": self.version}).encode())
        self._check_drawn_by_this_run(answer)
        return answer

    def partial_state(self, number: int) -> tuple[dict, dict]:
        """The server's partial rollouts as round ``number`` left them: tensors and plain values."""
        from auto_research.engine.rollout.partial_serve import read_state  # noqa: PLC0415
        from auto_research.engine.rollout.guard import Refused  # noqa: PLC0415

        body = self._answer("/partial/state", json.dumps({"round": number}).encode())
        try:
            return read_state(body)
        except Refused as refused:
            raise RolloutEngineError(f"--rollout-server {self.address}: {refused.message}") from None

    def partial_restore(self, tensors: dict, plain: dict) -> None:
        """A checkpoint's partial rollouts back into the server (``--resume``)."""
        import safetensors.torch  # noqa: PLC0415

        self._call("/partial/restore", safetensors.torch.save(tensors, metadata={"plain": json.dumps(plain)}),
                   "application/octet-stream")

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        return sample_by_ids(self, prompts, group_size, seeds)

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int]
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """``group_size`` completions of each prompt and their log-probs, in requests that fit the server's bound."""
        s, chunk = self.settings, self.chunk_prompts or len(prompt_ids)
        completions, logprobs = [], []
        parts = [(begin + start, begin + end) for begin in range(0, len(prompt_ids), chunk)
                 for start, end in slices(prompt_ids[begin: begin + chunk], group_size, s.max_new_tokens,
                                          self.max_request_tokens)]
        for start, end in parts:
            answer = self._call("/generate", json.dumps({
                "prompt_ids": prompt_ids[start: end], "group_size": group_size,
                "seeds": [int(seed) for seed in seeds[start: end]],
                "settings": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                             "top_k": s.top_k}}).encode())
            self._check_drawn_by_this_run(answer)
            completions += answer["completions"]
            logprobs += answer["logprobs"]
        return completions, logprobs

    def _check_drawn_by_this_run(self, answer: dict) -> None:
        """A server restarted since the last push would sample from its initial weights (another policy's samples):
        refused by the server's instance and version."""
        if answer.get("instance") != self.instance:
            raise RolloutEngineError(f"--rollout-server {self.address} restarted since this run pushed its weights "
                                     "(its samples would come from another policy)")
        if answer.get("weights_version") != self.version:
            raise RolloutEngineError(f"--rollout-server {self.address} samples with weights version "
                                     f"{answer.get('weights_version')}, not {self.version}, the one this run pushed "
                                     "last (another process changed them)")

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], settings: SamplingSettings | None = None
                     ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt of token ids (``envs.trajectory``), with the run's settings (the same object)."""
        return self.generate([[int(token) for token in ids] for ids in prompt_ids], 1, seeds)

    def load_weights(self, model) -> None:
        """The policy's weights into the server. A LoRA policy and a server that merges adapters (the builtin
        engine): the base weights once, then only the adapter (a few percent of the bytes); otherwise the merged
        weights. A failed push stops every rank."""
        started = time.perf_counter()
        factors = adapter_factors(model) if self.adapters else None  # every rank: FSDP2 gathers
        self.pushed_bytes = 0
        if factors is None or not self.base_pushed:
            self.pushed_bytes = self._push(self.link or HttpLink(self._call),
                                           pushed_weights(model, self.dtype, factors is None))
        if factors is not None:
            self.pushed_bytes += self._push(AdapterLink(self._call), factors.items())
            self.base_pushed = True
        self.weight_sync_seconds = time.perf_counter() - started

    def _push(self, link, named) -> int:
        """Every rank walks the tensors (FSDP2 gathers them one at a time), rank 0 sends them through ``link``, every
        rank learns whether they went in. The bytes sent (rank 0's count)."""
        sent, link = 0, link if self.world.main else None
        failure = None if link is None else _attempt(link.begin)
        for name, tensor in named:
            if link is None or failure is not None:  # every rank still takes part in each gather
                continue
            sent += tensor.numel() * tensor.element_size()
            failure = _attempt(link.send, name, tensor)
        if link is not None:
            failure = link.finish(failure)
        self.world.agree(failure, RolloutEngineError)
        self.version += 1  # the push went in on rank 0 (every rank knows: agree raised otherwise)
        return sent
