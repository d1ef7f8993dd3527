"""A real model that learns: RLOO on SmolLM2-135M-Instruct, two-digit sums, on the CPU.

    python benchmarks/real_model.py                 # RLOO and the shuffled-reward control, then the table
    python benchmarks/real_model.py --runs rloo     # RLOO alone
    python benchmarks/real_model.py --runs rloo,rloo-k1,rloo-k2   # RLOO with rollouts in flight, K = 1 and 2
    python benchmarks/real_model.py --quick         # RLOO alone for 5 steps: learning shown in minutes

The task: "What is a + b? Reply with only the number." for every pair a, b in 10..49 (1,600 prompts),
shuffled with seed 0; the last 200 rows of the file are the held-out set (the CLI holds out a data file's
last ``--evaluation-examples`` rows), never trained on and never looked at while the recipe was chosen (it was
tuned on 100 training prompts). Accuracy is the built-in ``match`` verifier: the last number of the greedy
completion equals the sum. The untrained model answers about a third right (0.335), mostly because it does not
stop after the number, or gets a carry wrong.

The control trains exactly like RLOO, same seed, same prompts, same sampler and the same KL penalty, but each
batch's rewards are shuffled among its samples before the update: the same amount of updates and of reward
pressure, with the link between a completion and its correctness cut. If the control gains as much, the gain
was not RL's (it was, e.g., the KL penalty or the sampling temperature).

Both runs go through the command line a user would type; the table prints before, after, the gain and the
training wall time, read from each run's metrics.json.

``--quick`` runs RLOO alone for 5 steps (``--steps`` sets any run's steps; a run of other than 30 steps gets a
folder of its own, ``rloo-5-steps``): accuracy moves most in the first steps, so 5 show the gain in minutes, without
the control's second run (its figure: docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from smollm2 import QUESTION, model_folder  # noqa: E402

HELD_OUT = 200
STEPS = 30
QUICK_STEPS = 5
RECIPE = ["--algorithm", "rloo", "--steps", str(STEPS), "--learning-rate", "5e-6", "--group-size", "8",
          "--prompts-per-step", "8", "--temperature", "0.7", "--beta", "0.02", "--max-new-tokens", "16",
          "--warmup-steps", "0", "--evaluation-examples", str(HELD_OUT), "--eval-every", "0",
          "--checkpoint-every", "0"]
CONTROL_REWARD = '''\
import random

from types import SimpleNamespace

from auto_research.rewards.verifiers import is_correct

_shuffle = random.Random(0)


def shuffled_match(prompts, completions, rows):
    """The match reward, shuffled among the batch's samples: as much reward, no link to the completion."""
    values = [float(is_correct("match", text, SimpleNamespace(answer=row["answer"])))
              for text, row in zip(completions, rows)]
    _shuffle.shuffle(values)
    return values
'''


def write_task(folder: Path) -> Path:
    pairs = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    random.Random(0).shuffle(pairs)
    path = folder / "sums.jsonl"
    with path.open("w") as handle:
        for a, b in pairs:
            handle.write(json.dumps({"question": QUESTION.format(a=a, b=b), "answer": str(a + b)}) + "\n")
    return path


def with_steps(steps: int) -> list[str]:
    """RECIPE with ``steps`` steps."""
    recipe = list(RECIPE)
    recipe[recipe.index("--steps") + 1] = str(steps)
    return recipe


def run(name: str, data: Path, folder: Path, model: Path, seed: int, steps: int, extra: list[str]) -> dict:
    run_dir = folder / name
    command = [sys.executable, "-m", "auto_research", "post-train", "--dataset", str(data), "--model",
               str(model), "--prompt-field", "question", "--answer-field", "answer", "--seed", str(seed),
               "--output-dir", str(run_dir), "--overwrite", *with_steps(steps), *extra]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=folder)
    return json.loads(next(run_dir.glob("*/metrics.json")).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="rloo,control", help="comma-separated: rloo, control, rloo-k1, rloo-k2")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/real-model"))
    parser.add_argument("--reuse", action="store_true", help="read a run's metrics.json when it already exists")
    parser.add_argument("--steps", type=int, default=None, help=f"steps a run (default {STEPS}; --quick: "
                        f"{QUICK_STEPS})")
    parser.add_argument("--quick", action="store_true", help=f"RLOO alone, {QUICK_STEPS} steps: learning shown in "
                        "minutes on 2 CPU cores, without the control")
    args = parser.parse_args()
    if args.quick:
        args.runs = "rloo"
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else STEPS
    if steps < 1:
        parser.error("--steps must be at least 1")
    folder = args.output_dir.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = write_task(folder)
    (folder / "control_reward.py").write_text(CONTROL_REWARD)
    model = model_folder()
    extras = {"rloo": [], "control": ["--reward", "control_reward:shuffled_match"],
              # Rollouts in flight (docs/async.md): the same recipe, each batch drawn by weights K versions old.
              "rloo-k1": ["--max-staleness", "1"], "rloo-k2": ["--max-staleness", "2"]}
    results = {}
    for name in args.runs.split(","):
        if name not in extras:
            parser.error(f"--runs: no run {name!r} (rloo, control, rloo-k1, rloo-k2)")
        folder_name = name if steps == STEPS else f"{name}-{steps}-steps"
        done = list((folder / folder_name).glob("*/metrics.json")) if args.reuse else []
        results[name] = (json.loads(done[0].read_text()) if done
                         else run(folder_name, data, folder, model, args.seed, steps, extras[name]))
    print(textwrap.dedent(f"""
        SmolLM2-135M-Instruct, two-digit sums, {HELD_OUT} held-out prompts, greedy, final-number accuracy
        (seed {args.seed}, {' '.join(with_steps(steps))})
    """))
    print(f"{'run':<10} {'before':>8} {'after':>8} {'gain':>8} {'training':>10}")
    for name, metrics in results.items():
        before, after = metrics["baseline"]["accuracy"], metrics["final"]["accuracy"]
        seconds = metrics["training"]["training_seconds"]
        print(f"{name:<10} {before:>8.3f} {after:>8.3f} {100 * (after - before):>+7.1f}p {seconds / 60:>8.1f} min")


if __name__ == "__main__":
    main()
