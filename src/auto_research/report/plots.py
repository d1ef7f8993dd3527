"""What a run leaves behind as pictures: training curves, comparisons, over-optimisation (PNG, written atomically).
matplotlib is imported here and only here: the command line and runs that draw nothing never pay for it.
"""

from __future__ import annotations

import io
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen first

from auto_research.files import atomic_write_bytes  # noqa: E402
from auto_research.report.tables import LABELS  # noqa: E402


def _saved(path: Path, figure, dpi: int) -> Path:
    """The figure laid out (``tight_layout``), written as a PNG to ``path`` atomically, and closed."""
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    plt.close(figure)
    return atomic_write_bytes(path, buffer.getvalue())


def comparison_plot(path: Path, histories: dict[str, list[list[dict]]], title: str) -> Path:
    """PNG: validation accuracy and KL(reference) against steps, one line per algorithm (the mean over seeds)."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, per_seed in histories.items():
        steps = [row["step"] for row in per_seed[0]]
        for axis, key in zip(axes, ("accuracy", "kl_from_reference")):
            curve = [statistics.fmean(run[i][key] for run in per_seed) for i in range(len(steps))]
            axis.plot(steps, curve, marker="o", markersize=3, label=name)
    for axis, key in zip(axes, ("accuracy", "kl_from_reference")):
        axis.set_xlabel("step")
        axis.set_ylabel(f"validation {LABELS[key]}")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    return _saved(path, figure, 120)


def _values(rows: list[dict], key: str) -> list[float]:
    return [math.nan if row.get(key) is None else row[key] for row in rows]


def _same(first: list[float], second: list[float]) -> bool:
    """Two curves equal to rounding (NaN where both have none): one reward function's and the mean reward."""
    return all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
               for a, b in zip(first, second))


def _held_out(metrics: dict) -> tuple[str, list[float], list[float]]:
    """The held-out evaluations: before training (step 0), each one during it, and the run's last (metrics.json's
    ``final``, drawn at the last step when no evaluation fell there: --eval-every 0, TRL's eval_strategy no). Their
    accuracy, or their mean reward where rows have no answers (accuracy None)."""
    steps = metrics.get("training", {}).get("steps")
    points = [{"step": 0.0, **metrics["baseline"]}, *metrics["history"]]
    if steps is not None and points[-1]["step"] < steps:
        points.append({"step": float(steps), **metrics["final"]})
    key = "accuracy" if any(point.get("accuracy") is not None for point in points) else "mean_reward"
    label = "held-out greedy accuracy" if key == "accuracy" else "held-out mean reward (rows without answers)"
    return label, [point["step"] for point in points], _values(points, key)


def curve_panels(rows: list[dict], metrics: dict) -> list[dict]:
    """The panels of curves.png, from the step rows (metrics.jsonl): each ``{"ylabel", "lines": [(label, steps,
    values)], "evaluations"}``. Each reward function's curve only where it differs from the mean reward; the clip
    ratio and staleness only where some step's is not 0."""
    steps = [row["step"] for row in rows]

    def panel(ylabel: str, *keys: tuple[str, str]) -> list[dict]:
        """One panel of the step rows' ``keys`` (label, key), or none when no row has the first."""
        if not any(keys[0][1] in row for row in rows):
            return []
        return [{"ylabel": ylabel, "lines": [(label, steps, _values(rows, key)) for label, key in keys],
                 "evaluations": False}]

    def shown(*keys: str) -> bool:
        return any(row.get(key) not in (None, 0) for row in rows for key in keys)

    mean = _values(rows, "reward_mean")
    functions = sorted({key for row in rows for key in row if key.startswith("reward/") and not key.endswith(".std")})
    own = [(key, key) for key in functions if len(functions) > 1 or not _same(_values(rows, key), mean)]
    label, evaluated, values = _held_out(metrics)
    panels = [*panel("reward of the samples", ("mean reward", "reward_mean"), *own),
              *panel("sampled KL(π ‖ π_ref) per completion", ("kl", "kl")),
              {"ylabel": label, "lines": [(label, evaluated, values)], "evaluations": True},
              *panel("entropy of the samples, per token", ("entropy", "entropy")),
              *panel("completion length (tokens)", ("completion_length", "completion_length")),
              *panel("loss", ("loss", "loss")),
              *panel("critic's value loss", ("value_loss", "value_loss"))]
    if shown("clip_fraction"):
        panels += panel("clip ratio (share of tokens clipped)", ("clip_fraction", "clip_fraction"))
    if shown("staleness_max"):
        panels += panel("staleness of the batch (weights versions)", ("staleness max", "staleness_max"),
                        ("staleness mean", "staleness_mean"))
    return panels


