"""benchmarks/gpu.py runs on the CPU too, with a tiny model, so it is tested here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_runs_on_the_cpu_and_lora_needs_less_memory():
    result = subprocess.run([sys.executable, str(REPOSITORY / "benchmarks" / "gpu.py"), "--size", "wide", "--steps", "2",
                             "--variants", "full,lora"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {name: line for line in result.stdout.splitlines() for name in ("full", "lora")
             if line.strip().startswith(f"{name}, 1 process")}
    assert lines.keys() == {"full", "lora"}, result.stdout
    figures = {}
    for name, line in lines.items():
        match = re.search(r"generation\s+(\d+) tok/s \| training\s+(\d+) tok/s \| MFU\s+(\S+) \| peak memory\s+(\d+) MB"
                          r".*trainable ([\d,]+)", line)
        assert match, line
        generation, training, mfu, peak, trainable = match.groups()
        assert int(generation) > 0 and int(training) > 0 and mfu == "n/a"  # no known peak FLOP/s for a CPU
        figures[name] = (int(peak), int(trainable.replace(",", "")))
    assert figures["lora"][1] < figures["full"][1] / 10
    # No reference copy and no Adam states for the base weights.
    assert figures["lora"][0] < figures["full"][0]
