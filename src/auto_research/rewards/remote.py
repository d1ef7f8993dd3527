"""A reward served elsewhere (``--reward-url http://HOST:PORT/PATH``; the protocol: docs/generation-level.md).
One JSON POST per ``batch_size`` completions, at most ``concurrency`` in flight, retried with backoff; one that
keeps failing, a 4xx, or a malformed answer is a ``RewardError``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from auto_research.errors import RewardError, UserError
from auto_research.http import RequestFailed, request


class RemoteReward:
    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 0.5,
                 concurrency: int = 4, batch_size: int = 256):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UserError(f"--reward-url {url!r}: expected http://HOST:PORT/PATH")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.concurrency, self.batch_size = concurrency, batch_size

    def __call__(self, prompts, completions, examples) -> list[float | None]:
        rows = [{**example.fields, "answer": example.answer} for example in examples]
        keys = sorted({key for row in rows for key in row} - {"prompt"})
        spans = [(start, min(start + self.batch_size, len(completions)))
                 for start in range(0, len(completions), self.batch_size)]

        def body(start: int, stop: int) -> dict:
            return {"prompts": list(prompts[start:stop]), "completions": list(completions[start:stop]),
                    "columns": {key: [row.get(key) for row in rows[start:stop]] for key in keys}}

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(spans)))) as pool:
            parts = list(pool.map(lambda span: self._post(body(*span), span[1] - span[0]), spans))
        return [value for part in parts for value in part]

    def _post(self, payload: dict, count: int) -> list:
        try:
            body = request(self.url, json.dumps(payload).encode(), "application/json", self.timeout, self.retries,
                           self.backoff)
        except RequestFailed as failed:
            raise RewardError(f"--reward-url {self.url}: {failed.failure} after {failed.attempts} attempt(s) "
                              f"(timeout {self.timeout:g} s)") from None
        return self._parse(body.decode(), count)

    def _parse(self, text: str, count: int) -> list:
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            raise RewardError(f"--reward-url {self.url}: the answer is not JSON ({text[:60]!r})") from None
        if isinstance(values, dict):
            values = values.get("rewards")
        if not isinstance(values, list) or len(values) != count:
            raise RewardError(f"--reward-url {self.url}: expected a list of {count} numbers or nulls, got "
                              f"{json.dumps(values)[:60]}")
        return values
