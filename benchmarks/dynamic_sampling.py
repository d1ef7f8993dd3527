"""RLOO with and without dynamic sampling on the CPU demo: trained tokens and time to RLOO's accuracy.

    OMP_NUM_THREADS=1 python benchmarks/dynamic_sampling.py [--steps N] [--seeds 42,43,44] [--eval-every 30]

Each seed runs ``auto-research post-train --dataset arithmetic-generate`` (RLOO's preset: 32 prompts × K = 4 a step)
twice, with ``--no-dynamic-sampling`` and ``--dynamic-sampling``, alternating, with a held-out evaluation every
``--eval-every`` steps. The target is RLOO's accuracy: the mean over the seeds of plain RLOO's final held-out
accuracy. For each run it finds the first evaluation at or above the target and adds up, to that step, the tokens
trained on (completion tokens in the batches the loss saw), the tokens sampled (refills included) and the seconds
of training. It prints each run, then the ratios dynamic / plain of the means (goal, issue 25: fewer trained tokens
to RLOO's accuracy; the time ratio is reported whichever way it goes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

K = 4


def run(dynamic: bool, seed: int, steps: int | None, eval_every: int, output: Path) -> dict:
    name = "dynamic" if dynamic else "plain"
    command = [sys.executable, "-m", "auto_research", "post-train", "--algorithm", "rloo", "--dataset",
               "arithmetic-generate", "--seed", str(seed), "--output-dir", str(output / name), "--no-progress",
               "--checkpoint-every", "0", "--overwrite", "--eval-every", str(eval_every), "--log-completions", "0",
               "--threads", os.environ.get("OMP_NUM_THREADS", "1"),
               "--dynamic-sampling" if dynamic else "--no-dynamic-sampling"]
    if steps is not None:
        command += ["--steps", str(steps)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    folder = output / name / f"rloo-arithmetic-generate-seed{seed}"
    metrics = json.loads((folder / "metrics.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [row for row in rows if "loss" in row and "step" in row and "completion_length" in row]
    prompts = metrics["training"]["prompts_per_step"]
    curve = [(int(entry["step"]), entry["accuracy"]) for entry in metrics["history"]]
    return {"start": metrics["baseline"]["accuracy"], "end": metrics["final"]["accuracy"], "curve": curve,
            "rows": steps_rows, "prompts": prompts}


def to_target(result: dict, target: float) -> dict | None:
    """Trained tokens, sampled tokens and seconds up to the first evaluation at or above ``target``."""
    reached = next((step for step, accuracy in result["curve"] if accuracy >= target), None)
    if reached is None:
        return None
    rows = [row for row in result["rows"] if row["step"] <= reached]
    trained = sum(row["completion_length"] * result["prompts"] * K for row in rows)
    sampled = sum(row["completion_length"] * (row.get("prompts_sampled", result["prompts"])) * K for row in rows)
    return {"step": reached, "trained": trained, "sampled": sampled,
            "seconds": sum(row["step_seconds"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the preset's (600)")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/dynamic-sampling"))
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results = {"plain": [], "dynamic": []}
    for seed in seeds:
        for dynamic in (False, True):
            result = run(dynamic, seed, args.steps, args.eval_every, args.output_dir)
            results["dynamic" if dynamic else "plain"].append(result)
            refills = sum(row.get("refills", 0) for row in result["rows"])
            print(f"{'dynamic' if dynamic else 'plain  '} seed {seed}: {result['start']:.3f} -> {result['end']:.3f} "
                  f"({refills} refills; curve {', '.join(f'{s}: {a:.3f}' for s, a in result['curve'])})", flush=True)
    target = statistics.mean(r["end"] for r in results["plain"])
    print(f"\ntarget: plain RLOO's final held-out accuracy, mean over {len(seeds)} seeds = {target:.3f}")
    means = {}
    for name, runs in results.items():
        reached = [to_target(r, target) for r in runs]
        got = [r for r in reached if r is not None]
        for seed, r in zip(seeds, reached):
            print(f"{name} seed {seed}: " + ("never reached" if r is None else
                  f"step {r['step']}, {r['trained']:.0f} tokens trained, {r['sampled']:.0f} sampled, "
                  f"{r['seconds']:.0f} s"))
        if got:
            means[name] = {key: statistics.mean(r[key] for r in got) for key in ("trained", "sampled", "seconds")}
            means[name]["reached"] = len(got)
    if "plain" in means and "dynamic" in means:
        p, d = means["plain"], means["dynamic"]
        print(f"dynamic / plain, to {target:.3f} (means over the seeds that reached it: {d['reached']} and "
              f"{p['reached']} of {len(seeds)}): trained tokens {d['trained'] / p['trained']:.2f}x, sampled tokens "
              f"{d['sampled'] / p['sampled']:.2f}x, training time {d['seconds'] / p['seconds']:.2f}x")


if __name__ == "__main__":
    main()
