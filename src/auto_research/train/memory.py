"""Peak memory of the training that follows a ``MemoryMeter``'s creation."""

from __future__ import annotations

import os
import resource

import torch


def resident_bytes() -> int:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryMeter:
    """On CUDA: ``torch.cuda.max_memory_allocated`` (reset here). On the CPU: peak resident memory minus the resident
    memory now (before the models load): fair only between runs with a process each (``compare`` gives them one)."""

    def __init__(self, device: str):
        self.cuda = torch.cuda.is_available() and device != "cpu" and not device.startswith("mps")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.before = resident_bytes()

    def read(self) -> dict:
        if self.cuda:
            return {"peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
                    "peak_memory_kind": "CUDA max_memory_allocated"}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
        return {"peak_memory_mb": (peak - self.before) / 2**20,
                "peak_memory_kind": "CPU: peak resident memory of the process minus its resident memory before the "
                                    "models were loaded"}
