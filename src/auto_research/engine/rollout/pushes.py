"""The server's other ways in for a lease holder's weights, beside ``/weights`` and ``/weights/shared``: a LoRA run's
adapter alone (``adapter_push``), and the weights over a torch.distributed group of two (``links.CollectiveLink`` is
the trainer's side).

- ``POST /weights/collective`` (``collective_join``): the server joins the group as rank 1 through the trainer's
  store (``rendezvous``: served only to a side that answers a challenge under a key from the lease), and answers
  the names it expects, in order, and the ties it takes (``guard.check_ties``: a tied name is never sent). One link
  per lease; a backend the server cannot take is a 400.
- ``POST /weights/collective/push`` (``collective_push``): every weight received by broadcasts while this request
  waits, checked (finite) and reloaded as a ``/weights`` push; a trainer that stops sending fails it after
  ``PUSH_SECONDS`` (500), and the link is dropped.

The weights travel in buckets (``layout``: consecutive tensors of one dtype up to ``BUCKET_BYTES``): a broadcast per
tensor paid gloo's cost per message 273 times a SmolLM2 push. The trainer fills one of two staging buffers while the
other is sent; the server receives into buffers it keeps, in two sets when the engine serves them as they are
(``adopt_named``: a push lands in the set not served, so a refused push leaves the served weights untouched).

The group spans one trainer and one server, so a dead server stalls nobody but its own push (bounded). NCCL where
both sides' weights are on CUDA GPUs (``choose_backend``), gloo otherwise; NCCL has not run here (it needs two GPUs).
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from auto_research.engine.rollout.adapter_guard import check_adapter
from auto_research.engine.rollout.guard import Refused, all_finite, check_ties
from auto_research.engine.rollout.rendezvous import RemoteStore, gloo_device, link_key
from auto_research.engine.rollout.transfer import with_ties
from auto_research.errors import one_line
from auto_research.http import split_address

BUCKET_BYTES = 64 * 2**20
"""The most bytes a bucket of several tensors holds (a tensor larger than this goes alone)."""
JOIN_SECONDS = 30.0
"""How long a group's two sides wait for each other to join."""
PUSH_SECONDS = 120.0
"""How long one broadcast of a push may take before the push fails (a trainer or server that stopped)."""


def _broadcast_options():
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def backends(device: torch.device | str) -> list[str]:
    """The groups this side can form with its weights on ``device``, the fastest first (NCCL for CUDA tensors)."""
    if not dist.is_available():
        return []
    fast = ["nccl"] if torch.device(device).type == "cuda" and dist.is_nccl_available() else []
    return fast + (["gloo"] if dist.is_gloo_available() else [])


def offered_backends(collective) -> list[str]:
    """The backends a server's ``/health`` lists under ``"collective"``; an older server said ``true`` for gloo."""
    return ["gloo"] if collective is True else list(collective or [])


def choose_backend(ours: list[str], theirs) -> str | None:
    offered = offered_backends(theirs)
    return next((backend for backend in ours if backend in offered), None)


