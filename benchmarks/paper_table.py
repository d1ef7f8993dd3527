"""The RLOO paper's comparison on a real model: RLOO (K = 2 and 4) against PPO, REINFORCE with a baseline,
vanilla policy gradient, RAFT and GRPO at equal samples, on the two-digit sums of benchmarks/real_model.py
(SmolLM2-135M-Instruct; 1,600 prompts, the last 200 held out and never trained on), on the CPU.

    python benchmarks/paper_table.py --output-dir paper-runs            # the table's 21 runs, the β ablation's 6
    python benchmarks/paper_table.py --output-dir paper-runs --resume   # continue: finished runs are read
    python benchmarks/paper_table.py --only rloo,ppo-rlhf --resume            # some algorithms (rloo:4: one K)
    python benchmarks/paper_table.py --timing-only                            # step time and peak memory alone

One ``auto-research compare`` command runs the table: ``--samples-per-step`` gives every run the same completions
a step (K = 2 draws twice the prompts of K = 4) for the same steps, with the same β, learning rate, temperature and
length (real_model.py's recipe); each algorithm keeps its own defaults where they must differ (the table lists
them). One more command per β of the ablation runs RLOO K = 4 and PPO at the first seed. Every run keeps its
folder (metrics, curves, completions; its checkpoints are dropped once it finished). The script then reads every
finished run under the output folder and writes paper-table.md (the commands, the machine, the tables),
frontier.png (reward of the samples against their KL) and, from compare, the held-out accuracy curves with the
seeds' band (main/classic-post-training-*.png).

Step times and peak memory measured while the machine does other work are not clean figures: ``--timing-only``
runs each algorithm a few steps, one after another, in alternating order for ``--timing-rounds`` rounds, into
<output>/timing, and writes timing.md: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_model import HELD_OUT, RECIPE, write_task  # noqa: E402

RUNS = ("rloo:2", "rloo:4", "ppo-rlhf:2", "reinforce:2", "vanilla-pg:2", "raft:4", "grpo:4")
"""The table's runs, algorithm:K. K = 2 where the algorithm uses no group (PPO, REINFORCE, vanilla PG: the paper
samples one completion a prompt, and the generation level takes K >= 2), so that they see as many prompts as the
paper's; 4 where it needs a group (RAFT's best of 4, GRPO's group statistics)."""
BETA_RUNS = ("rloo:4", "ppo-rlhf:2")
REFERENCE = "rloo:4"
"""The run every other one's gain is set against."""
SHARED = ("--learning-rate", "--temperature", "--beta", "--max-new-tokens", "--warmup-steps")
"""The settings every run takes from real_model.py's recipe."""


def recipe_flags() -> list[str]:
    values = dict(zip(RECIPE[::2], RECIPE[1::2]))
    return [part for flag in SHARED for part in (flag, values[flag])]


def selected(runs: tuple[str, ...], only: str | None) -> list[str]:
    """The runs ``--only`` names: an algorithm (at each of its K) or algorithm:K."""
    if not only:
        return list(runs)
    wanted = [item.strip() for item in only.split(",") if item.strip()]
    unknown = [item for item in wanted if not any(item in (run, run.split(":")[0]) for run in RUNS)]
    if unknown:
        raise SystemExit(f"paper_table.py: --only {unknown[0]!r} is none of {', '.join(RUNS)}")
    return [run for run in runs if run in wanted or run.split(":")[0] in wanted]


def compare_command(args, data: Path, runs: list[str], seeds: str, folder: Path, beta: str | None = None,
                    steps: int | None = None, held_out: int | None = None, eval_every: int | None = None) -> list[str]:
    """``auto-research compare`` for these runs, at equal samples (the arguments after the program's name)."""
    flags = recipe_flags()
    if beta is not None:
        flags[flags.index("--beta") + 1] = beta
    return ["compare", "--dataset", str(data), "--model", args.model, "--prompt-field", "question",
            "--answer-field", "answer", "--algorithms", ",".join(runs), "--seeds", seeds,
            "--samples-per-step", str(args.samples_per_step), "--steps", str(steps or args.steps), *flags,
            "--evaluation-examples", str(held_out or args.held_out),
            "--eval-every", str(args.eval_every if eval_every is None else eval_every),
            "--checkpoint-every", str(args.eval_every), "--keep-checkpoints", "1", "--drop-checkpoints",
            "--output-dir", str(folder)]


