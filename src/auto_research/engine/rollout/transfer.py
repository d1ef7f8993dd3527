"""How a trainer's weights reach a rollout server: over HTTP in checked safetensors parts (any two hosts), or,
when trainer and server share a host, through a buffer in shared memory that the trainer writes in place
(docs/vllm.md, "Weights on the same host").

The shared path: with each lease the server makes a file in ``/dev/shm`` (mode 0600) of a header holding a random
nonce, then one slot per tensor. The trainer maps it and checks the nonce's hash (another host or user: HTTP
instead), copies each tensor into its slot and posts ``{"nonce", "names", "checksums"}`` to ``/weights/shared``.
The server checks the lease, the nonce, that every expected name was written once, every slot's checksum (a change
after the trainer's copy, by another process of the same user, is refused, finite or not) and finiteness; only then
does the engine reload from views of the file. A write racing the reload itself is not seen here: the trainer's
``--max-rollout-mismatch`` bound catches what such weights draw. A tied weight (SmolLM2's lm_head: 17% of its
bytes) is written once, named under ``"tied"``. The file goes with the lease or the server; one left by a
SIGKILLed server is removed by the next one started on the host (``sweep``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import mmap
import os
import secrets
import threading
from contextlib import suppress
from pathlib import Path

import torch
import xxhash

from auto_research.engine.rollout.guard import ITEMSIZE, Refused, WeightPush, all_finite, check_ties
from auto_research.errors import RolloutEngineError, is_decimal

SHARED_FOLDER = Path("/dev/shm")
PREFIX = "auto-research-weights-"
MAGIC = b"auto-research weights v1\n"
HEADER = 4096
ALIGN = 64


def layout(spec: dict) -> tuple[list, int]:
    """``[[name, offset, shape, dtype], ...]`` in name order after the header, each slot aligned; the file's size."""
    slots, offset = [], HEADER
    for name in sorted(spec):
        shape, dtype = spec[name]
        slots.append([name, offset, list(shape), dtype])
        offset += -(-math.prod(shape) * ITEMSIZE[dtype] // ALIGN) * ALIGN
    return slots, offset


def _views(buffer: mmap.mmap, slots: list) -> dict:
    """A tensor over each slot of the mapped file: writing one writes the file."""
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    return {name: whole[offset: offset + math.prod(shape) * ITEMSIZE[dtype]].view(getattr(torch, dtype)).view(shape)
            for name, offset, shape, dtype in slots}


def checksum(slot: torch.Tensor) -> str:
    """XXH3-64 of a contiguous tensor's bytes, in hex. Not cryptographic: it tells a slot changed after the trainer's
    copy. Chosen for speed (4x zlib.crc32's, 11x sha1's on SmolLM2's slots: ``benchmarks/checksum.py``)."""
    return xxhash.xxh3_64_hexdigest(slot.reshape(-1).view(torch.uint8).numpy())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(folder: Path = SHARED_FOLDER) -> list[Path]:
    """Remove the buffers of servers that are gone (SIGKILLed: nothing else could clean up); those removed."""
    removed = []
    with suppress(OSError):
        for path in folder.glob(PREFIX + "*"):
            pid = path.name.removeprefix(PREFIX).split("-")[0]
            if is_decimal(pid) and not _pid_alive(int(pid)):
                with suppress(OSError):
                    path.unlink()
                    removed.append(path)
    return removed


def with_ties(tensors: dict, tied: dict, spec: dict) -> dict:
    """Every served weight in the spec's order, a tied one as its source's very tensor (a push that sent it once)."""
    return {name: tensors[tied.get(name, name)] for name in spec}


class SharedBuffer:
    """The server's side: one file for one lease."""

    def __init__(self, spec: dict, token: str, folder: Path = SHARED_FOLDER):
        self.spec, self.token = spec, token
        self.slots, size = layout(spec)
        self.nonce = secrets.token_hex(32)
        self.path = Path(folder) / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved now: a full /dev/shm (a container's 64 MiB) means HTTP, not a SIGBUS in the trainer mid-write.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(descriptor, 0, size)
            else:
                os.ftruncate(descriptor, size)
            os.pwrite(descriptor, MAGIC + self.nonce.encode(), 0)
            self.buffer = mmap.mmap(descriptor, size)
        except OSError:
            self.path.unlink()
            raise
        finally:
            os.close(descriptor)
        self.views = _views(self.buffer, self.slots)

    def offer(self) -> dict:
        return {"path": str(self.path), "nonce_sha256": hashlib.sha256(self.nonce.encode()).hexdigest(),
                "slots": self.slots, "ties": True}

    def take(self, body) -> dict:
        """The written tensors (views of the file) once every check passes, or ``Refused``."""
        if not isinstance(body, dict) or not isinstance(body.get("nonce"), str) or not isinstance(body.get("names"),
                                                                                                     list):
            raise Refused(400, 'a shared push is {"nonce": "...", "names": [every tensor written]}')
        if not hmac.compare_digest(body["nonce"].encode(), self.nonce.encode()):
            raise Refused(400, "the nonce is not the one in this lease's shared buffer: the trainer does not see the "
                               "server's file (another host?); push the weights over HTTP")
        names = body["names"]
        for name in names:
            if name not in self.spec:
                raise Refused(400, f"unknown tensor {str(name)!r}: the served model has no weight of that name"[:300])
        tied = check_ties(body.get("tied", {}), self.spec)  # not written: their sources' slots are loaded under them
        if len(set(names)) < len(names) or set(names) & set(tied):
            twice = next(name for name in names if names.count(name) > 1 or name in tied)
            raise Refused(400, f"tensor {twice!r} was sent twice in one push")
        WeightPush(self.spec, self.token, tensors=dict.fromkeys([*names, *tied])).complete()  # Refused: those missing
        self._verify(names, body.get("checksums"))
        for name in names:
            if not all_finite(self.views[name]):
                raise Refused(400, f"tensor {name!r} has NaN or infinite values")
        return with_ties(self.views, tied, self.spec) if tied else self.views

    def _verify(self, names: list, checksums) -> None:
        """Every slot holds what the trainer wrote there (its checksum), else ``Refused(400)``."""
        if (not isinstance(checksums, list) or len(checksums) != len(names)
                or not all(isinstance(value, str) for value in checksums)):
            raise Refused(400, 'a shared push carries "checksums": one per name, each slot\'s as the trainer wrote it')
        for name, expected in zip(names, checksums):
            if not hmac.compare_digest(checksum(self.views[name]).encode(), expected.encode()):
                raise Refused(400, f"tensor {name!r} in the shared buffer is not what the trainer wrote (its checksum "
                                   f"differs: another process wrote to {self.path}); the engine keeps its weights")

    def close(self) -> None:
        with suppress(OSError):
            self.path.unlink()
        self.views = {}
        with suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
            self.buffer.close()


class Intake:
    """The server's weight pushes, both paths: the HTTP parts in progress and the shared buffer of the lease."""

    def __init__(self, spec: dict, folder: Path | None = SHARED_FOLDER):
        self.spec, self.folder = spec, folder
        self.lock = threading.Lock()
        self.push: WeightPush | None = None
        self.shared: SharedBuffer | None = None
        if folder is not None:
            sweep(folder)

    def offer(self, token: str) -> dict | None:
        """A fresh buffer for a new lease (the previous one's goes); None where shared memory is not to be had."""
        with self.lock:
            self._close_shared()
            if self.folder is None or not Path(self.folder).is_dir():
                return None
            try:
                self.shared = SharedBuffer(self.spec, token, self.folder)
            except OSError:
                return None
            return self.shared.offer()

    def part(self, token: str, part: int, last: bool, body: bytes) -> dict | None:
        """An HTTP part checked and kept; at the last one, every tensor of the push (else None)."""
        with self.lock:
            push = self.push
            if part == 0 or push is None or push.token != token:
                push = self.push = WeightPush(self.spec, token)
            try:
                push.add(part, body)
                weights = push.complete() if last else None
            except Refused:
                self.push = None  # the push in progress is dropped whole; the engine keeps its weights
                raise
            if last:
                self.push = None
            return weights

    def received(self) -> int:
        return len(self.push.tensors) if self.push is not None else 0

    def take_shared(self, token: str, body):
        """The shared buffer's views, checked: to be loaded under ``self.lock`` (held by the caller)."""
        if self.shared is None or self.shared.token != token:
            raise Refused(409, "this lease has no shared buffer (the server offers one with each lease, on hosts "
                               "with /dev/shm); push the weights over HTTP")
        return self.shared.take(body)

    def prune(self, live) -> None:
        with self.lock:
            if self.shared is not None and not live(self.shared.token):
                self._close_shared()

    def _close_shared(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def close(self) -> None:
        with self.lock:
            self._close_shared()


class SharedWriter:
    """The trainer's side: the server's file mapped, each tensor copied into its slot."""

    def __init__(self, offer: dict, tied: dict | None = None):
        """OSError or ValueError where the file is not the server's (HTTP then). ``tied``: weights not written."""
        descriptor = os.open(offer["path"], os.O_RDWR)
        try:
            size = os.fstat(descriptor).st_size
            head = os.pread(descriptor, len(MAGIC) + 64, 0)
            self.buffer = mmap.mmap(descriptor, size)
        finally:
            os.close(descriptor)
        nonce = head[len(MAGIC):].decode("ascii", "replace")
        if not head.startswith(MAGIC) or hashlib.sha256(nonce.encode()).hexdigest() != offer["nonce_sha256"]:
            self.buffer.close()
            raise ValueError(f"{offer['path']} here is not the server's buffer (another host's file of that name)")
        self.nonce, self.path = nonce, offer["path"]
        self.views, self.names, self.checksums = _views(self.buffer, offer["slots"]), [], []
        self.tied = dict(tied or {}) if offer.get("ties") else {}
        self.lock, self.closed = threading.Lock(), False
        """A push on one thread and ``close`` on another (a fleet's server left): a view written after its map closed
        would crash the process."""

    def write(self, name: str, tensor: torch.Tensor) -> None:
        with self.lock:
            if self.closed:
                raise RolloutEngineError("the push was abandoned: the server left the pool or the run closed")
            slot = self.views.get(name)
            if slot is None:
                raise RolloutEngineError(f"the server's model has no weight {name!r}")
            if name in self.tied:  # the server loads its source's slot under it
                return
            if slot.shape != tensor.shape or slot.dtype != tensor.dtype:
                raise RolloutEngineError(f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype}, the server's "
                                         f"slot {list(slot.shape)} {slot.dtype}")
            slot.copy_(tensor.detach())
            self.names.append(name)
            self.checksums.append(checksum(slot))  # read back from the file: what the server must find there

    def commit(self) -> bytes:
        """The request that hands the written tensors over; a new push starts."""
        body = json.dumps({"nonce": self.nonce, "names": self.names, "checksums": self.checksums,
                           **({"tied": self.tied} if self.tied else {})}).encode()
        self.names, self.checksums = [], []
        return body

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.views, self.names, self.checksums = {}, [], []
            with suppress(BufferError):
                self.buffer.close()
