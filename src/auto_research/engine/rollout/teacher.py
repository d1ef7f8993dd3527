"""A served teacher for on-policy distillation (docs/distillation.md): a rollout server of the teacher's model scores
the policy's samples through ``/logprobs``. It holds no lease: it only reads, and needs only the server's key."""

from __future__ import annotations

import json
import time

from auto_research.engine.rollout.guard import MAX_REQUEST_TOKENS, slices
from auto_research.engine.rollout.served import health as served_health
from auto_research.engine.rollout.served import vocabulary
from auto_research.errors import RolloutEngineError, UserError
from auto_research.http import RequestFailed, authorization, request, split_address
from auto_research.http import api_key as http_api_key

AGAIN = (409, 429)
"""Answers that say "send it again": the server's other clients held too many tokens, or its lease holder pushed
weights between two slices of the request."""


class ServedTeacher:
    """A rollout server as the teacher. ``tokenizer``: the policy's, which must be the server's, else ``UserError``
    at once; ``api_key`` (default ``AUTO_RESEARCH_API_KEY``). ``weights_version``, ``instance``: its last answer's."""

    def __init__(self, address: str, tokenizer, timeout: float = 600.0, retries: int = 3, api_key: str | None = None):
        address = address.removeprefix("http://").rstrip("/")  # HOST:PORT, or http://HOST:PORT as --teacher-model
        host, port = split_address(address, "--teacher-model")
        self.base, self.address, self.timeout, self.retries = f"http://{host}:{port}", address, timeout, retries
        key = http_api_key(api_key, "the API key")
        self.headers = {"Authorization": authorization(key)} if key else {}
        where = f"--teacher-model {address}"
        health = served_health(self.base, self.headers, where,
                               f"auto-research rollout-serve --model TEACHER --port {port}")
        if health.get("vocabulary") != vocabulary(tokenizer):
            raise UserError(f"{where} serves {health.get('model')!r}, whose tokenizer is not the policy's (or a server "
                            "too old to say): a teacher scores the policy's token ids")
        self.max_request_tokens = int(health.get("max_request_tokens", MAX_REQUEST_TOKENS))
        self.weights_version, self.instance = health.get("weights_version"), health.get("instance")

    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Each completion token's log-prob at temperature 1, a list per row, in requests that fit the server's bound;
        ``RolloutEngineError`` in one line when the server refuses, fails or is gone (the rows go unscored)."""
        prompts = [[int(token) for token in ids] for ids in prompt_ids]
        completions = [[int(token) for token in ids] for ids in completion_ids]
        values = []
        rows = [prompt + completion for prompt, completion in zip(prompts, completions)]
        for start, end in slices(rows, 1, 0, self.max_request_tokens):
            answer = self._call({"prompt_ids": prompts[start:end], "completion_ids": completions[start:end]})
            scores = answer.get("logprobs") if isinstance(answer, dict) else None
            if not isinstance(scores, list) or [len(row) for row in scores] != list(map(len, completions[start:end])):
                raise RolloutEngineError(f"--teacher-model {self.address}: /logprobs answered no log-prob a token")
            values += scores
            self.weights_version, self.instance = answer.get("weights_version"), answer.get("instance")
        return values

    def _call(self, body: dict):
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            try:
                return json.loads(request(self.base + "/logprobs", data, "application/json", self.timeout,
                                          self.retries, 0.5, self.headers))
            except RequestFailed as failed:
                if failed.status in AGAIN and attempt < self.retries:
                    time.sleep(1.0)  # the server's Retry-After
                    continue
                if failed.status is not None and failed.status < 500:
                    raise RolloutEngineError(f"--teacher-model {self.address} refused /logprobs: "
                                             f"{failed.detail or failed.failure}") from None
                raise RolloutEngineError(f"--teacher-model {self.address}: /logprobs failed ({failed.failure} after "
                                         f"{failed.attempts} attempt(s)); the server is gone or failing") from None
            except ValueError:
                raise RolloutEngineError(f"--teacher-model {self.address}: /logprobs answered what is not JSON") \
                    from None