def task_file(folder: Path) -> Path:
    """real_model.py's task file in ``folder``, replaced whole (a run of another invocation may be reading it)."""
    target = folder / "sums.jsonl"
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        os.replace(write_task(Path(scratch)), target)
    return target


def run_compare(argv: list[str]) -> None:
    from auto_research.cli import main

    print("$ auto-research " + shlex.join(argv), flush=True)
    code = main(argv)
    if code != 0:
        raise SystemExit(code)


# --- reading the finished runs ------------------------------------------------------------------------------


def collect(folder: Path, steps: int, samples_per_step: int, seeds: list[int] | None = None) -> dict:
    """(algorithm, K) → [(metrics, metrics.jsonl rows)] of every finished run under ``folder`` made with these
    steps and samples a step, by seed."""
    from auto_research.report.tables import read_jsonl

    found: dict = {}
    for path in sorted(folder.rglob("metrics.json")):
        metrics = json.loads(path.read_text())
        training = metrics["training"]
        if (training["steps"] != steps or training["prompts_per_step"] * training["group_size"] != samples_per_step
                or (seeds is not None and metrics["seed"] not in seeds)):
            continue
        found.setdefault((metrics["algorithm"], training["group_size"]), []).append(
            (metrics, read_jsonl(path.parent / "metrics.jsonl")))
    return {key: sorted(runs, key=lambda run: run[0]["seed"]) for key, runs in found.items()}


def run_figures(metrics: dict, rows: list[dict], window: int) -> dict:
    """One run's figures; the reward and KL of its samples are the means over its last ``window`` steps."""
    last = rows[-window:]
    return {"before": metrics["baseline"]["accuracy"], "after": metrics["final"]["accuracy"],
            "gain": 100 * (metrics["final"]["accuracy"] - metrics["baseline"]["accuracy"]),
            "reward": statistics.fmean(row["reward_mean"] for row in last),
            "kl": statistics.fmean(row["kl"] for row in last),
            "held_out_kl": metrics["final"]["kl_from_reference"],
            "step": statistics.median(row["step_seconds"] for row in rows),
            "memory": metrics["training"]["peak_memory_mb"],
            "counts": sorted({row["completions"] for row in rows}), "samples": sum(row["completions"] for row in rows),
            "prompts": metrics["training"]["prompts_per_step"]}


def frontier(runs: list[tuple[dict, list[dict]]], window: int) -> list[tuple[float, float]]:
    """(KL, reward) of the samples, averaged over each ``window`` steps and then over the seeds."""
    per_seed = [[(statistics.fmean(row["kl"] for row in rows[i:i + window]),
                  statistics.fmean(row["reward_mean"] for row in rows[i:i + window]))
                 for i in range(0, len(rows), window)] for _, rows in runs]
    return [tuple(statistics.fmean(points[i][part] for points in per_seed) for part in (0, 1))
            for i in range(min(len(points) for points in per_seed))]


