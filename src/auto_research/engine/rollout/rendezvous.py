"""Where the two sides of a collective weight sync (``pushes.py``) find each other: a key-value store the trainer
hosts and the server reaches, in place of torch's TCPStore, which listened on every interface and asked nothing of
whoever connected (a stranger read its key count, set keys of its own and held a blocking wait). This store:

- listens on one address, the trainer's on the way to the server, as gloo's own listeners do (``gloo_device``);
- asks each connection a challenge first, an HMAC-SHA256 under ``link_key`` (from the lease, which only the trainer
  and the server hold, and the group's name); one that does not answer within ``AUTH_SECONDS`` is closed having read
  nothing else, and at most ``MAX_WAITING`` answer at once. The server challenges the trainer in turn.

Then a request is an operation byte and its parts (each a 4-byte length and its bytes), an answer a status byte
(0: done; 1: failed, its part the reason) and its parts; the keys live in a ``HashStore`` the trainer's rank uses.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

MAGIC = b"auto-research store 1\n"
AUTH_SECONDS = 5.0
"""How long a connection may take to answer the store's challenge before it is closed."""
MAX_WAITING = 8
"""Connections that may be answering the challenge at once; any more are closed as they come."""
MAX_PART = 2**20
"""The largest key or value a request may carry (the group's are a few hundred bytes)."""
MAX_PARTS = 64
OPERATIONS = {b"S": "set", b"G": "get", b"A": "add", b"C": "check", b"W": "wait", b"X": "compare_set",
              b"D": "delete_key", b"N": "num_keys"}


def link_key(lease: str, group: str) -> bytes:
    """The secret both sides answer challenges with, from the lease and the group's name (new for each link)."""
    return hmac.new(str(lease).encode(), b"auto-research collective store\0" + group.encode(), hashlib.sha256).digest()


def _mac(key: bytes, side: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, side + challenge, hashlib.sha256).digest()


def _exactly(connection: socket.socket, count: int, deadline: float | None = None) -> bytes:
    """``count`` bytes; by ``deadline`` (``time.monotonic``) when given, however slowly they trickle in."""
    data = b""
    while len(data) < count:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer in time")
            connection.settimeout(left)
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
    return data


def _send(connection: socket.socket, head: bytes, parts) -> None:
    connection.sendall(head + struct.pack("<I", len(parts))
                       + b"".join(struct.pack("<I", len(part)) + part for part in parts))


def _receive(connection: socket.socket, head_bytes: int = 1) -> tuple[bytes, list[bytes]]:
    head, (count,) = _exactly(connection, head_bytes), struct.unpack("<I", _exactly(connection, 4))
    if count > MAX_PARTS:
        raise ValueError(f"{count} parts in one message")
    parts = []
    for _ in range(count):
        (size,) = struct.unpack("<I", _exactly(connection, 4))
        if size > MAX_PART:
            raise ValueError(f"a part of {size} bytes")
        parts.append(_exactly(connection, size))
    return head, parts


def gloo_device(address: str):
    """A gloo device whose listener is on ``address`` alone (gloo's default took the host name's address)."""
    return dist.ProcessGroupGloo.create_device(hostname=address)


