"""One HTTP request with retries, for the clients of servers we do not run in this process (a reward server,
a vLLM server): a request that times out, is refused, is dropped or gets a 5xx answer is retried with
exponential backoff; a 4xx is not (the server refused the request itself: retrying sends the same)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request


class RequestFailed(Exception):
    """The last failure, in a few words, and how many attempts were made."""

    def __init__(self, failure: str, attempts: int, status: int | None = None, detail: str | None = None):
        super().__init__(failure)
        self.failure, self.attempts = failure, attempts
        self.status, self.detail = status, detail
        """The last answer's HTTP status and the server's own reason (its JSON ``{"error": ...}``), if any."""


def _server_reason(error: urllib.error.HTTPError) -> str | None:
    try:
        detail = json.loads(error.read()).get("error")
    except (ValueError, AttributeError, OSError):
        detail = None
    return None if detail is None else str(detail)


def request(url: str, data: bytes | None, content_type: str, timeout: float, retries: int,
            backoff: float, headers: dict | None = None) -> bytes:
    """The answer's body; ``RequestFailed`` once ``retries`` more attempts have failed too."""
    failure, status, detail = "no attempt", None, None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        sent = urllib.request.Request(url, data=data, headers={"Content-Type": content_type, **(headers or {})})
        try:
            with urllib.request.urlopen(sent, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            status, detail = error.code, _server_reason(error)
            # ``HTTP 400 Bad Request``, with the server's own reason when it gave one.
            failure = f"HTTP {error.code} {error.reason}" + (f": {detail[:200]}" if detail else "")
            if error.code < 500:
                break
        except (urllib.error.URLError, OSError, TimeoutError, http.client.HTTPException) as error:
            # refused, dropped (mid-answer too: IncompleteRead, a server killed while it answered), timed out
            failure, status, detail = str(getattr(error, "reason", error)) or type(error).__name__, None, None
    raise RequestFailed(failure, attempt + 1, status, detail)
