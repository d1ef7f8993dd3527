"""One HTTP request with retries, for the clients of servers in other processes (a reward server, a vLLM server): a
timeout, a refusal, a dropped connection or a 5xx is retried with exponential backoff; a 4xx is not (retrying sends
the same). And the API key of our own servers (``Authorization: Bearer KEY``), checked alike on both sides."""

from __future__ import annotations

import http.client
import json
import os
import stat
import time
import urllib.error
import urllib.request

from auto_research.errors import UserError, is_decimal

API_KEY_VARIABLE = "AUTO_RESEARCH_API_KEY"
"""The shared secret, on the server and the trainer alike (a flag would land in config.yaml and shell history, and
in the process list: ``rollout-serve`` takes ``--api-key-file`` or this variable)."""
API_KEY_RULE = "an API key is 16 to 256 printable ASCII characters (letters, digits, punctuation, inner spaces)"
"""What ``check_api_key`` takes: a header any HTTP client sends as it is (curl, urllib and browsers differ on
anything beyond ASCII, and http.client refuses what is beyond Latin-1), and too long to guess."""


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


def api_key(given: str | None, flag: str) -> str | None:
    """The API key: ``given`` (a flag's or a caller's value) when set, else ``AUTO_RESEARCH_API_KEY``'s; checked
    (``check_api_key``), one line naming where it came from."""
    if given:
        return check_api_key(given, flag)
    return check_api_key(os.environ.get(API_KEY_VARIABLE), API_KEY_VARIABLE)


def check_api_key(key: str | None, source: str) -> str | None:
    """``key`` (None or empty: no key), or one line naming ``source`` and why when it is not ``API_KEY_RULE``'s
    (the line never shows the key)."""
    if not key:
        return None
    for position, character in enumerate(key, 1):
        if not " " <= character <= "~":
            what = ("a byte that is not UTF-8 text" if "\udc80" <= character <= "\udcff"  # (os.environ's escape)
                    else "a control character (a line break, a tab?)" if character < " " or character == "\x7f"
                    else f"a character beyond ASCII (U+{ord(character):04X})")
            raise UserError(f"{source} holds {what} at character {position}: {API_KEY_RULE}")
    if key != key.strip():
        raise UserError(f"{source} begins or ends with a space, which HTTP drops from a header: remove it")
    if not 16 <= len(key) <= 256:
        raise UserError(f"{source} is {len(key)} characters long: {API_KEY_RULE}")
    return key


def authorization(key: str) -> str:
    """The ``Authorization`` header's value for ``key`` (printable ASCII: ``check_api_key``)."""
    return f"Bearer {key}"


def split_address(address: str, flag: str = "--rollout-server") -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); one line for anything else."""
    host, _, port = str(address).rpartition(":")
    if not host or not is_decimal(port) or not 0 < int(port) < 65536:
        raise UserError(f"{flag} {address!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host, int(port)


def split_addresses(value: str, flag: str = "--rollout-server") -> list[str]:
    """``HOST:PORT[,HOST:PORT…]``, or the path of a file with one address a line (``#`` starts a comment), as a
    list of checked addresses, each once; one line for anything else."""
    text, source = str(value), None
    host, _, port = text.rpartition(":")
    if "," not in text and not (host and is_decimal(port)):  # not an address: a file of them
        path = os.path.expanduser(text)
        try:
            with open(path, encoding="utf-8") as file:
                text, source = file.read(), path
        except FileNotFoundError:
            if "/" not in text:  # not a path: an address mistyped ("localhost"), said as one
                split_address(text, flag)
            raise UserError(f"{flag} {value!r}: expected HOST:PORT, a list HOST:PORT,HOST:PORT or a file of "
                            "addresses, one a line (no such file)") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"{flag} {value!r}: cannot read this file of addresses "
                            f"({getattr(error, 'strerror', None) or error})") from None
    lines = [line.split("#", 1)[0] for line in text.splitlines()] if source is not None else [text]
    addresses = [part.strip() for line in lines for part in line.split(",") if part.strip()]
    if not addresses:
        raise UserError(f"{flag} {value!r}: no address in it" + (f" ({source} is empty)" if source else ""))
    for address in addresses:
        split_address(address, flag)
    repeated = sorted({address for address in addresses if addresses.count(address) > 1})
    if repeated:
        raise UserError(f"{flag}: {', '.join(repeated)} given twice (one lease per server and run)")
    return addresses


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is this machine's loopback."""
    import ipaddress  # noqa: PLC0415
    import socket  # noqa: PLC0415

    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (OSError, ValueError):
        return False


def server_key(key_file: str | None) -> str | None:
    """``rollout-serve``'s key: the text of ``--api-key-file`` (a file its owner alone may read; one line end
    dropped), else ``AUTO_RESEARCH_API_KEY``'s; checked (``check_api_key``)."""
    if key_file is None:
        return api_key(None, "")
    where = f"--api-key-file {key_file}"
    path = os.path.expanduser(key_file)
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # (a FIFO would hold the start until something wrote to it)
            raise UserError(f"{where} is not a file")
        if mode & 0o077:
            raise UserError(f"{where} may be read by other users (mode {stat.S_IMODE(mode):04o}): make it its "
                            f"owner's alone (chmod 600 {key_file})")
        with open(path, "rb") as file:
            raw = file.read(4096)
    except OSError as error:
        raise UserError(f"cannot read {where}: {error.strerror or error}") from None
    text = raw.decode("utf-8", "surrogateescape").removesuffix("\n").removesuffix("\r")
    if not text:
        raise UserError(f"{where} is empty: write the key in it")
    return check_api_key(text, where)
