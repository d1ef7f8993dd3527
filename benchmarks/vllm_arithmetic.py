"""The README's main job with each sampler, over seeds: does vLLM as the rollout engine train as well?

    python benchmarks/vllm_arithmetic.py                      # seeds 42,43,44, builtin then vllm
    python benchmarks/vllm_arithmetic.py --seeds 42 --samplers vllm
    python benchmarks/vllm_arithmetic.py --samplers vllm-server   # auto-research vllm-serve, started here

Each run is ``auto-research post-train --dataset arithmetic-generate --seed S --sampler X`` (600 steps on the
embedded model, warm-started once and cached). The table gives held-out greedy accuracy before and after,
the training time, and for vLLM the largest per-token |log π_trainer − log μ_vLLM| of any step and the
mean k3 KL of the trainer from the sampler (the goal: ≤ 1e-3 in fp32 through the whole run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from servers import start_server


def run(sampler: str, seed: int, folder: Path, threads: int | None, address: str | None = None) -> dict:
    engine = ["--sampler", "vllm", "--vllm-mode", "server", "--vllm-server", address] if address else \
        ["--sampler", sampler]
    command = [sys.executable, "-m", "auto_research", "post-train", "--dataset", "arithmetic-generate",
               "--seed", str(seed), *engine, "--output-dir", str(folder / sampler), "--no-progress"]
    if threads:
        command += ["--threads", str(threads)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = folder / sampler / f"rloo-arithmetic-generate-seed{seed}"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"before": metrics["baseline"]["accuracy"], "after": metrics["final"]["accuracy"],
            "seconds": metrics["training"]["training_seconds"],
            "diff_max": max((row.get("rollout_logprob_diff_max", 0.0) for row in rows), default=0.0),
            "k3": statistics.fmean(row.get("rollout_k3_kl", 0.0) for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--samplers", default="builtin,vllm")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: one per core)")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for sampler in args.samplers.split(","):
            server, address = start_server(threads=args.threads) if sampler == "vllm-server" else (None, None)
            for seed in seeds:
                result = run(sampler, seed, Path(scratch), args.threads, address)
                results.setdefault(sampler, []).append(result)
                drift = ("" if sampler == "builtin" else
                         f", max |Δlog p| {result['diff_max']:.2e}, mean k3 {result['k3']:.2e}")
                print(f"{sampler} seed {seed}: {result['before']:.3f} -> {result['after']:.3f} in "
                      f"{result['seconds']:.0f} s{drift}", flush=True)
            if server is not None:
                server.terminate()
                server.wait()
    print(f"\n{'sampler':<12} {'before':>7} {'after (mean ± std over ' + str(len(seeds)) + ' seeds)':>34} "
          f"{'training':>9} {'max |Δlog p|':>13}")
    for sampler, rows in results.items():
        after = [row["after"] for row in rows]
        spread = statistics.stdev(after) if len(after) > 1 else 0.0
        print(f"{sampler:<12} {rows[0]['before']:>7.3f} {statistics.fmean(after):>26.3f} ± {spread:.3f}    "
              f"{statistics.fmean(row['seconds'] for row in rows):>7.0f} s "
              f"{'(its own)' if sampler == 'builtin' else format(max(row['diff_max'] for row in rows), '.2e'):>13}")


if __name__ == "__main__":
    main()
