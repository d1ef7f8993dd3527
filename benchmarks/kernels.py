"""The main job across CPU kernels: held-out accuracy before and after RL, over a matrix of kernel settings and seeds.

    python benchmarks/kernels.py [--seeds 1,2,3] [--full] [--jobs 1] [--threads 2,1] [--steps N] [--out kernels.json]

Each cell runs README's main job, ``auto-research post-train --algorithm rloo --dataset arithmetic-generate
--seed S``, in a process of its own with some of the kernels floating-point results depend on changed:

- ``ATEN_CPU_CAPABILITY``: torch's vector kernels at the CPU's widest (default) or capped at avx2;
- ``MKL_ENABLE_INSTRUCTIONS``: MKL's matrix products at the CPU's widest (default) or capped at AVX2;
- ``torch.backends.mkldnn``: oneDNN on (default) or off;
- threads: 2 or 1 (``--threads``).

The 16 combinations are a 2^4 design. By default the benchmark runs its half fraction (8 cells: the thread count is
1 where an odd number of the other three are changed), in which each setting meets each other one at both levels;
``--full`` runs all 16. Prints each run, then the band: the starting accuracy's spread (the shipped model, evaluated
under each cell's kernels), the final accuracy's range, the smallest gain, the slowest run, and the machine.

Goals (issue 51): in every cell and seed the main job gains >= 20 points and ends >= 0.95 within 5 minutes on 2
cores, and the starting accuracy varies by <= 0.03 across the cells. Wall times are honest only with ``--jobs 1``
on an otherwise idle machine; more jobs share the cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from auto_research.engine.machine import describe, machine_record

# A cell's settings: (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, oneDNN on, threads); None leaves a variable unset.
AXES = (("default", "avx2"), ("default", "AVX2"), (True, False), (2, 1))
RUN = ("import sys, torch; torch.backends.mkldnn.enabled = {onednn}; from auto_research.cli import main; "
       "sys.exit(main(sys.argv[1:]))")


def cells(full: bool) -> list[tuple]:
    """The 2^4 design, or its half fraction: threads = 1 exactly where an odd number of the other three changed."""
    chosen = []
    for levels in itertools.product((0, 1), repeat=4):
        if full or levels[3] == (levels[0] + levels[1] + levels[2]) % 2:
            chosen.append(tuple(axis[level] for axis, level in zip(AXES, levels)))
    return chosen


def label(cell: tuple) -> str:
    aten, mkl, onednn, threads = cell
    return f"ATEN {aten:7s} MKL {mkl:7s} oneDNN {'on ' if onednn else 'off'} {threads} thr"


def run_one(cell: tuple, seed: int, steps: int | None, scratch: Path) -> dict:
    aten, mkl, onednn, threads = cell
    env = {key: value for key, value in os.environ.items()
           if key not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS")}
    if aten != "default":
        env["ATEN_CPU_CAPABILITY"] = aten
    if mkl != "default":
        env["MKL_ENABLE_INSTRUCTIONS"] = mkl
    folder = scratch / f"{abs(hash(cell))}-{seed}"
    command = [sys.executable, "-c", RUN.format(onednn=onednn), "post-train", "--algorithm", "rloo",
               "--dataset", "arithmetic-generate", "--seed", str(seed), "--threads", str(threads),
               "--output-dir", str(folder), "--no-progress", *(["--steps", str(steps)] if steps else [])]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{label(cell)} seed {seed} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    metrics = json.loads(next(folder.glob("*/metrics.json")).read_text())
    return {"cell": cell, "seed": seed, "wall": wall, "before": metrics["baseline"]["accuracy"],
            "after": metrics["final"]["accuracy"], "machine": metrics["machine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--full", action="store_true", help="all 16 cells, not the half fraction's 8")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (wall times are honest at 1)")
    parser.add_argument("--threads", default="2,1", help="only the cells of these thread counts (two-thread runs "
                        "that share the cores with other work slow down many times over: run them at --jobs 1)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the main job's)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here as JSON")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    threads = {int(count) for count in args.threads.split(",")}
    # Seed-major: a run cut short has covered every cell at the first seeds.
    plan = [(cell, seed) for seed in seeds for cell in cells(args.full) if cell[3] in threads]
    print(f"machine: {describe(machine_record('float32'))}")
    print(f"{len(plan)} runs: {len(plan) // len(seeds)} cells x seeds {args.seeds}, {args.jobs} at a time", flush=True)
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(args.jobs) as pool:
        def one(item):
            result = run_one(*item, args.steps, Path(scratch))
            print(f"{label(result['cell'])}  seed {result['seed']}: {result['before']:.3f} -> {result['after']:.3f} "
                  f"({100 * (result['after'] - result['before']):+.1f} points) in {result['wall']:.0f} s "
                  f"[kernels {result['machine']['kernel_capability']}, oneDNN {result['machine']['onednn']}, "
                  f"{result['machine']['threads']} threads]", flush=True)
            return result
        results = list(pool.map(one, plan))
    before = [r["before"] for r in results]
    after = [r["after"] for r in results]
    gains = [100 * (r["after"] - r["before"]) for r in results]
    walls = [r["wall"] for r in results]
    print(f"\nstarting accuracy across {len(plan) // len(seeds)} cells: {min(before):.3f} .. {max(before):.3f} "
          f"(spread {max(before) - min(before):.3f}; goal <= 0.03)")
    print(f"final accuracy: {min(after):.3f} .. {max(after):.3f} (goal >= 0.95 in every run)")
    print(f"gain: {min(gains):+.1f} .. {max(gains):+.1f} points (goal >= +20 in every run)")
    print(f"slowest run: {max(walls):.0f} s (goal <= 300 s at --jobs 1)")
    print(f"band: {min(before):.2f} -> {min(after):.2f}-{max(after):.2f} across {len(plan) // len(seeds)} kernel "
          f"settings and {len(seeds)} seeds")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_record("float32"), "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