def spread(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def difference(values: list[float], reference: list[float]) -> str:
    """Mean difference ± its standard error, sqrt(s²/n + s_ref²/n_ref) (one seed: no spread)."""
    mean = statistics.fmean(values) - statistics.fmean(reference)
    if len(values) < 2 or len(reference) < 2:
        return f"{mean:+.1f}"
    error = math.sqrt(statistics.variance(values) / len(values) + statistics.variance(reference) / len(reference))
    return f"{mean:+.1f} ± {error:.1f}"


# --- the report -------------------------------------------------------------------------------------------------


def main_table(figures: dict[str, list[dict]], window: int) -> list[str]:
    """Markdown: a row per run (mean ± std over seeds)."""
    lines = ["| run | K | prompts / step | completions / step (logged) | samples (logged) | seeds | held-out accuracy "
             "before | after | gain (points) | gain − RLOO K = 4's (points, ± s.e.) | reward of samples | "
             "KL of samples | held-out greedy KL | median step (s) | peak memory (MB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    reference = [run["gain"] for run in figures.get(REFERENCE, [])]
    for name, runs in figures.items():
        take = lambda key: [run[key] for run in runs]  # noqa: E731
        versus = "—" if name == REFERENCE or not reference else difference(take("gain"), reference)
        counts = sorted({count for run in runs for count in run["counts"]})
        lines.append(f"| {name} | {name.split(':')[1]} | {runs[0]['prompts']} | {', '.join(map(str, counts))} | "
                     f"{', '.join(str(s) for s in sorted(set(take('samples'))))} | {len(runs)} | "
                     f"{spread(take('before'))} | {spread(take('after'))} | {spread(take('gain'), 1)} | {versus} | "
                     f"{spread(take('reward'))} | {spread(take('kl'), 4)} | {spread(take('held_out_kl'), 4)} | "
                     f"{spread(take('step'), 2)} | {spread(take('memory'), 0)} |")
    return lines


def ordering(figures: dict[str, list[dict]]) -> list[str]:
    """The paper's ordering, RLOO ≥ PPO, RAFT, vanilla PG (and the rest), read from the mean gains."""
    if REFERENCE not in figures:
        return []
    reference = [run["gain"] for run in figures[REFERENCE]]
    lines = []
    for name, runs in figures.items():
        if name == REFERENCE:
            continue
        gains = [run["gain"] for run in runs]
        delta = statistics.fmean(reference) - statistics.fmean(gains)
        error = (math.sqrt(statistics.variance(reference) / len(reference) + statistics.variance(gains) / len(gains))
                 if min(len(reference), len(gains)) > 1 else math.nan)
        verdict = "≥" if delta >= 0 else "<"
        beyond = ("" if math.isnan(error) else
                  " (beyond 2 s.e.)" if abs(delta) > 2 * error else " (within 2 s.e.: not told apart)")
        lines.append(f"- RLOO K = 4 {verdict} {name}: {delta:+.1f} points of gain{beyond}")
    return lines


def beta_table(rows: list[tuple[str, str, dict]]) -> list[str]:
    lines = ["| run | β | seed | held-out accuracy before → after | reward of samples | KL of samples | "
             "held-out greedy KL |", "|---|---:|---:|---|---:|---:|---:|"]
    for name, beta, run in rows:
        lines.append(f"| {name} | {beta} | {run['seed']} | {run['before']:.3f} → {run['after']:.3f} | "
                     f"{run['reward']:.3f} | {run['kl']:.4f} | {run['held_out_kl']:.4f} |")
    return lines


def settings_table(names: list[str]) -> list[str]:
    """What differs between the algorithms, from their records (algorithms/registry.py)."""
    from auto_research.algorithms.registry import get_algorithm
    from auto_research.config.generation import GenerationConfig

    defaults = GenerationConfig()  # the critic's settings, which the commands leave at their defaults
    lines = ["| algorithm | advantage | policy loss | KL penalty | its own defaults |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(run.split(":")[0] for run in names):
        record = get_algorithm(name)
        own = []
        if record.needs_critic:
            own.append(f"a critic (initialised from the policy) with its own AdamW at the policy's learning rate; "
                       f"GAE λ {defaults.gae_lambda}, value-loss weight {defaults.vf_coef}, value clip "
                       f"{defaults.value_clip}")
        if record.whiten:
            own.append("advantages whitened over the batch")
        if record.moving_average:
            decay = record.moving_average
            own.append(f"baseline b ← {decay} b + {1 - decay:.1f} mean r̃ after each step")
        if record.policy_loss != "vanilla":
            own.append(f"clip ε {record.clip_low}")
        if record.reduction == "sum":
            own.append("trains on the best of K (first on ties)")
        if record.std:
            own.append(f"group std ({record.std})")
        where = ("none (β only measures the KL)" if record.kl == "none"
                 else f"in the {record.kl} ({record.kl_estimator})")
        lines.append(f"| {name} | {record.advantage} | {record.policy_loss} | {where} | {'; '.join(own) or '—'} |")
    return lines


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}; this process at nice {os.nice(0)}, load average "
            f"{os.getloadavg()[0]:.1f} when the report was written")


def report(args, folder: Path, data: Path) -> Path:
    """paper-table.md and frontier.png from every finished run under ``folder``."""
    from auto_research.files import atomic_write_text
    from auto_research.report.plots import frontier_plot

    window = args.eval_every
    found = collect(folder / "main", args.steps, args.samples_per_step, args.seeds_list)
    figures = {run: [run_figures(m, rows, window) for m, rows in found[key]]
               for run in RUNS if (key := (run.split(":")[0], int(run.split(":")[1]))) in found}
    curves = {run: frontier(found[(run.split(":")[0], int(run.split(":")[1]))], window) for run in figures}
    betas = beta_rows(args, folder, found)
    points = {f"{name} β={beta}": (run["kl"], run["reward"]) for name, beta, run in betas if beta != recipe_beta()}
    plot = frontier_plot(folder / "frontier.png", curves, points,
                         f"{Path(args.model).name}, two-digit sums: reward against KL\n{args.samples_per_step} "
                         f"samples a step, {args.steps} steps; a dot every {window} steps, the last ringed; "
                         "×: the β ablation")
    samples = sorted({run["samples"] for runs in figures.values() for run in runs})
    full = compare_command(args, data, list(RUNS), args.seeds, folder / "main")
    lines = [f"# The RLOO paper's comparison on {args.model}: two-digit sums, equal samples", "",
             f"Command: `python benchmarks/paper_table.py {args.command}`", "",
             f"The table's runs are one command: `auto-research {shlex.join(full)}`", "",
             f"Machine: {machine()}.", "",
             f"Budget: {args.samples_per_step} completions a step for {args.steps} steps "
             f"({args.samples_per_step * args.steps} samples a run), {' '.join(recipe_flags())}, held-out accuracy "
             f"on the last {args.held_out} prompts (greedy), evaluated every {args.eval_every} steps. "
             f"Equal samples, from the logged completion counts: "
             + ("every run the same, " + ", ".join(map(str, samples)) if len(samples) == 1
                else f"NOT EQUAL: {samples}") + ".", "",
             f"Reward and KL of samples: the mean over the last {window} steps (the KL per completion, sampled); "
             "held-out greedy KL: of the held-out greedy completions after training. Spread: ± the sample standard "
             "deviation over seeds; gain − RLOO K = 4's: ± the standard error of the difference.", "",
             *main_table(figures, window), "", *ordering(figures), "", "What differs between the algorithms:", "",
             *settings_table(list(RUNS)), "", "## β ablation (one seed)", "", *beta_table(betas), "",
             f"Figures: {plot.name} (reward against KL), main/classic-post-training-*.png (held-out accuracy against "
             "samples, mean and the seeds' band).", ""]
    return atomic_write_text(folder / "paper-table.md", "\n".join(lines))


def recipe_beta() -> str:
    return dict(zip(RECIPE[::2], RECIPE[1::2]))["--beta"]


def beta_rows(args, folder: Path, found: dict) -> list[tuple[str, str, dict]]:
    """(run, β, figures) of the ablation, with the table's own β at the first seed beside it."""
    seed = args.seeds_list[0]
    rows = []
    for run in BETA_RUNS:
        key = (run.split(":")[0], int(run.split(":")[1]))
        sources = [(recipe_beta(), found)] + [(beta, collect(folder / f"beta-{beta}", args.steps, args.samples_per_step,
                                                              [seed])) for beta in args.betas_list]
        for beta, runs in sorted(sources, key=lambda item: float(item[0])):
            for metrics, history in runs.get(key, []):
                if metrics["seed"] == seed:
                    rows.append((run, beta, {"seed": seed, **run_figures(metrics, history, args.eval_every)}))
    return rows


# --- timing alone ------------------------------------------------------------------------------------------------


def timing(args, folder: Path, data: Path) -> Path:
    """Each run a few steps, the runs one after another in alternating order, round after round: median step time
    and peak memory, measured apart from the long runs."""
    from auto_research.files import atomic_write_text

    runs, seed = selected(RUNS, args.only), args.seeds_list[0]
    measured: dict[str, list[tuple[float, float]]] = {run: [] for run in runs}
    for index in range(args.timing_rounds):
        order = runs if index % 2 == 0 else runs[::-1]
        round_folder = folder / "timing" / f"round{index + 1}"
        run_compare([*compare_command(args, data, order, str(seed), round_folder, steps=args.timing_steps,
                                      held_out=16, eval_every=0), "--overwrite"])
        summary = json.loads((round_folder / f"classic-post-training-{data.stem}-seed{seed}.json").read_text())
        for run in runs:
            entry = summary["algorithms"][f"{run.split(':')[0]}-k{run.split(':')[1]}"]
            measured[run].append((entry["step_seconds"]["mean"], entry["peak_memory_mb"]["mean"]))
    lines = [f"# Step time and peak memory alone: {args.model}, {args.samples_per_step} completions a step, "
             f"{args.timing_steps} steps a run, {args.timing_rounds} rounds in alternating order", "",
             f"Command: `python benchmarks/paper_table.py {args.command}`", "", f"Machine: {machine()}.", "",
             "| run | median step (s), median over rounds | each round's | peak memory (MB), median | each round's |",
             "|---|---:|---|---:|---|"]
    for run, values in measured.items():
        steps, peaks = [value[0] for value in values], [value[1] for value in values]
        lines.append(f"| {run} | {statistics.median(steps):.2f} | {', '.join(f'{v:.2f}' for v in steps)} | "
                     f"{statistics.median(peaks):.0f} | {', '.join(f'{v:.0f}' for v in peaks)} |")
    return atomic_write_text(folder / "timing.md", "\n".join(lines) + "\n")


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/paper-table"))
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples-per-step", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=10, help="also the window of the samples' reward and KL")
    parser.add_argument("--held-out", type=int, default=HELD_OUT)
    parser.add_argument("--betas", default="0.01,0.05,0.1", help="the ablation's β values; 'none' skips it")
    parser.add_argument("--only", help=f"comma-separated algorithms or algorithm:K of {', '.join(RUNS)}")
    parser.add_argument("--resume", action="store_true", help="read finished runs, continue interrupted ones")
    parser.add_argument("--timing-only", action="store_true", help="step time and peak memory alone (see above)")
    parser.add_argument("--timing-steps", type=int, default=4)
    parser.add_argument("--timing-rounds", type=int, default=2)
    args = parser.parse_args(argv)
    args.command = shlex.join(sys.argv[1:] if argv is None else argv)
    args.seeds_list = [int(seed) for seed in args.seeds.split(",")]
    args.betas_list = [] if args.betas == "none" else [beta.strip() for beta in args.betas.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    folder = args.output_dir.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = task_file(folder)
    started = time.perf_counter()
    if args.timing_only:
        print(f"wrote {timing(args, folder, data)}")
        return
    resume = ["--resume"] if args.resume else []
    if main_runs := selected(RUNS, args.only):
        run_compare([*compare_command(args, data, main_runs, args.seeds, folder / "main"), *resume])
    for beta in args.betas_list if (beta_runs := selected(BETA_RUNS, args.only)) else []:
        run_compare([*compare_command(args, data, beta_runs, str(args.seeds_list[0]), folder / f"beta-{beta}",
                                      beta=beta), *resume])
    path = report(args, folder, data)
    print(Path(path).read_text())
    print(f"wrote {path} ({(time.perf_counter() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
