"""How a trainer's weights reach a rollout server: one class a path (``WeightLink``), each opened from what the two
ends declare (``Offer``; the trainer's device and tied weights), in a registry (``LINKS``): a new transport is a
class and its line there. ``SharedLink``: this host's shared memory (``transfer.py``); ``CollectiveLink``: a
torch.distributed group of two (``pushes.py``, the server's side); ``HttpLink``: safetensors parts over HTTP;
``AdapterLink``: a LoRA run's adapter alone.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import save

from auto_research.engine import machine
from auto_research.engine.rollout.pushes import (BUCKET_BYTES, JOIN_SECONDS, PUSH_SECONDS, _broadcast_options,
                                                 _device, _group, backends, choose_backend, layout, local_address,
                                                 offered_backends)
from auto_research.engine.rollout.rendezvous import StoreHost, link_key
from auto_research.engine.rollout.server import PART_BYTES
from auto_research.engine.rollout.transfer import SharedWriter
from auto_research.errors import RolloutEngineError, UserError


@dataclass(frozen=True)
class Offer:
    """What the server declares for this lease (its shared buffer, the groups it can join), and where it is."""

    shared: dict | None
    collective: object
    host: str
    port: int
    loopback: bool


class WeightLink(Protocol):
    transfer: str
    """How the weights go, for the run's log."""

    def begin(self) -> None: ...

    def send(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor, in the push's order; raises UserError (the push goes on walking the weights unsent)."""

    def finish(self, failure: UserError | None) -> UserError | None:
        """The push handed over (unless it failed already): its failure, or None."""

    def close(self) -> None: ...


def _attempt(call, *args) -> UserError | None:
    """``call(*args)``'s failure as a value (a push goes on walking the weights for every rank's gathers), or None."""
    try:
        call(*args)
    except UserError as error:
        return error
    return None


class HttpLink:
    """The weights in safetensors parts of up to ``PART_BYTES``; a tied weight is sent as a copy of its own
    (safetensors keeps one name per storage)."""

    transfer = "HTTP"

    def __init__(self, call):
        self.call = call
        self.begin()

    @classmethod
    def open(cls, client, offer: Offer, insist: bool):
        return cls(client._call)

    def begin(self) -> None:
        self.part, self.size, self.batch, self.seen = 0, 0, {}, set()

    def send(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.data_ptr() in self.seen:
            tensor = tensor.clone()
        self.seen.add(tensor.data_ptr())
        if self.size and self.size + tensor.numel() * tensor.element_size() > PART_BYTES:
            self._post(last=False)
        self.batch[name] = tensor
        self.size += tensor.numel() * tensor.element_size()

    def _post(self, last: bool) -> None:
        part, batch = self.part, self.batch
        self.part, self.size, self.batch, self.seen = part + 1, 0, {}, set()
        self.call(f"/weights?part={part}&last={int(last)}", save(batch), "application/octet-stream")

    def finish(self, failure: UserError | None) -> UserError | None:
        return failure or _attempt(self._post, True)

    def close(self) -> None:
        pass


class AdapterLink(HttpLink):
    """A LoRA run's adapter factors alone (``remote.adapter_factors``), in one request (``/weights/adapter``)."""

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.batch[name] = tensor

    def finish(self, failure: UserError | None) -> UserError | None:
        return failure or _attempt(self.call, "/weights/adapter", save(self.batch), "application/octet-stream")


class SharedLink(SharedWriter):
    """The server's shared buffer, mapped: each tensor copied into its slot, then the checksums posted."""

    transfer = "shared memory"

    def __init__(self, call, offer: dict, tied: dict | None = None):
        super().__init__(offer, tied)
        self.call = call

    @classmethod
    def open(cls, client, offer: Offer, insist: bool):
        if offer.shared:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not this host's file
                return cls(client._call, offer.shared, client.tied)
        if insist:
            raise UserError(f"--rollout-sync shared-memory: --rollout-server {client.address} offers no shared "
                            "buffer this process can map (another host or user, or a server started without one)")
        return None

    def begin(self) -> None:
        pass

    def send(self, name: str, tensor: torch.Tensor) -> None:
        self.write(name, tensor)

    def finish(self, failure: UserError | None) -> UserError | None:
        body = self.commit()  # the next push starts afresh, whatever became of this one
        return failure or _attempt(self.call, "/weights/shared", body)


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """A copy into a staging buffer on one thread (on the CPU): gloo sends the last bucket from a thread of its own
    meanwhile, and two copying threads starved it (a SmolLM2 push on 2 cores: 0.25–0.30 s, against 0.20–0.24 s)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        machine.set_threads(threads)


class CollectiveLink:
    """A group of two (``backend``: gloo or NCCL) with one rollout server, ``call`` being the client's request under
    its lease: ``begin`` starts a push's request, ``send`` broadcasts each tensor in the server's order (from
    ``device`` under NCCL), ``finish`` waits for its answer. ``tied``: weights the model ties, sent once where the
    server takes that."""

    def __init__(self, call, host: str, port: int, names: list[str] | None = None, backend: str = "gloo",
                 device: torch.device | str = "cpu", tied: dict | None = None, lease: str = ""):
        address = local_address(host, port)
        prefix, joined = f"auto-research-{secrets.token_hex(8)}", {}
        self.call, self.store = call, StoreHost(address, link_key(lease, prefix), JOIN_SECONDS)
        """The rendezvous (``rendezvous.StoreHost``) on ``address``, which the server answers under ``lease``."""

        def join() -> None:
            try:
                joined["group"] = _group(self.store.store, prefix, 0, PUSH_SECONDS, backend, address)
            except Exception as error:  # noqa: BLE001 - reported below
                joined["error"] = error

        thread = threading.Thread(target=join, name="collective-join", daemon=True)
        thread.start()
        try:
            answer = call("/weights/collective", json.dumps({"store": f"{address}:{self.store.port}", "group": prefix,
                                                             "backend": backend, "tied": tied or {}}).encode())
        except BaseException:
            self.store.close()
            raise
        thread.join(JOIN_SECONDS)
        if "group" not in joined:
            self.store.close()
            raise RolloutEngineError(f"the trainer's side of the group did not form ({joined.get('error')})")
        self.group, self.names, self.options = joined["group"], list(answer["names"]), _broadcast_options()
        if names is not None and names != self.names:
            raise RolloutEngineError("the server expects other weights, or in another order, than this run pushes")
        if "spec" not in answer:
            raise RolloutEngineError("the server sends no spec of its weights with its group (an older "
                                     "auto-research): use --rollout-sync http, or update it")
        self.tied = dict(answer.get("tied") or {})
        """The names not sent: the server loads their sources' tensors under them."""
        self.buckets = layout({name: (tuple(shape), dtype) for name, (shape, dtype) in answer["spec"].items()
                               if name not in self.tied})
        self.where = {entry[0]: (index, entry) for index, (_, entries, _) in enumerate(self.buckets)
                      for entry in entries}
        """Each name's bucket and (name, offset, numel, shape) in it."""
        self.device, self.pending = _device(backend, device), {}
        self.transfer = f"a torch.distributed group ({backend})"
        self.staging: list = [None, None]
        """Two buffers a bucket is copied into, one filling while the other is sent: [tensor, its last send]."""

    @classmethod
    def open(cls, client, offer: Offer, insist: bool):
        """A group with a server on another host (or one insisted on), of a backend both ends take."""
        if offer.loopback and not insist:
            return None
        ours = backends(client.device)
        backend = choose_backend(ours, offer.collective)
        if backend is None:
            if insist:
                raise UserError(f"--rollout-server {client.address} cannot join a torch.distributed group with this "
                                f"trainer (the server takes {', '.join(offered_backends(offer.collective)) or 'none'}"
                                f"; this trainer, its weights on {client.device.type}, {', '.join(ours) or 'none'})")
            return None
        try:
            return cls(client._call, offer.host, offer.port, backend=backend, device=client.device,
                       tied=client.tied, lease=client.lease)
        except (UserError, RuntimeError, OSError) as error:
            if insist:
                raise UserError(f"--rollout-sync collective: no group with --rollout-server {client.address} "
                                f"({str(error)[:300]})") from None
            return None

    def close(self) -> None:
        """The store closed: no more connections to it (the group itself needs it no more)."""
        self.store.close()

    def begin(self) -> None:
        self.pending = {"sent": 0, "sends": []}

        def push() -> None:
            try:
                self.pending["answer"] = self.call("/weights/collective/push", b"{}")
            except Exception as error:  # noqa: BLE001 - raised by finish, in the trainer's thread
                self.pending["error"] = error

        self.pending["thread"] = threading.Thread(target=push, name="collective-push", daemon=True)
        self.pending["thread"].start()

    def send(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` into its bucket; the bucket broadcast (without waiting) once its last tensor is in."""
        expected = self.names[self.pending["sent"]] if self.pending["sent"] < len(self.names) else None
        if name != expected:
            raise RolloutEngineError(f"the push sends {name!r} where the server expects {expected!r}")
        if name in self.tied:  # the server takes its source's tensor
            self.pending["sent"] += 1
            return
        index, (_, offset, numel, shape) = self.where[name]
        dtype, entries, total = self.buckets[index]
        if tuple(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != dtype:
            raise RolloutEngineError(f"the push sends {name!r} as {list(tensor.shape)} {tensor.dtype} where the "
                                     f"server expects {list(shape)} {dtype}")
        tensor = tensor.detach().to(self.device)
        if len(entries) == 1:  # alone in its bucket: sent as it is
            self._broadcast(tensor.contiguous().view(-1))
        else:
            slot = index % 2
            if offset == 0:  # a new bucket: its staging buffer once the send from it is done
                buffer = self.staging[slot]
                if buffer is not None:
                    self._wait(buffer[1])
                if buffer is None or buffer[0].dtype != tensor.dtype or buffer[0].numel() < total:
                    self.staging[slot] = [torch.empty(max(total, BUCKET_BYTES // tensor.element_size()),
                                                      dtype=tensor.dtype, device=self.device), None]
            staged = self.staging[slot][0]
            with _one_thread(self.device):
                staged[offset: offset + numel].copy_(tensor.reshape(-1))
            if offset + numel == total:
                self.staging[slot][1] = self._broadcast(staged[:total])
        self.pending["sent"] += 1

    def _broadcast(self, flat: torch.Tensor):
        """``flat`` sent without waiting (gloo sends from a thread of its own); its work, kept until ``finish``."""
        try:
            work = self.group.broadcast([flat], self.options)
        except RuntimeError as error:  # the server gone
            raise RolloutEngineError(f"the push over the group failed ({str(error).splitlines()[0][:300]})") from None
        self.pending["sends"].append((work, flat))
        return work

    @staticmethod
    def _wait(work) -> None:
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as error:  # the server gone or timed out
            raise RolloutEngineError(f"the push over the group failed ({str(error).splitlines()[0][:300]})") from None

    def finish(self, failure: UserError | None) -> UserError | None:
        return failure or _attempt(self._answer)

    def _answer(self) -> dict:
        if self.pending["sent"] != len(self.names):
            raise RolloutEngineError(f"the push sent {self.pending['sent']} of the {len(self.names)} tensors the "
                                     "server expects")
        for work, _ in self.pending["sends"]:
            self._wait(work)
        self.pending["sends"] = []
        self.pending["thread"].join(PUSH_SECONDS + 30)
        if "error" in self.pending:
            raise self.pending["error"]
        if "answer" not in self.pending:
            raise RolloutEngineError("the server did not answer its push over the group")
        return self.pending["answer"]


LINKS = {"shared-memory": SharedLink, "collective": CollectiveLink, "http": HttpLink}
"""--rollout-sync's paths (``config/rollout.py``), each a class that opens from the two ends' declarations."""
AUTO = ("shared-memory", "collective", "http")
"""--rollout-sync auto: the first of these both ends can form."""


def choose_link(client, sync: str, offer: Offer) -> WeightLink:
    """--rollout-sync ``auto``: the first link of ``AUTO`` that opens; another path is insisted on (else UserError)."""
    for name in AUTO if sync == "auto" else (sync,):
        link = LINKS[name].open(client, offer, insist=sync != "auto")
        if link is not None:
            return link
