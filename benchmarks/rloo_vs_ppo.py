"""RLOO against PPO with a critic at the generation level: memory, time and accuracy, side by side.

    python benchmarks/rloo_vs_ppo.py [--steps 600] [--seeds 42,43,44] [--group-size 4]
    python benchmarks/rloo_vs_ppo.py --model smollm2 [--prompts 8] [--new-tokens 32] [--micro-batches 0,8]

Without ``--model``: ``auto-research compare --dataset arithmetic-generate --algorithms rloo,ppo-rlhf`` on the
embedded 0.39M-parameter model, every run in a process of its own, with the same prompts per step, K, tokens,
samples and hyperparameters for both; it prints the ratios measured in that one invocation, and accuracy.

With ``--model smollm2``: SmolLM2-135M-Instruct (134.5M parameters), where weights and activations count.
Each (algorithm, micro-batch) runs a few steps in a process of its own, the two algorithms alternating, at
equal work (the same prompts, K, tokens, seed; PPO's critic starts from the policy; sampling in one call). It prints the median step
time and its phases, the peak memory above what the process held before the models loaded, and that peak
broken down: the training state counted tensor by tensor (weights, gradients, AdamW's moments, the
reference, the critic) and the rest (activations, logits, the allocator's working memory), next to the
arithmetic floor of fp32 AdamW: 16 bytes per trainable weight and 4 per frozen one, 20 against 36 bytes a
weight (0.56×) if PPO held both models' gradients at once; it frees the policy's after its step, before the
critic's, so its floor is 32 bytes a weight and RLOO's best ratio 0.625. Goals: RLOO ≤ 0.6× PPO's peak training
memory and ≤ 0.5× its step time (issue 15); on SmolLM2, the peak within 5% of that floor, ≤ 0.656 (issue 26).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from children import child_result  # noqa: E402


def arithmetic(options, extra) -> None:
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


def child(options) -> None:
    """One measured run: prints RESULT json."""
    import torch

    from auto_research.config.generation import GenerationConfig
    from auto_research.train.memory import resident_bytes
    from auto_research.train.trainer import Trainer
    from smollm2 import digit_reward, held_bytes, model_folder, sums

    torch.set_num_threads(options.threads)
    folder = model_folder()
    before = resident_bytes()
    config = GenerationConfig(algorithm=options.child, model=str(folder), dataset="memory:sums",
                              prompt_field="question", answer_field="answer", output_dir=Path(options.scratch),
                              steps=options.run_steps, prompts_per_step=options.prompts, group_size=4,
                              max_new_tokens=options.new_tokens, beta=0.05, learning_rate=1e-6, warmup_steps=0,
                              temperature=1.0, eval_every=0, checkpoint_every=0, evaluation_examples=1,
                              micro_batch_size=options.micro_batch or None,
                              generation_batch_size=options.prompts * 4, offline=True, device="cpu",
                              dtype="float32", progress=False, seed=0,
                              gradient_checkpointing=options.gradient_checkpointing)
    trainer = Trainer.build(config, log=lambda text: None, rows=sums(64),
                            reward_functions=[("digits", lambda p, c, r: digit_reward(c))])
    rows = [trainer.step(step) for step in range(1, options.run_steps + 1)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"rows": rows, "peak_mb": (peak - before) / 2**20,
                                  "held": held_bytes(trainer.models, trainer.run.config.lora.lora_r)}), flush=True)


def _run(algorithm: str, micro: int, options, scratch: str) -> dict:
    command = [sys.executable, __file__, "--child", algorithm, "--micro-batch", str(micro), "--prompts",
               str(options.prompts), "--new-tokens", str(options.new_tokens), "--run-steps", str(options.run_steps),
               "--threads", str(options.threads), "--scratch", scratch,
               *(["--gradient-checkpointing"] if options.gradient_checkpointing else [])]
    return child_result(command, options.threads, f"{algorithm} (micro-batch {micro})")


PHASES = ("sample", "experience", "update_actor", "update_critic")


def real_model(options) -> None:
    from smollm2 import model_folder

    model_folder()  # converted once, before any run is timed
    micros = [int(value) for value in options.micro_batches.split(",")]
    print(f"SmolLM2-135M-Instruct, {options.prompts} prompts x K=4 a step, <= {options.new_tokens} new tokens, "
          f"fp32, {options.threads} threads, {options.run_steps} steps a run (the first not counted), "
          f"{options.rounds} alternating rounds"
          + (", both with --gradient-checkpointing" if options.gradient_checkpointing else ""))
    for micro in micros:
        runs = {"rloo": [], "ppo-rlhf": []}
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(options.rounds):
                for algorithm in runs:
                    runs[algorithm].append(_run(algorithm, micro, options, f"{scratch}/{algorithm}-{round_}"))
        label = "the whole batch" if not micro else f"micro-batches of {micro} completions"
        print(f"\n{label}:")
        summary = {}
        for algorithm, results in runs.items():
            rows = [row for result in results for row in result["rows"][1:]]
            step = statistics.median(row["step_seconds"] for row in rows)
            phases = {phase: statistics.median(row[f"time_{phase}"] for row in rows) for phase in PHASES}
            peak = statistics.median(result["peak_mb"] for result in results)
            held = results[0]["held"]
            summary[algorithm] = (step, peak, held)
            print(f"  {algorithm:9s} median step {step:6.2f} s (" + ", ".join(f"{p} {s:.2f}" for p, s in phases.items())
                  + f") | peak memory {peak:6.0f} MB = training state {held['peak']:5.0f} (weights "
                  f"{held['weights']:.0f}, AdamW {held['adamw']:.0f}, reference {held['reference']:.0f}, critic "
                  f"weights and AdamW {held['critic']:.0f}, one model's gradients "
                  f"{max(held['gradients'], held['critic_gradients']):.0f}) + activations, logits and working memory "
                  f"{peak - held['peak']:.0f}")
        (r_step, r_peak, r_held), (p_step, p_peak, p_held) = summary["rloo"], summary["ppo-rlhf"]
        print(f"  RLOO / PPO: step time {r_step / p_step:.2f} (goal <= 0.5), peak memory {r_peak / p_peak:.3f} "
              f"(goal <= 0.656, within 5% of the floor), training state at the peak {r_held['peak'] / p_held['peak']:.2f} (the floor: 20 bytes "
              "a weight against 32, PPO's gradients being freed between its two updates: 0.625; 20 / 36 = 0.56 "
              "only if both sets of gradients were held at once)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2"], default=None,
                        help="a real model instead of compare on the embedded one")
    parser.add_argument("--steps", default="600")
    parser.add_argument("--seeds", default="42,43,44")
    parser.add_argument("--group-size", default="4")
    parser.add_argument("--output-dir", default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--micro-batches", default="0,8", help="0: the whole batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--run-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both with --gradient-checkpointing (the policy's and the critic's layers recomputed)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    options, extra = parser.parse_known_args()
    if options.child:
        return child(options)
    if options.model == "smollm2":
        return real_model(options)
    arithmetic(options, extra)


if __name__ == "__main__":
    main()
