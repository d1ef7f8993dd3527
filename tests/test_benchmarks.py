"""benchmarks/gpu.py runs on the CPU too, with a tiny model, so it is tested here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_runs_on_the_cpu_and_lora_holds_less_training_state():
    result = subprocess.run([sys.executable, str(REPOSITORY / "benchmarks" / "gpu.py"), "--size", "tiny", "--steps", "2",
                             "--variants", "full,lora"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {name: line for line in result.stdout.splitlines() for name in ("full", "lora")
             if line.strip().startswith(f"builtin, {name}, 1 proc")}
    assert lines.keys() == {"full", "lora"}, result.stdout
    figures = {}
    for name, line in lines.items():
        match = re.search(r"generation\s+(\d+) tok/s \| training\s+(\d+) tok/s \| MFU\s+(\S+) \| peak memory\s+(\d+) MB"
                          r".*training state\s+([\d.]+) MB \| trainable ([\d,]+)", line)
        assert match, line
        generation, training, mfu, peak, state, trainable = match.groups()
        assert int(generation) > 0 and int(training) > 0 and mfu == "n/a" and int(peak) > 0  # no peak FLOP/s for a CPU
        figures[name] = (float(state), int(trainable.replace(",", "")))
    assert figures["lora"][1] < figures["full"][1] / 10
    # No reference copy, and gradients and Adam states for the adapters only: counted tensor by tensor, so
    # the order cannot flip (peak RSS also holds the allocator's working memory, which varies run to run).
    # Full: 4 + 4 + 8 + 4 = 20 bytes a weight; LoRA: 4 bytes a weight and 20 per adapter weight.
    assert figures["lora"][0] < 0.3 * figures["full"][0]
