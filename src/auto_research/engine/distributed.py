"""Several processes under ``torchrun``: data parallel (DDP) or sharded (FSDP2), on PyTorch's own engine.

One process needs nothing from here but a ``World`` of size 1, whose collectives are the identity. Under
``torchrun --nproc-per-node N`` every rank runs the same command; this module is the whole of what differs:

* Each rank samples and scores whole groups (the leave-one-out baseline needs a prompt's K samples together).
  Every rank draws the same global prompts and keeps its share (``share``): within each PPO mini-batch,
  consecutive slices per rank, so N ranks' m-th mini-batches together are one process's m-th mini-batch. Samples
  are seeded per prompt (rollout.prompt_seed), so which rank draws a prompt changes nothing.
* Loss normalisers are global counts (``total``), and a rank's loss is multiplied by N, because DDP and FSDP
  average gradients over ranks: the sum is then exactly the one-process gradient.
* Only rank 0 writes (``on_main``); an error on any rank is agreed on by all (``agree``), reported once by the
  rank that had it, and every rank exits 2.

The rank handling follows nanoGPT's: torchrun's variables, one device per local rank, ``main`` gating every write.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from auto_research.engine import onednn
from auto_research.engine.launch import environment_rank, environment_world_size
from auto_research.errors import UserError
from auto_research.orphans import PARENT_POLL_SECONDS, say, watch_parent


def stop_with_launcher(rank: int, poll: float = PARENT_POLL_SECONDS) -> threading.Thread | None:
    """SIGKILL this rank at once when its launcher (the torchrun agent) dies: torchrun starts each worker in a
    session of its own, so killing the agent's process group leaves the workers training, saving and pruning
    checkpoints while a requeued job resumes from the same folder (the collective timeout takes 30 minutes)."""
    parent = os.getppid()
    if parent <= 1:
        return None

    def gone() -> None:
        say(f"rank {rank}: the launcher (PID {parent}) is gone; stopping now")
        os.kill(os.getpid(), signal.SIGKILL)

    return watch_parent(parent, gone, poll)


class PeerFailed(UserError):
    """Another rank failed and said why; this rank exits 2 without repeating the message."""

    quiet = True


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    fsdp: bool = False
    collective_device: str = "cpu"
    """Where the collectives' tensors go: NCCL's take CUDA tensors only (``start``); gloo's, the CPU's."""

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_environment(cls, fsdp: bool = False) -> "World":
        size = environment_world_size()
        if size <= 1:
            return cls()
        return cls(environment_rank(), size, int(os.environ.get("LOCAL_RANK", "0")), fsdp)

    def device(self, device: str) -> str:
        """One accelerator per local rank (cuda:LOCAL_RANK); the CPU is shared."""
        return f"cuda:{self.local_rank}" if self.distributed and device.startswith("cuda") else device

    def start(self, device: str) -> None:
        if not self.distributed or dist.is_initialized():
            return
        stop_with_launcher(self.rank)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(self.local_rank)
            self.collective_device = f"cuda:{self.local_rank}"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))

    def stop(self) -> None:
        """Nothing: the process group is left to the process's end (the CLI leaves with ``os._exit``). Destroying
        it races with gloo (seen in CI, a rank hung for good: ``ProcessGroupGloo``'s destructor, holding the GIL,
        joined a thread that waited for the GIL). A later run in the same process reuses the group (``start``)."""

    # --- collectives (the identity in one process) ---------------------------------

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def total(self, tensor):
        """Sum over ranks (a new tensor; the input is left as it was)."""
        if not self.distributed:
            return tensor
        summed = tensor.detach().to(self.collective_device, copy=True)
        dist.all_reduce(summed)
        return summed.to(tensor.device)

    def gather(self, tensor):
        """Concatenation of every rank's tensor along dimension 0, in rank order (equal shapes)."""
        if not self.distributed:
            return tensor
        local = tensor.detach().to(self.collective_device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def gather_objects(self, value) -> list:
        if not self.distributed:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def any(self, flag: bool) -> bool:
        return bool(self.total(torch.tensor([int(flag)])).item()) if self.distributed else flag

    def agree(self, error: BaseException | None, kind=UserError) -> None:
        """Every rank raises when any rank had an error: the rank that had it raises its own, the others
        a quiet ``kind`` with the same message (so a reward that fails on rank 1 stops rank 0 too)."""
        messages = self.gather_objects(None if error is None else str(error))
        if error is not None:
            raise error
        failed = next(((rank, message) for rank, message in enumerate(messages) if message is not None), None)
        if failed is not None:
            peer = kind(f"rank {failed[0]} failed: {failed[1]}")
            peer.quiet = True
            raise peer

    def on_main(self, function):
        """``function()`` on rank 0 only; an OSError there (a full disk) or a UserError (the run folder
        deleted under the run) is raised on every rank, quietly on the others."""
        result, error = None, None
        if self.main:
            try:
                result = function()
            except (OSError, UserError) as failure:
                error = failure
        if self.distributed:
            described = (None if error is None else ("user", str(error)) if isinstance(error, UserError)
                         else ("os", error.errno, error.strerror or str(error)))
            errors = self.gather_objects(described)
            if error is None and errors[0] is not None:
                peer = PeerFailed(errors[0][1]) if errors[0][0] == "user" else OSError(*errors[0][1:])
                peer.quiet = True
                raise peer
        if error is not None:
            raise error
        return result

    def share(self, items: list, mini_batches: int = 1) -> list:
        """This rank's items: within each of the mini-batches, its consecutive slice."""
        if not self.distributed:
            return list(items)
        per_batch = len(items) // mini_batches
        per_rank = per_batch // self.size
        return [item for batch in range(mini_batches)
                for item in items[batch * per_batch + self.rank * per_rank: batch * per_batch + (self.rank + 1) * per_rank]]

    # --- models ------------------------------------------------------------------------

    def wrap(self, model, trains: bool = True):
        """DDP for a model that trains, FSDP2 (``fully_shard``: each decoder layer, then the root) with
        ``--fsdp``; frozen models are only sharded (FSDP) or kept whole (DDP). Returns the module to call
        for gradient forwards; with FSDP that is the model itself, its parameters now shards."""
        if not self.distributed:
            return model
        if self.fsdp:
            onednn.use_torch(model)  # torch's own layers under FSDP's gathering (onednn.py)
            for layer in decoder_layers(model):
                fully_shard(layer)
            fully_shard(model)
            return model
        if not trains:
            return model
        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    @contextlib.contextmanager
    def gathered(self, *models):
        """Whole parameters for the duration (FSDP): a rank may then run any number of forwards (sampling
        stops when its own samples end) with no collective in between. Nothing to do otherwise."""
        # (A LoRA reference is a callable over the policy, gathered with it.)
        modules = [module for model in models if hasattr(model, "modules") for module in model.modules()
                   if isinstance(module, FSDPModule)]
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(True, recurse=False)

    def no_sync(self, wrapped, last: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of an optimizer step."""
        if last or not hasattr(wrapped, "no_sync"):
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def full_state(self, model) -> dict | None:
        """The whole state dict on rank 0 (None elsewhere), on the CPU: FSDP shards are gathered."""
        if self.fsdp and self.distributed:
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if not self.main:
                return None
            # A tied weight (lm_head = embeddings) comes back twice; the model's own names hold it once.
            kept = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
            return {name: value for name, value in state.items() if name in kept}
        return None  # the model's own state_dict serves

    def optimizer_state(self, model, optimizer) -> dict | None:
        """The whole optimizer state, keyed by parameter name, on rank 0 (None elsewhere)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.fsdp and self.distributed)
        state = get_optimizer_state_dict(unwrap(model) if not self.fsdp else model, optimizer, options=options)
        return state if self.main else None

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        set_optimizer_state_dict(unwrap(model) if not self.fsdp else model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))


def unwrap(model):
    """The model inside a DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def decoder_layers(model) -> list:
    """The repeated blocks to shard one by one: the longest ModuleList in the model (its decoder layers)."""
    return max((list(module) for module in model.modules() if isinstance(module, torch.nn.ModuleList)), key=len,
               default=[])