def _group(store, prefix: str, rank: int, seconds: float, backend: str = "gloo", address: str | None = None):
    """This side's rank of the group of two through ``store``; gloo's listener on ``address`` (this side's on the
    way to the other) alone."""
    timeout, store = datetime.timedelta(seconds=seconds), dist.PrefixStore(prefix, store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    if address is None:
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout, options._devices, options._threads = timeout, [gloo_device(address)], 2
    return dist.ProcessGroupGloo(store, rank, 2, options)


def layout(spec: dict) -> list[tuple[str, list[tuple[str, int, int, tuple]], int]]:
    """The buckets of a push, in the spec's order (``{name: (shape, dtype name)}``): each ``(dtype, [(name, offset,
    numel, shape), ...], numel)``; consecutive tensors of one dtype up to ``BUCKET_BYTES``, a larger one alone."""
    buckets: list = []
    for name, (shape, dtype) in spec.items():
        numel, width = math.prod(shape), torch.empty((), dtype=getattr(torch, dtype)).element_size()
        if buckets and buckets[-1][0] == dtype and (buckets[-1][2] + numel) * width <= BUCKET_BYTES:
            buckets[-1][1].append((name, buckets[-1][2], numel, tuple(shape)))
            buckets[-1][2] += numel
        else:
            buckets.append([dtype, [(name, 0, numel, tuple(shape))], numel])
    return [tuple(bucket) for bucket in buckets]


def _device(backend: str, device) -> torch.device:
    """Where a push's tensors travel: the CUDA device under NCCL, the CPU under gloo."""
    return torch.device(device) if backend == "nccl" else torch.device("cpu")


# --- the server's side (each takes the request's handler: server.Handler) --------------------------------------


def takes_adapters(sampler) -> bool:
    """Whether ``sampler`` applies a pushed LoRA adapter itself (the builtin engine; vLLM with --enable-lora)."""
    return bool(getattr(sampler, "takes_adapters", hasattr(sampler, "load_adapter")))


def adapter_push(handler, limit: int):
    """A LoRA run's adapter alone (``limit`` bytes at most), merged by the engine onto the base weights of the last
    full push (an engine that cannot: 400, and the trainer pushes merged weights instead)."""
    from safetensors.torch import load  # noqa: PLC0415

    body, sampler = handler.holder_body(limit), handler.serving.sampler
    if not takes_adapters(sampler):
        raise Refused(400, "this server's engine takes merged weights only (POST /weights)")
    try:
        factors = load(body)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own types for a corrupt body
        raise Refused(400, f"the adapter is not a safetensors file ({type(error).__name__})") from None
    checked = check_adapter(factors, handler.serving.served.spec)
    most = getattr(sampler, "max_adapter_rank", None)
    rank = max(A.shape[0] for A, _, _ in checked.values()) if checked else 0
    if most is not None and rank > most:
        raise Refused(400, f"an adapter of rank {rank} is over this server's --max-lora-rank {most}")

    def load() -> None:
        try:
            sampler.load_adapter(checked)
        except (ValueError, RuntimeError) as error:  # vLLM: a module it cannot adapt; the old adapter stays
            raise Refused(400, f"the engine cannot apply this adapter ({one_line(error)})"[:400]) from None

    return handler.loaded(load)


@dataclass
class Link:
    """The server's side of a group with the lease holder, with two sets of receive buffers: an engine that adopts
    received tensors serves from one (``adopted``; None: its own memory) while the next push lands in the other."""

    store: object
    group: object
    device: torch.device
    buckets: list
    tied: dict
    sets: list = field(default_factory=lambda: [[], []])
    adopted: int | None = None


def collective_join(handler):
    body = handler.holder_body(2**16)
    try:
        request = json.loads(body)
        host, port = split_address(str(request["store"]), "store")
        prefix, backend = str(request["group"]), str(request.get("backend", "gloo"))
    except Exception as error:  # noqa: BLE001 - not JSON, a key missing, a bad address (UserError)
        raise Refused(400, f"/weights/collective needs {{\"store\": \"HOST:PORT\", \"group\": name}} ({error})"[:300]) \
            from None
    spec = handler.serving.served.spec
    tied = check_ties(request.get("tied", {}), spec)
    device = handler.serving.served.device
    if backend not in backends(device):
        raise Refused(400, f"this server cannot join a {backend[:20]!r} group: its engine on {device} takes "
                           f"{', '.join(backends(device)) or 'none'}")
    store = None
    try:  # the store proves it is the lease holder's (and this server its own) before any key is read
        store = RemoteStore(host, port, link_key(handler.headers.get("X-Lease"), prefix), JOIN_SECONDS)
        group = _group(store, prefix, 1, PUSH_SECONDS, backend, local_address(host, port))
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError and its own types
        if store is not None:
            store.close()
        raise Refused(400, f"cannot join the trainer's group at {host}:{port} ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''})"[:300]) from None
    for old in handler.serving.links.values():
        old.store.close()
    handler.serving.links.clear()  # one link, the lease holder's
    sent = {name: entry for name, entry in spec.items() if name not in tied}
    handler.serving.links[handler.headers.get("X-Lease")] = Link(store, group, _device(backend, device),
                                                                 layout(sent), tied)
    return 200, {"names": list(spec), "spec": {name: [list(shape), dtype] for name, (shape, dtype) in spec.items()},
                 "tied": tied}


def collective_push(handler):
    handler.holder_body(2**16)
    serving = handler.serving
    link = serving.links.get(handler.headers.get("X-Lease"))
    if link is None:
        raise Refused(409, "no group with this lease's trainer: POST /weights/collective first")
    adopts = hasattr(serving.sampler, "adopt_named")
    into = 1 - link.adopted if adopts and link.adopted is not None else 0  # never the set being served
    buffers, tensors, options, bad = link.sets[into], {}, _broadcast_options(), None
    try:
        works = []
        for index, (dtype, _, numel) in enumerate(link.buckets):  # every receive queued: gloo takes them in order
            if index == len(buffers):  # the set's first push: its buffers, kept for the next
                buffers.append(torch.empty(numel, dtype=getattr(torch, dtype), device=link.device))
            works.append(link.group.broadcast([buffers[index]], options))
        for work, buffer, (_, entries, numel) in zip(works, buffers, link.buckets):
            work.wait()  # then this bucket is checked while the next ones arrive
            finite = all_finite(buffer[:numel])  # one pass a bucket: a pass a tensor cost 0.2-0.5 s a push here
            for name, offset, size, shape in entries:
                tensors[name] = buffer[offset: offset + size].view(shape)
                if bad is None and not finite and not all_finite(tensors[name]):
                    bad = name
    except Exception as error:  # noqa: BLE001 - a timeout or a peer gone: the link is dropped
        link.store.close()
        serving.links.clear()
        raise Refused(500, f"the push over the group failed after {len(tensors)} of "
                           f"{len(serving.served.spec) - len(link.tied)} tensors ({type(error).__name__}); the "
                           "engine keeps its weights") from None
    if bad is not None:  # every tensor received: the link stays whole for the next push
        raise Refused(400, f"tensor {bad!r} has NaN or infinite values")
    tensors = with_ties(tensors, link.tied, serving.served.spec)  # the served order, as every push loads
    answer = handler.load_checked(tensors, adopt=adopts)
    if adopts:
        link.adopted = into
    return answer


def local_address(host: str, port: int) -> str:
    """This host's address on the way to ``host:port`` (where the server can reach the trainer's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]
