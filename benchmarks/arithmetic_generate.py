"""The CPU demo's goal, measured: RLOO on arithmetic-generate against an honest warm start, over 3 seeds.

    python benchmarks/arithmetic_generate.py [--seeds 42,43,44]

1. Runs the README's main job as a user would:
   ``auto-research post-train --algorithm rloo --dataset arithmetic-generate``
   (from the warm-started tiny model the package ships: SFT on 300 fixed demonstrations; then RLOO on fresh
   prompts scored by the verifier), and times the whole command.
2. Control, for each seed: the same warm-started model, supervised fine-tuning continued on the same
   demonstrations for as long as that seed's RL phase ran (wall time).

Goals (issue 26): RL raises held-out greedy exact-match accuracy by at least 20 points over the warm start; the
whole command takes at most 5 minutes on these 2 cores; RL's gain is at least twice the
control's. Prints each seed, then the means with their ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="42,43,44")
    seeds = [int(seed) for seed in parser.parse_args().seeds.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        env = {**os.environ, "AUTO_RESEARCH_CACHE": str(scratch / "cache")}
        runs = []
        for seed in seeds:
            command = [sys.executable, "-m", "auto_research", "post-train", "--algorithm", "rloo",
                       "--dataset", "arithmetic-generate", "--output-dir", str(scratch / "runs"), "--no-progress",
                       "--seed", str(seed)]
            started = time.perf_counter()
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - started
            metrics = json.loads((scratch / "runs" / f"rloo-arithmetic-generate-seed{seed}" / "metrics.json").read_text())
            curve = ", ".join(f"{int(row['step'])}: {row['accuracy']:.3f}" for row in metrics["history"])
            print(f"seed {seed}: RL run done in {wall:.0f} s: held-out accuracy "
                  f"{metrics['baseline']['accuracy']:.3f} -> {metrics['final']['accuracy']:.3f} ({curve})", flush=True)
            runs.append((seed, wall, metrics))
        os.environ["AUTO_RESEARCH_CACHE"] = env["AUTO_RESEARCH_CACHE"]

        from auto_research.data import tasks
        from auto_research.engine.models import load_policy
        from auto_research.train import warm_start as tiny
        from auto_research.train.evaluation import greedy_accuracy
        from auto_research.train.sft import supervised_fine_tune

        task = tasks.arithmetic_task()
        folder = tiny.warm_started_path(task.name)
        record = tiny.warm_start_record(folder)
        pairs = [(example.prompt, example.solution) for example in tiny.demonstrations(task)]
        recipe = tiny.WARM_START
        curve = ", ".join(f"{row['held_out_accuracy']:.3f}" for row in record["history"])
        print(f"warm start: {record['demonstrations']} demonstrations, {recipe['steps']} steps, {record['seconds']:.0f} s; "
              f"held-out accuracy during SFT (every {recipe['steps'] // 4} steps): {curve}")
        rl_gains, control_gains = [], []
        for seed, wall, metrics in runs:
            model, tokenizer = load_policy(str(folder), "cpu", None, offline=True)
            before = greedy_accuracy(model, tokenizer, task)
            rl_seconds = metrics["training"]["training_seconds"]
            control = supervised_fine_tune(
                model, tokenizer, pairs, steps=10**9, batch_size=recipe["batch_size"],
                learning_rate=recipe["learning_rate"], seed=seed, progress=False, max_seconds=rl_seconds,
                evaluate=lambda: {"accuracy": greedy_accuracy(model, tokenizer, task)}, eval_every=200)
            after = greedy_accuracy(model, tokenizer, task)
            warm, final = metrics["baseline"]["accuracy"], metrics["final"]["accuracy"]
            rl_gains.append(100 * (final - warm))
            control_gains.append(100 * (after - before))
            along = ", ".join(f"{row['step']}: {row['accuracy']:.3f}" for row in control)
            print(f"seed {seed}: RLOO {metrics['training']['steps']} steps in {rl_seconds:.0f} s: {warm:.3f} -> "
                  f"{final:.3f} ({rl_gains[-1]:+.1f} points); SFT continued for the same {rl_seconds:.0f} s: "
                  f"{before:.3f} -> {after:.3f} ({control_gains[-1]:+.1f} points; along the way {along})", flush=True)

    def summary(values: list[float]) -> str:
        return f"{sum(values) / len(values):+.1f} points (range {min(values):+.1f} .. {max(values):+.1f})"

    rl_mean, sft_mean = sum(rl_gains) / len(rl_gains), sum(control_gains) / len(control_gains)
    print(f"RL's gain over {len(runs)} seeds: {summary(rl_gains)} (goal >= +20)")
    print(f"SFT continued for as long: {summary(control_gains)}; "
          + (f"RL's gain / SFT's: {rl_mean / sft_mean:.1f}x (goal >= 2)" if sft_mean > 0 else
             "SFT lost points, so RL's gain is more than twice SFT's (goal >= 2x: met)"))
    print("whole command: " + ", ".join(f"{wall:.0f} s" for _, wall, _ in runs) + " (goal <= 300 s)")


if __name__ == "__main__":
    main()
