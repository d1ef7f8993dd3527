"""The loss variants against RLOO on the CPU demo, in one invocation.

    OMP_NUM_THREADS=1 python benchmarks/variants.py [--steps N] [--seeds 42,43,44] [--algorithms rloo,dr-grpo,...]

Each algorithm runs ``auto-research post-train --dataset arithmetic-generate`` with every setting at the dataset's
preset (RLOO's recipe: 600 steps of 32 prompts × K = 4, lr 3e-4, T 1.5, 6 new tokens) and its record's own loss,
aggregation, clip range and KL placement, for each seed: the same prompts, the same number of sampled completions,
so the same budget. It prints held-out greedy accuracy before → after (mean ± std over the seeds), the gain in
points, and each variant's sampled tokens and training time as ratios to RLOO's.

Goals (issue 25): dapo and dr-grpo each gain >= 5 points over the start at RLOO's budget; gspo and cispo learn.
With one update per batch (the preset) every ratio is 1 when the loss is computed, so the clip ranges (DAPO's
clip-higher, GSPO's 3e-4/4e-4, CISPO's) shape nothing here: what differs is the advantage (std or not), the
aggregation, DAPO's overlong punishment and the KL (in the reward for RLOO, none for the four variants, whose
papers' objectives have none; a reference still measures it). Dynamic sampling (dapo's record) is not yet honoured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ALGORITHMS = ("rloo", "dr-grpo", "dapo", "gspo", "cispo")


def run(algorithm: str, seed: int, steps: int | None, output: Path) -> dict:
    command = [sys.executable, "-m", "auto_research", "post-train", "--algorithm", algorithm, "--dataset",
               "arithmetic-generate", "--seed", str(seed), "--output-dir", str(output), "--no-progress",
               "--checkpoint-every", "0", "--overwrite", "--threads", os.environ.get("OMP_NUM_THREADS", "1")]
    if steps is not None:
        command += ["--steps", str(steps), "--eval-every", str(max(1, steps // 4))]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    metrics = json.loads((output / f"{algorithm}-arithmetic-generate-seed{seed}" / "metrics.json").read_text())
    training = metrics["training"]
    return {"start": metrics["baseline"]["accuracy"], "end": metrics["final"]["accuracy"],
            "seconds": training["training_seconds"], "wall": wall,
            "tokens": training["tokens_per_second"] * training["training_seconds"]}


def _mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's (600)")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--output-dir", type=Path, default=Path("runs/variants"))
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    algorithms = args.algorithms.split(",")
    results: dict[str, list[dict]] = {}
    for algorithm in algorithms:
        for seed in seeds:
            result = run(algorithm, seed, args.steps, args.output_dir)
            results.setdefault(algorithm, []).append(result)
            print(f"{algorithm} seed {seed}: {result['start']:.3f} -> {result['end']:.3f} in {result['seconds']:.0f} s "
                  f"of training, {result['tokens']:.0f} sampled tokens", flush=True)
    reference = results.get("rloo", next(iter(results.values())))
    tokens_ref = statistics.mean(r["tokens"] for r in reference)
    seconds_ref = statistics.mean(r["seconds"] for r in reference)
    print(f"\n{len(seeds)} seeds, {args.steps or 'preset'} steps each; ratios to {'rloo' if 'rloo' in results else algorithms[0]}")
    print(f"| algorithm | start | end | gain (points) | sampled tokens | training time |")
    print("|---|---:|---:|---:|---:|---:|")
    for algorithm, runs in results.items():
        gains = [100 * (r["end"] - r["start"]) for r in runs]
        spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"| {algorithm} | {_mean_std([r['start'] for r in runs])} | {_mean_std([r['end'] for r in runs])} | "
              f"{statistics.mean(gains):+.1f} ± {spread:.1f} | "
              f"{statistics.mean(r['tokens'] for r in runs) / tokens_ref:.3f}× | "
              f"{statistics.mean(r['seconds'] for r in runs) / seconds_ref:.2f}× |")


if __name__ == "__main__":
    main()
