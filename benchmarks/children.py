"""A benchmark's measurement in a process of its own: run the child command, read its ``RESULT {json}`` line."""

from __future__ import annotations

import json
import os
import subprocess


def child_result(command: list[str], threads: int, what: str) -> dict:
    """The child's ``RESULT`` line as a dict, with ``threads`` OpenMP threads; its stderr tail if it failed."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    output = subprocess.run(command, capture_output=True, text=True, env=environment)
    line = next((line for line in output.stdout.splitlines() if line.startswith("RESULT ")), None)
    if output.returncode or line is None:
        raise SystemExit(f"{what} failed:\n{output.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])
