"""On-policy distillation on the CPU demo: RLOO alone against RLOO with a teacher's dense term, in steps to a target.

    OMP_NUM_THREADS=1 python benchmarks/distill.py --teacher FOLDER [--steps 300] [--seeds 1,2,3] [--eval-every 20]
    OMP_NUM_THREADS=2 python benchmarks/distill.py --model smollm2 --teacher CHECKPOINT --steps 5 --eval-every 1 \
        --seeds 42 --arms rloo,opd,rloo+teacher --teacher-share 0.9

The student is arithmetic-generate's shipped warm start (the main job's starting point); the teacher is a model folder
of the main job's RL-trained policy, for example the last checkpoint of
``auto-research post-train --algorithm rloo --dataset arithmetic-generate --output-dir /tmp/teacher``. Each seed runs
three arms at equal samples (32 prompts × K = 4 a step), with a held-out evaluation every ``--eval-every`` steps:
``rloo`` (RLOO alone, its KL to the initial policy in the reward), ``rloo+teacher`` (λ = 1, the LOO baseline on the
dense term; the reference KL off, as by default with a teacher) and ``rloo+teacher-none``
(--distill-baseline none); ``--arms`` may add ``opd`` (the teacher alone, no task reward). The target is RLOO alone's final held-out accuracy, averaged over the seeds; each run's
figure is the first evaluated step at or above it. Printed: each run, the mean and spread of steps to the target per
arm, each teacher arm's ratio to RLOO's (issue 55's goal: ≤ 0.2), and what the baseline removes per token, over the
run's steps: 1 − var(d − b)/var(d) and 1 − E[(d − b)²]/E[d²] (the same samples with and without b; goal ≥ 20%).

``--model smollm2``: the student is SmolLM2-135M-Instruct untrained, on ``real_model.py``'s task and recipe (two-digit
sums, 200 held out, 8 prompts × K = 8 a step, lr 5e-6), and the teacher a checkpoint of an RLOO run of that recipe
(``python benchmarks/real_model.py --quick --output-dir D``'s run keeps its last step under
``D/rloo-5-steps/rloo-sums-seed42/checkpoints/step-000005``). ``--teacher-share F`` sets the target to F times the
teacher's own final held-out accuracy, read from its run's metrics.json (issue 55: 0.9), in place of RLOO's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ARMS = {"rloo": [], "rloo+teacher": ["--distill-weight", "1"],
        "rloo+teacher-none": ["--distill-weight", "1", "--distill-baseline", "none"],
        "opd": ["--algorithm", "opd"]}
"""Each arm's flags (``--arms`` picks some; the default is the first three; ``opd`` learns from the teacher alone)."""


def task(model: str, output: Path) -> list[str]:
    """The student and its task: the shipped warm start on arithmetic-generate, or SmolLM2 on real_model.py's sums
    with its recipe (the flags after it override the recipe's steps and evaluations)."""
    if model == "embedded":
        return ["--algorithm", "rloo", "--dataset", "arithmetic-generate"]
    from real_model import RECIPE, write_task  # noqa: PLC0415
    from smollm2 import model_folder  # noqa: PLC0415

    output.mkdir(parents=True, exist_ok=True)
    return ["--dataset", str(write_task(output)), "--model", str(model_folder()), "--prompt-field", "question",
            "--answer-field", "answer", *RECIPE]


