"""The frozen reference out of the process's memory between its passes (--offload-reference).

The reference is read once a step; held as ordinary tensors it takes a model's weights of memory for the whole
step, the update's peak included. Here its weights are written once to a file in the cache folder, mapped
copy-on-write and unlinked at once (nothing is left behind, even after a crash), and each parameter becomes a view
of the mapping. After each pass ``release`` drops the pages (``MADV_DONTNEED``); the next pass faults them back
from the page cache (or the disk) without a copy. The memory is moved, not removed: page cache the kernel may
reclaim under pressure, not resident memory it could only swap. On CUDA the reference moves to host memory and back
instead (verl's ``ref.fsdp_config.param_offload``, OpenRLHF's ``--ref_reward_offload``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path

import torch

ALIGNMENT = 64


class OffloadedReference:
    """A frozen model whose parameters live outside the process between passes; ``fetch`` before a pass,
    ``release`` after it."""

    def __init__(self, model: torch.nn.Module, folder: Path):
        self.model = model
        self.device = next(model.parameters()).device
        self.mapping = None
        if self.device.type == "cuda":
            model.to("cpu")
            return
        parameters = list(dict.fromkeys(model.parameters()))  # tied weights once
        folder.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="reference-", suffix=".weights", dir=folder)
        offsets, offset = [], 0
        try:
            with os.fdopen(handle, "wb") as stream:
                for parameter in parameters:
                    data = parameter.detach().contiguous().view(-1).view(torch.uint8).numpy()
                    padding = -offset % ALIGNMENT
                    stream.write(b"\0" * padding)
                    offset += padding
                    offsets.append(offset)
                    stream.write(memoryview(data))
                    offset += data.nbytes
            with open(name, "rb") as stream:
                self.mapping = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_COPY)
        finally:
            os.unlink(name)
        with torch.no_grad():
            for parameter, start in zip(parameters, offsets):
                parameter.data = torch.frombuffer(self.mapping, dtype=parameter.dtype, count=parameter.numel(),
                                                  offset=start).view(parameter.shape)
        self.release()

    def fetch(self) -> torch.nn.Module:
        """The model, ready for a pass (on CUDA moved back to the device; on the CPU its pages are read ahead)."""
        if self.device.type == "cuda":
            self.model.to(self.device)
        elif hasattr(mmap, "MADV_WILLNEED"):
            self.mapping.madvise(mmap.MADV_WILLNEED)
        return self.model

    def release(self) -> None:
        """Out of the process's memory until the next ``fetch``."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        elif hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of the mapping resident in this process now (its Rss in /proc/self/smaps; 0 on CUDA)."""
        return _mapped_resident(self.mapping) if self.mapping is not None else 0


def _mapped_resident(mapping) -> int:
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    try:
        with open("/proc/self/smaps") as stream:
            inside = False
            for line in stream:
                if "-" in line.split(" ", 1)[0] and not line[0].isupper():
                    start, stop = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                    inside = start <= address < stop
                elif inside and line.startswith("Rss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0
