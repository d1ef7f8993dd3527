"""``auto-research rollout-serve`` for a benchmark: started on a free port, its address once it says it serves."""

from __future__ import annotations

import subprocess
import sys
import threading


def start_server(model: str | None = None, threads: int | None = None, memory: float | None = None,
                 engine: str = "vllm", cores: set[int] | None = None, extra: tuple = (),
                 program: tuple = ("-m", "auto_research")) -> tuple[subprocess.Popen, str]:
    """Without ``model``, the embedded model's architecture (the trainer pushes its weights); ``cores``: the CPUs
    the server's process may run on (``taskset``); ``program``: what Python runs (a benchmark's own launcher,
    which takes the same arguments)."""
    command = [sys.executable, *program, "rollout-serve", "--engine", engine, "--port", "0", "--offline"]
    if cores:
        command = ["taskset", "-c", ",".join(map(str, sorted(cores)))] + command
    command += ["--model", model] if model else []
    command += ["--threads", str(threads)] if threads else []
    command += ["--vllm-memory", str(memory)] if memory else []
    command += list(extra)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if line.startswith("serving "):
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # keep draining
            return process, line.split("http://")[1].split()[0]
    raise SystemExit(f"auto-research rollout-serve did not start (exit {process.wait()})")