def run(arm: str, teacher: str, seed: int, steps: int, eval_every: int, output: Path, reuse: bool,
        student: list[str]) -> dict:
    folder = output / arm.replace("+", "-") / f"seed{seed}"
    command = [sys.executable, "-m", "auto_research", "post-train", *student, *ARMS[arm],
               "--seed", str(seed), "--steps", str(steps), "--eval-every", str(eval_every),
               "--output-dir", str(folder.parent), "--run-name", folder.name, "--overwrite", "--no-progress",
               "--checkpoint-every", "0", "--log-completions", "0", "--threads", os.environ.get("OMP_NUM_THREADS", "1"),
               *(["--teacher-model", teacher] if arm != "rloo" else [])]
    if not (reuse and (folder / "metrics.json").is_file()):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((folder / "metrics.json").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    reduction, square = ([row[key] for row in rows if key in row]
                         for key in ("distill_variance_reduction", "distill_square_reduction"))
    return {"curve": [(int(entry["step"]), entry["accuracy"]) for entry in metrics["history"]],
            "start": metrics["baseline"]["accuracy"], "end": metrics["final"]["accuracy"],
            "reduction": statistics.fmean(reduction) if reduction else None,
            "square": statistics.fmean(square) if square else None,
            "reverse_kl": [row["teacher_reverse_kl"] for row in rows if "teacher_reverse_kl" in row]}


def steps_to(result: dict, target: float) -> int | None:
    return next((step for step, accuracy in result["curve"] if step > 0 and accuracy >= target), None)


def spread(values: list) -> str:
    reached = [value for value in values if value is not None]
    if not reached:
        return "not reached"
    missed = len(values) - len(reached)
    return (f"{statistics.fmean(reached):.0f} (min {min(reached)}, max {max(reached)})"
            + (f", {missed} run(s) never reached it" if missed else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True, help="the teacher's model folder (the main job's trained policy)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path("runs/benchmark-distill"))
    parser.add_argument("--reuse", action="store_true", help="read a run already in --output instead of running it")
    parser.add_argument("--arms", default="rloo,rloo+teacher,rloo+teacher-none", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--model", choices=("embedded", "smollm2"), default="embedded",
                        help="the student: the shipped warm start, or SmolLM2-135M-Instruct on real_model.py's task")
    parser.add_argument("--teacher-share", type=float, default=None,
                        help="target: this share of the teacher's final held-out accuracy (its run's metrics.json), "
                             "in place of RLOO alone's final accuracy")
    args = parser.parse_args()
    seeds, arms = [int(seed) for seed in args.seeds.split(",")], args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        parser.error(f"--arms: no arm {unknown[0]!r} (choose from {', '.join(ARMS)})")
    target = None
    if args.teacher_share is not None:
        teacher_metrics = Path(args.teacher).resolve().parent.parent / "metrics.json"
        if not teacher_metrics.is_file():
            parser.error(f"--teacher-share: no metrics.json of the teacher's run at {teacher_metrics}")
        taught = json.loads(teacher_metrics.read_text())["final"]["accuracy"]
        target = args.teacher_share * taught
        print(f"target: {args.teacher_share} × the teacher's final held-out accuracy {taught:.4f} = {target:.4f}")
    student = task(args.model, args.output.resolve())
    results = {arm: {} for arm in arms}
    for seed in seeds:  # seed-major: a cut run still covers every arm
        for arm in arms:
            results[arm][seed] = result = run(arm, args.teacher, seed, args.steps, args.eval_every, args.output,
                                              args.reuse, student)
            print(f"{arm:<26} seed {seed}: accuracy {result['start']:.3f} -> {result['end']:.3f}, curve "
                  + " ".join(f"{step}:{accuracy:.3f}" for step, accuracy in result["curve"])
                  + (f", variance reduction {result['reduction']:.3f}, mean-square reduction {result['square']:.3f}"
                     if result["square"] is not None else ""),
                  flush=True)
    if "rloo" not in results:
        return
    if target is None:
        target = statistics.fmean(result["end"] for result in results["rloo"].values())
        print(f"\ntarget: RLOO alone's final held-out accuracy, mean over seeds {seeds}: {target:.4f}")
    reached = {arm: [steps_to(result, target) for result in by_seed.values()] for arm, by_seed in results.items()}
    for arm, steps in reached.items():
        print(f"{arm:<26} steps to the target: {spread(steps)}; per seed {steps}")
    rloo = [step for step in reached["rloo"] if step is not None]
    for arm in (arm for arm in reached if arm != "rloo"):
        taught = [step for step in reached[arm] if step is not None]
        if rloo and taught:
            print(f"ratio {arm} / rloo (means of the runs that reached it): "
                  f"{statistics.fmean(taught) / statistics.fmean(rloo):.3f}")
    for key, what in (("reduction", "1 − var(d − b)/var(d)"), ("square", "1 − E[(d − b)²]/E[d²]")):
        values = [result[key] for result in results.get("rloo+teacher", {}).values() if result[key] is not None]
        if values:
            print(f"LOO baseline, {what} per token, mean over the steps: " + ", ".join(f"{v:.3f}" for v in values)
                  + f" (mean {statistics.fmean(values):.3f})")


if __name__ == "__main__":
    main()