def training_curves_plot(path: Path, rows: list[dict], metrics: dict) -> Path:
    """PNG: the panels of ``curve_panels``, four to a row."""
    panels = curve_panels(rows, metrics)
    columns = min(4, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for axis, item in zip(axes.flat, panels):
        for label, steps, values in item["lines"]:
            axis.plot(steps, values, marker="o" if item["evaluations"] else None, linewidth=0.8, label=label)
        axis.set_ylabel(item["ylabel"])
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if len(item["lines"]) > 1:
            axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(f"{metrics['algorithm']} on {metrics['dataset']} (seed {metrics['seed']})")
    return _saved(path, figure, 110)


def generation_comparison_plot(path: Path, dataset: str, tag: str, results: dict) -> Path:
    """Held-out accuracy against samples generated, and reward (and gold reward) against KL."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (K, algorithm), runs in results.items():
        label = f"{algorithm} (K={K})" if len({k for k, _ in results}) > 1 else algorithm
        per_step = runs[0]["samples_per_step"]
        points = [[{"step": 0.0, **run["baseline"]}, *run["history"]] for run in runs]
        steps = [row["step"] for row in points[0]]
        samples = [step * per_step for step in steps]
        accuracy = [statistics.fmean(run[i]["accuracy"] for run in points) for i in range(len(steps))]
        line = axes[0].plot(samples, accuracy, marker="o", markersize=3, label=label)[0]
        if len(points) > 1:  # the seeds' band: mean ± their sample standard deviation at each evaluation
            spread = [statistics.stdev(run[i]["accuracy"] for run in points) for i in range(len(steps))]
            axes[0].fill_between(samples, [m - s for m, s in zip(accuracy, spread)],
                                 [m + s for m, s in zip(accuracy, spread)], color=line.get_color(), alpha=0.15)
        kl = [statistics.fmean(run[i]["kl_from_reference"] for run in points) for i in range(len(steps))]
        reward = [statistics.fmean(run[i]["mean_reward"] or 0.0 for run in points) for i in range(len(steps))]
        line = axes[1].plot(kl, reward, marker="o", markersize=3, label=label)[0]
        if all("gold_reward" in row for run in points for row in run):
            # The hidden gold reward beside the optimised one: where they part is over-optimisation.
            gold = [statistics.fmean(run[i]["gold_reward"] for run in points) for i in range(len(steps))]
            axes[1].plot(kl, gold, marker="x", markersize=3, linestyle="--", color=line.get_color(),
                         label=f"{label}: gold reward")
    axes[0].set_xlabel("samples generated")
    axes[0].set_ylabel("held-out greedy accuracy (band: ± std over seeds)")
    axes[1].set_xlabel("KL(π ‖ π_ref) of held-out greedy completions")
    axes[1].set_ylabel("held-out mean reward")
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if any("gold_reward" in run["final"] for runs in results.values() for run in runs):
        axes[1].legend(fontsize=7)
    figure.suptitle(f"{dataset}: {tag}")
    return _saved(path, figure, 120)


def frontier_plot(path: Path, curves: dict[str, list[tuple[float, float]]], points: dict[str, tuple[float, float]],
                  title: str) -> Path:
    """PNG: the reward of the sampled completions against their KL(π ‖ π_ref), the RLOO paper's frontier (up and
    to the left is better). ``curves``: per run, (KL, reward) points in training order, the last one ringed;
    ``points``: labelled single (KL, reward) points (an ablation's final values), drawn as crosses."""
    figure, axis = plt.subplots(figsize=(7, 4.8))
    for label, curve in curves.items():
        kl, reward = zip(*curve)
        line = axis.plot(kl, reward, marker="o", markersize=3, linewidth=1, label=label)[0]
        axis.plot(kl[-1], reward[-1], marker="o", markersize=9, fillstyle="none", color=line.get_color())
    for label, (kl, reward) in points.items():
        axis.plot([kl], [reward], marker="x", markersize=7, color="black")
        axis.annotate(label, (kl, reward), fontsize=7, xytext=(4, 3), textcoords="offset points")
    axis.set_xlabel("KL(π ‖ π_ref) of the sampled completions, per completion")
    axis.set_ylabel("mean reward of the sampled completions")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title(title, fontsize=10)
    return _saved(path, figure, 120)


def over_optimisation_plot(path: Path, summary: dict) -> Path:
    """PNG: the proxy reward and the gold reward against KL(reference), a curve per run, a point per
    evaluation: the proxy rising while the gold flattens or falls is over-optimisation."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in summary["runs"]:
        kl = [row["kl_from_reference"] for row in run["history"]]
        label = f"{run['algorithm']} β={run['beta']:g} seed {run['seed']}"
        for axis, key in zip(axes, ("mean_reward", "gold_reward")):
            axis.plot(kl, [row.get(key) for row in run["history"]], marker="o", markersize=3, label=label)
    for axis, title in zip(axes, ("proxy reward (the learned reward model)", "gold reward (hidden scorer)")):
        axis.set_xlabel("KL(π ‖ π_ref), held-out greedy completions")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _saved(path, figure, 120)


def calibration_plot(path: Path, metrics: dict) -> Path:
    """Held-out calibration of σ(r_w − r_l), and the training loss."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    bins = metrics["calibration"]
    left.plot([0.5, 1.0], [0.5, 1.0], color="grey", linestyle="--", label="calibrated")
    left.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label="held-out pairs")
    left.set_xlabel("σ(|r_w − r_l|): confidence in the predicted order")
    left.set_ylabel("fraction ordered right")
    left.set_title(f"pairwise accuracy {metrics['pairwise_accuracy']:.3f}")
    left.legend()
    right.plot([h["step"] for h in metrics["history"]], [h["loss"] for h in metrics["history"]])
    right.set_xlabel("step")
    right.set_ylabel("Bradley–Terry loss")
    return _saved(path, figure, 110)
