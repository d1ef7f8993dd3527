"""Does staleness cost learning? RLOO on arithmetic-generate (the embedded model) at --max-staleness 0, 1 and 2
over three seeds, the same number of steps each, and at K = 4 with and without the correction.

    python benchmarks/async_learning.py                 # 200 steps a run
    python benchmarks/async_learning.py --steps 600     # the preset's length
    python benchmarks/async_learning.py --jobs 2        # two runs at a time (accuracy does not depend on it)
    python benchmarks/async_learning.py --levels 1,2+ --jobs 2     # K = 1 against K = 2 with --in-flight-updates
    python benchmarks/async_learning.py --levels 1,2+ --task sums --seeds 42 --jobs 2   # SmolLM2's two-digit sums

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

from levels import parse as parse_level


def run(output: Path, seed: int, level: str, task: list[str], correction: str | None) -> dict:
    """One run (its folder kept: a finished run is read, not run again); ``level`` K, or K+ for
    --in-flight-updates (``levels.py``: K+x1.5 with --in-flight-pool 1.5)."""
    found = sorted(output.glob("*/metrics.json"))
    if not found:
        command = [sys.executable, "-m", "auto_research", "post-train", *task, "--seed", str(seed),
                   *parse_level(level).flags(), "--threads", "1", "--no-progress", "--output-dir", str(output),
                   "--overwrite"]
        if correction:
            command += ["--rollout-correction", correction]
        output.mkdir(parents=True, exist_ok=True)
        with open(output / "log.txt", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        if code:
            raise SystemExit(f"{' '.join(command)} failed (exit {code}): {output / 'log.txt'}")
        found = sorted(output.glob("*/metrics.json"))
    metrics = json.loads(found[0].read_text())
    last = json.loads((found[0].parent / "metrics.jsonl").read_text().splitlines()[-1])
    return {"before": metrics["baseline"]["accuracy"], "after": metrics["final"]["accuracy"],
            "weight": last.get("rollout_weight_mean"), "mismatch": last.get("rollout_logprob_diff_mean")}


def task_arguments(task: str, steps: int, folder: Path) -> list[str]:
    """arithmetic-generate (the embedded model, its presets) or SmolLM2-135M-Instruct's two-digit sums
    (benchmarks/real_model.py's task and recipe, whose 30 steps it keeps)."""
    if task == "sums":
        from real_model import RECIPE, write_task

        return ["--model", "smollm2-135m-instruct", "--dataset", str(write_task(folder)), "--prompt-field", "question",
                "--answer-field", "answer", *RECIPE]
    return ["--dataset", "arithmetic-generate", "--steps", str(steps), "--eval-every", "0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each on one thread)")
    parser.add_argument("--levels", default=None, help="K values, K+ with --in-flight-updates, e.g. 1,2+ (default: "
                        "0, 1, 2 over the seeds, and 4 with and without the correction at the first)")
    parser.add_argument("--task", choices=("arithmetic", "sums"), default="arithmetic")
    parser.add_argument("--output-dir", type=Path, default=None, help="keep the runs here (a rerun reads the "
                        "finished ones); default: a temporary folder")
    options = parser.parse_args()
    seeds = [int(seed) for seed in options.seeds.split(",")]
    if options.levels:
        plans = [(level.strip(), None, seeds) for level in options.levels.split(",")]
    else:
        plans = [(str(K), None, seeds) for K in (0, 1, 2)] + [("4", None, seeds[:1]), ("4", "none", seeds[:1])]
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(options.jobs) as pool:
        folder = options.output_dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        task = task_arguments(options.task, options.steps, folder)
        print(f"RLOO, post-train {' '.join(task)}; held-out greedy accuracy")
        print("| K (+: in-flight updates) | correction | after training (mean ± std over seeds) | each seed | last step: "
              "weight mean, |log π − log μ| |")
        print("|---:|---|---:|---|---|")
        pending = [[pool.submit(run, folder / f"{options.task}-{level.replace('+', 'p')}-{correction}-{seed}", seed,
                                level, task, correction)
                    for seed in plan_seeds] for level, correction, plan_seeds in plans]
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
    first = plans[0][0]
    low, high = min(means[first, None]), max(means[first, None])
    for level, correction, _ in plans[1:]:
        if correction is None:
            mean = statistics.fmean(means[level, None])
            print(f"K={level}: mean {mean:.3f} {'lies within' if low <= mean <= high else 'lies outside'} K={first}'s "
                  f"seeds' range [{low:.3f}, {high:.3f}]")

if __name__ == "__main__":
    main()
