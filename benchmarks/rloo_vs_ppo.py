"""RLOO against PPO with a critic at the generation level: memory, time and accuracy, side by side.

    python benchmarks/rloo_vs_ppo.py [--steps 600] [--seeds 42,43,44] [--group-size 4]

Runs ``auto-research compare --dataset arithmetic-generate --algorithms rloo,ppo-rlhf`` (every run in
a process of its own, the embedded model warm-started once beforehand) with the same prompts per
step, K, tokens, samples and hyperparameters for both, and prints the ratios measured in that one
invocation. Goals (issue 7): RLOO's peak training memory ≤ 0.6× PPO's and its median step time ≤ 0.6×
PPO's; RLOO's held-out accuracy ≥ PPO's after the same samples, over the seeds. The ratios are
reported whatever they are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="600")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--group-size", default="4")
    parser.add_argument("--output-dir", default=None, help="keep the runs here (default: a temporary folder)")
    options, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(options.output_dir or scratch)
        command = [sys.executable, "-m", "auto_research", "compare", "--dataset", "arithmetic-generate",
                   "--algorithms", "rloo,ppo-rlhf", "--seeds", options.seeds, "--group-size", options.group_size,
                   "--steps", options.steps, "--output-dir", str(output), *extra]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
        seeds = options.seeds.split(",")
        tag = f"seed{seeds[0]}" if len(seeds) == 1 else "seeds" + "-".join(seeds)
        summary = json.loads((output / f"classic-post-training-arithmetic-generate-{tag}.json").read_text())
    for K in options.group_size.split(","):
        rloo, ppo = summary["algorithms"][f"rloo-k{K}"], summary["algorithms"][f"ppo-rlhf-k{K}"]
        print(f"\nK = {K}, {rloo['samples']} samples each, seeds {seeds}:")
        for key, label in (("step_seconds", "median step time"), ("peak_memory_mb", "peak training memory")):
            ratio = rloo[key]["mean"] / ppo[key]["mean"]
            print(f"  {label}: RLOO {rloo[key]['mean']:.4g}, PPO {ppo[key]['mean']:.4g}: ratio {ratio:.2f} (goal <= 0.6)")
        print(f"  ({rloo['peak_memory_kind']})")
        print(f"  parameters held: RLOO {rloo['parameters']['total']:,}, PPO {ppo['parameters']['total']:,} "
              f"(trainable {rloo['parameters']['trainable']:,} vs {ppo['parameters']['trainable']:,})")
        for name, entry in (("RLOO", rloo), ("PPO", ppo)):
            final, before = entry["final"]["accuracy"], entry["baseline"]["accuracy"]
            spread = f" ± {final['std']:.3f}" if final["std"] is not None else ""
            print(f"  {name}: held-out accuracy {before['mean']:.3f} -> {final['mean']:.3f}{spread}, "
                  f"KL {entry['final']['kl_from_reference']['mean']:.3f}")
        wins = rloo["final"]["accuracy"]["mean"] >= ppo["final"]["accuracy"]["mean"]
        print(f"  RLOO's mean accuracy >= PPO's (goal): {'yes' if wins else 'no'}")


if __name__ == "__main__":
    main()