class StoreHost:
    """The trainer's side: the keys (``store``), served on ``address`` to connections that answer the challenge under
    ``key``; ``refused`` counts the connections closed unanswered."""

    def __init__(self, address: str, key: bytes, seconds: float):
        self.key, self.seconds = key, seconds
        self.store = dist.HashStore()
        self.store.set_timeout(datetime.timedelta(seconds=seconds))
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.listener = socket.create_server((address, 0), family=family, backlog=MAX_WAITING)
        self.listener.settimeout(0.5)  # (the accepting thread looks at ``closed`` this often)
        self.address, self.port = address, self.listener.getsockname()[1]
        self.refused, self.waiting, self.closed = 0, 0, False
        self.connections: set = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="collective-store", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            with self.lock:
                crowded = self.waiting >= MAX_WAITING or self.closed
                if crowded:
                    self.refused += 1
                else:
                    self.waiting += 1
                    self.connections.add(connection)
            if crowded:
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), name="collective-store-peer",
                             daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        answered = False
        try:
            deadline = time.monotonic() + AUTH_SECONDS
            connection.settimeout(AUTH_SECONDS)
            challenge = secrets.token_bytes(32)
            connection.sendall(MAGIC + challenge)
            answer = _exactly(connection, 64, deadline)
            if not hmac.compare_digest(answer[:32], _mac(self.key, b"client", challenge)):
                return
            connection.sendall(_mac(self.key, b"host", answer[32:]))
            answered = True
            with self.lock:
                self.waiting -= 1
            connection.settimeout(None)  # the peer answered: it may wait on keys, or idle, for the link's life
            while not self.closed:
                operation, parts = _receive(connection)
                try:
                    status, answer_parts = 0, self._do(OPERATIONS[operation], parts)
                except Exception as error:  # noqa: BLE001 - a timeout, an unknown operation: told to the peer
                    status, answer_parts = 1, [f"{type(error).__name__}: {error}"[:300].encode()]
                _send(connection, bytes([status]), answer_parts)
        except (OSError, ConnectionError, ValueError, KeyError, struct.error):
            pass
        finally:
            with self.lock:
                self.refused += not answered
                self.waiting -= not answered
                self.connections.discard(connection)
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _do(self, operation: str, parts: list[bytes]) -> list[bytes]:
        store = self.store
        if operation == "set":
            store.set(parts[0].decode(), parts[1])
            return []
        if operation == "get":
            return [store.get(parts[0].decode())]
        if operation == "add":
            return [str(store.add(parts[0].decode(), int(parts[1]))).encode()]
        if operation == "check":
            return [b"1" if store.check([part.decode() for part in parts]) else b"0"]
        if operation == "wait":
            store.wait([part.decode() for part in parts[1:]], datetime.timedelta(milliseconds=int(parts[0])))
            return []
        if operation == "compare_set":
            return [store.compare_set(parts[0].decode(), parts[1], parts[2])]
        if operation == "delete_key":
            return [b"1" if store.delete_key(parts[0].decode()) else b"0"]
        return [str(store.num_keys()).encode()]

    def close(self) -> None:
        """No more connections; those open are closed."""
        self.closed = True
        with contextlib.suppress(OSError):  # (a shutdown first: a close alone left it listening while the accepting
            self.listener.shutdown(socket.SHUT_RDWR)  # thread waited in it)
        with contextlib.suppress(OSError):
            self.listener.close()
        with self.lock:
            connections, self.connections = list(self.connections), set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class RemoteStore(dist.Store):
    """The server's side: the trainer's ``StoreHost`` at ``host:port``, once both answered each other's challenge
    under ``key`` (``ConnectionError`` otherwise)."""

    def __init__(self, host: str, port: int, key: bytes, seconds: float):
        super().__init__()
        self.lock, self.seconds = threading.Lock(), seconds
        self.connection = socket.create_connection((host, port), timeout=AUTH_SECONDS)
        deadline = time.monotonic() + AUTH_SECONDS
        try:
            greeting = _exactly(self.connection, len(MAGIC) + 32, deadline)
            if not greeting.startswith(MAGIC):
                raise ConnectionError("what answers there is not the trainer's store")
            ours = secrets.token_bytes(32)
            self.connection.sendall(_mac(key, b"client", greeting[len(MAGIC):]) + ours)
            if not hmac.compare_digest(_exactly(self.connection, 32, deadline), _mac(key, b"host", ours)):
                raise ConnectionError("the store did not answer this lease's challenge")
        except (OSError, ConnectionError):
            self.connection.close()
            raise ConnectionError("the trainer's store refused this lease's answer, or did not answer ours") from None
        self.connection.settimeout(seconds + 60)

    def _call(self, operation: bytes, *parts: bytes) -> list[bytes]:
        with self.lock:
            _send(self.connection, operation, list(parts))
            status, answer = _receive(self.connection)
        if status != b"\0":
            raise RuntimeError(f"the trainer's store: {answer[0].decode(errors='replace') if answer else 'failed'}")
        return answer

    @staticmethod
    def _bytes(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def set(self, key, value):
        self._call(b"S", key.encode(), self._bytes(value))

    def get(self, key):
        return self._call(b"G", key.encode())[0]

    def add(self, key, amount):
        return int(self._call(b"A", key.encode(), str(int(amount)).encode())[0])

    def check(self, keys):
        return self._call(b"C", *(key.encode() for key in keys))[0] == b"1"

    def wait(self, keys, timeout=None):
        milliseconds = int((timeout.total_seconds() if timeout is not None else self.seconds) * 1000)
        self._call(b"W", str(milliseconds).encode(), *(key.encode() for key in keys))

    def compare_set(self, key, expected, desired):
        return self._call(b"X", key.encode(), self._bytes(expected), self._bytes(desired))[0]

    def delete_key(self, key):
        return self._call(b"D", key.encode())[0] == b"1"

    def num_keys(self):
        return int(self._call(b"N")[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
