"""Give the C heap's free memory back to the operating system before a step's sampling and its update (CPU runs;
``train/step.py``). glibc keeps what a phase frees for reuse, and the next phase, allocating other sizes, rarely
reuses it whole: on SmolLM2-135M the process kept about 2.3 GB between steps, so a step's peak was the sum of the
phases' leftovers. ``malloc_trim(0)`` returns the free pages (about a millisecond); elsewhere (not glibc) nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        library = ctypes.CDLL(name) if name else None
    except OSError:
        library = None
    trim = getattr(library, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Return the C heap's free pages to the operating system; whether this C library can (glibc)."""
    trim = _trim()
    if trim is not None:
        trim(0)
    return trim is not None
