"""Does staleness cost learning? RLOO on arithmetic-generate (the embedded model) at --max-staleness 0, 1 and 2
over three seeds, the same number of steps each, and at K = 4 with and without the correction.

    python benchmarks/async_learning.py                 # 200 steps a run
    python benchmarks/async_learning.py --steps 600     # the preset's length
    python benchmarks/async_learning.py --jobs 2        # two runs at a time (accuracy does not depend on it)

Prints held-out greedy accuracy after training (mean ± spread over the seeds, and each seed), the mean
staleness-correction weight and the mismatch between the stale weights and the trained ones at the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run(output: Path, seed: int, K: int, steps: int, correction: str | None) -> dict:
    command = [sys.executable, "-m", "auto_research", "post-train", "--dataset", "arithmetic-generate",
               "--steps", str(steps), "--seed", str(seed), "--max-staleness", str(K), "--threads", "1",
               "--no-progress", "--output-dir", str(output), "--eval-every", "0"]
    if correction:
        command += ["--rollout-correction", correction]
    finished = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if finished.returncode:
        raise SystemExit(finished.stderr[-2000:])
    folder = next(output.iterdir())
    metrics = json.loads((folder / "metrics.json").read_text())
    last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])
    return {"before": metrics["baseline"]["accuracy"], "after": metrics["final"]["accuracy"],
            "weight": last.get("rollout_weight_mean"), "mismatch": last.get("rollout_logprob_diff_mean")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each on one thread)")
    options = parser.parse_args()
    seeds = [int(seed) for seed in options.seeds.split(",")]
    plans = [(K, None, seeds) for K in (0, 1, 2)] + [(4, None, seeds[:1]), (4, "none", seeds[:1])]
    print(f"RLOO, arithmetic-generate, embedded model, {options.steps} steps a run; held-out greedy accuracy")
    print("| K | correction | after training (mean ± std over seeds) | each seed | last step: weight mean, |log π − log μ| |")
    print("|---:|---|---:|---|---|")
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(options.jobs) as pool:
        pending = [[pool.submit(run, Path(folder) / f"{K}-{correction}-{seed}", seed, K, options.steps, correction)
                    for seed in plan_seeds] for K, correction, plan_seeds in plans]
        means = {}
        for (K, correction, _), futures in zip(plans, pending):
            results = [future.result() for future in futures]
            after = [result["after"] for result in results]
            spread = statistics.pstdev(after) if len(after) > 1 else 0.0
            last = results[-1]
            drift = ("n/a" if last["weight"] is None else f"{last['weight']:.4f}, {last['mismatch']:.2e}")
            print(f"| {K} | {correction or 'default (sequence-tis)'} | {statistics.fmean(after):.3f} ± {spread:.3f} "
                  f"| {', '.join(f'{value:.3f}' for value in after)} (from {results[0]['before']:.3f}) | {drift} |",
                  flush=True)
            means[K, correction] = after
    low, high = min(means[0, None]), max(means[0, None])
    for K in (1, 2):
        mean = statistics.fmean(means[K, None])
        print(f"K={K}: mean {mean:.3f} {'lies within' if low <= mean <= high else 'lies outside'} K=0's seeds' range "
              f"[{low:.3f}, {high:.3f}]")

if __name__ == "__main__":
    main()
