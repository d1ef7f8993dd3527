"""One HTTP request with retries, for the clients of servers we do not run in this process (a reward server,
a vLLM server): a request that times out, is refused, is dropped or gets a 5xx answer is retried with
exponential backoff; a 4xx is not (the server refused the request itself: retrying sends the same)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class RequestFailed(Exception):
    """The last failure, in a few words, and how many attempts were made."""

    def __init__(self, failure: str, attempts: int):
        super().__init__(failure)
        self.failure, self.attempts = failure, attempts


def _http_failure(error: urllib.error.HTTPError) -> str:
    """``HTTP 400 Bad Request``, with the server's own reason when it answered JSON ``{"error": ...}``."""
    failure = f"HTTP {error.code} {error.reason}"
    try:
        detail = json.loads(error.read()).get("error")
    except (ValueError, AttributeError, OSError):
        detail = None
    return f"{failure}: {str(detail)[:200]}" if detail else failure


def request(url: str, data: bytes | None, content_type: str, timeout: float, retries: int,
            backoff: float) -> bytes:
    """The answer's body; ``RequestFailed`` once ``retries`` more attempts have failed too."""
    failure = "no attempt"
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        sent = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(sent, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            failure = _http_failure(error)
            if error.code < 500:
                break
        except (urllib.error.URLError, OSError, TimeoutError) as error:  # refused, dropped, timed out
            failure = str(getattr(error, "reason", error)) or type(error).__name__
    raise RequestFailed(failure, attempt + 1)
