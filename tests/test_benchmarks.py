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


def test_the_calculator_example_s_demonstrations_are_laid_out_as_its_rollouts_are():
    """benchmarks/tools.py's calculator: its small template shows the tool, a demonstration is the call (the
    model's), the tool's answer (the environment's), then the product (the model's), built by the rollouts' code."""
    sys.path.insert(0, str(REPOSITORY / "benchmarks"))
    import tools as calculator  # noqa: PLC0415 - the benchmark module

    from auto_research.envs.tools import call_format, check_template_takes_tools, parse_calls, tool_schema

    tokenizer = calculator.calculator_tokenizer()
    check_template_takes_tools(tokenizer, [tool_schema(calculator.mul)], "tiny")
    assert call_format(tokenizer) == "json"
    row = {"prompt": "754*24", "answer": "18096", "a": 754, "b": 24}
    [trajectory] = calculator.calculator_demonstrations(tokenizer, [row])
    call = '{"name":"mul","arguments":{"a":754,"b":24}}'
    assert tokenizer.decode(trajectory.prompt_ids) == "mul \n754*24\n"
    assert tokenizer.decode(trajectory.ids) == f"{call}</s>=18096\n18096</s>"
    owned = [tokenizer.decode([t]) for t, keep in zip(trajectory.ids, trajectory.loss_mask) if keep]
    assert "".join(owned) == f"{call}</s>18096</s>"
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.truncated) == (2, 1, 0, False)
    [parsed], broken = parse_calls(call, "json")
    assert (parsed.name, parsed.arguments, broken) == ("mul", {"a": 754, "b": 24}, 0)
