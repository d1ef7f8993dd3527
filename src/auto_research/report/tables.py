"""What a run leaves behind as text: metrics.json, report.md, summaries and tables, written atomically. One reader
serves both levels: every metrics.json has ``algorithm``, ``dataset``, ``baseline`` and ``final`` (``METRICS``),
``relative_accuracy``, ``training`` and ``history``."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from auto_research.files import atomic_write_json, atomic_write_text

METRICS = ("accuracy", "mean_reward", "entropy", "kl_from_reference")
LABELS = {
    "accuracy": "accuracy",
    "mean_reward": "mean reward",
    "entropy": "entropy",
    "kl_from_reference": "KL(reference)",
    "gold_reward": "gold reward",
    "win_rate": "win rate",
}
# Shown when a run has them: the hidden gold scorer's reward and the judge's win rate (preference-generate).
OPTIONAL_METRICS = ("gold_reward", "win_rate")


def _metrics_of(metrics: dict) -> list[str]:
    return [*METRICS, *(key for key in OPTIONAL_METRICS if key in metrics.get("final", {}))]


def figure(value, digits: int = 4) -> str:
    """A figure to ``digits`` decimals; n/a where none could be computed (None, or NaN: a reward that scored
    nothing, a held-out set with no pair the gold scorer orders)."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def column_names(metrics: dict) -> tuple[str, str]:
    """The candidate level starts from an untrained policy (w = 0); the generation level from a model
    that may well be trained already (a warm start, an instruct checkpoint): before and after RL."""
    return ("untrained", "trained") if metrics.get("level") != "generation" else ("before", "after")


def before_after_table(metrics: dict) -> str:
    before, after = column_names(metrics)
    rows = [f"| {LABELS[key]} | {figure(metrics['baseline'].get(key))} | {figure(metrics['final'][key])} |"
            for key in _metrics_of(metrics)]
    return "\n".join([f"| metric | {before} | {after} |", "|---|---:|---:|", *rows])


def console_table(metrics: dict) -> str:
    before, after = column_names(metrics)
    lines = [f"{'metric':<16}{before:>12}{after:>12}",
             *(f"{LABELS[key]:<16}{figure(metrics['baseline'].get(key)):>12}{figure(metrics['final'][key]):>12}"
               for key in _metrics_of(metrics))]
    if metrics["relative_accuracy"] is not None:  # None: rows without answers
        lines.append(f"{'relative acc.':<16}{'':>12}{metrics['relative_accuracy']:>+12.4f}")
    return "\n".join(lines)


def markdown_table(table: list[dict]) -> str:
    """A completion table as Markdown: prompt, greedy completion, reward, the verifier's verdict."""
    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", "⏎")[:200]

    lines = ["| prompt | completion | answer | reward | correct |", "|---|---|---|---:|:---:|"]
    for row in table:
        reward = "–" if row["reward"] is None else f"{row['reward']:.3f}"
        verdict = "–" if row["correct"] is None else "✓" if row["correct"] else "✗"
        answer = "–" if row["answer"] is None else cell(row["answer"])
        lines.append(f"| {cell(row['prompt'])} | {cell(row['completion'])} | {answer} | {reward} | {verdict} |")
    return "\n".join(lines)


def run_report(metrics: dict) -> str:
    training = metrics["training"]
    lines = [
        f"# {metrics['algorithm']} on {metrics['dataset']} (seed {metrics['seed']})",
        "",
        *([f"Model: {metrics['model']}", ""] if metrics.get("model") else []),
        before_after_table(metrics),
        "",
        f"Relative accuracy: {metrics['relative_accuracy']:+.4f} "
        f"(({column_names(metrics)[1]} − {column_names(metrics)[0]}) / {column_names(metrics)[0]} accuracy)."
        if metrics["relative_accuracy"] is not None else "No accuracy: the rows have no answers (the mean reward "
        "is the held-out figure).",
        "",
        "## Training",
        "",
    ]
    for key, value in training.items():
        if isinstance(value, list):
            value = ", ".join(f"{item:.4g}" if isinstance(item, (int, float)) else str(item) for item in value)
        lines.append(f"- {key.replace('_', ' ')}: {value}")
    machine = metrics.get("machine")
    if machine:  # where the figures were computed: CPU, kernels, versions (engine/machine.py)
        lines += ["", "## Machine", ""]
        for key, value in machine.items():
            if isinstance(value, dict):
                value = ", ".join(f"{name} {found}" for name, found in value.items() if found)
            lines.append(f"- {key.replace('_', ' ')}: {value}")
    history = metrics.get("history") or []
    if history:
        lines += ["", "## Validation during training", ""]
        lines.append("| step | loss | " + " | ".join(LABELS[key] for key in METRICS) + " |")
        lines.append("|---:|---:|" + "---:|" * len(METRICS))
        for row in history:
            cells = " | ".join(figure(row[key]) for key in METRICS)
            lines.append(f"| {int(row['step'])} | {row['loss']:.4f} | {cells} |")
    shown = metrics.get("completions")
    if shown and shown["rows"]:
        lines += ["", f"## Held-out completions (greedy, step {shown['step']})", "", markdown_table(shown["rows"])]
    return "\n".join(lines) + "\n"


def write_run(run_dir: Path, metrics: dict) -> list[Path]:
    return [atomic_write_json(run_dir / "metrics.json", metrics),
            atomic_write_text(run_dir / "report.md", run_report(metrics))]


def mean_and_std(values: list[float]) -> dict[str, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def summarise_seeds(runs: list[dict]) -> dict:
    """Across seeds: mean and sample std of every before/after metric."""
    return {
        "seeds": [run["seed"] for run in runs],
        "baseline": {key: mean_and_std([run["baseline"][key] for run in runs]) for key in METRICS},
        "final": {key: mean_and_std([run["final"][key] for run in runs]) for key in METRICS},
        "relative_accuracy": mean_and_std([run["relative_accuracy"] for run in runs]),
    }


def seeds_tag(seeds: list[int]) -> str:
    """``seed42`` for one seed, ``seeds42-43-44`` for several."""
    return f"seed{seeds[0]}" if len(seeds) == 1 else "seeds" + "-".join(str(seed) for seed in seeds)


def _format(statistic: dict) -> str:
    spread = "" if statistic["std"] is None else f" ± {statistic['std']:.4f}"
    return f"{statistic['mean']:.4f}{spread}"


def summary_table(summaries: dict[str, dict]) -> str:
    """Markdown: one row per algorithm with final metrics (mean ± sample std over seeds)."""
    header = "| algorithm | " + " | ".join(LABELS[key] for key in METRICS) + " | relative accuracy |"
    lines = [header, "|---|" + "---:|" * (len(METRICS) + 1)]
    first = next(iter(summaries.values()))
    untrained = " | ".join(_format(first["baseline"][key]) for key in METRICS)
    lines.append(f"| untrained | {untrained} | |")
    for name, summary in summaries.items():
        cells = " | ".join(_format(summary["final"][key]) for key in METRICS)
        lines.append(f"| {name} | {cells} | {_format(summary['relative_accuracy'])} |")
    return "\n".join(lines)


def write_seed_summary(path_stem: Path, algorithm: str, dataset: str, runs: list[dict]) -> list[Path]:
    summary = {"algorithm": algorithm, "dataset": dataset, **summarise_seeds(runs)}
    title = f"# {algorithm} on {dataset}, seeds {', '.join(str(s) for s in summary['seeds'])}\n\n"
    return [atomic_write_json(path_stem.with_suffix(".json"), summary),
            atomic_write_text(path_stem.with_suffix(".md"), title + summary_table({algorithm: summary}) + "\n")]


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _mean_std(values: list[float]) -> str:
    values = [value for value in values if value is not None]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.2g}"


COMPARED_SETTINGS = ("steps", "learning_rate", "beta", "prompts_per_step", "kl_estimator", "kl_in", "loss_aggregation",
                     "updates_per_batch", "ppo_mini_batches", "temperature", "max_new_tokens", "gae_lambda", "vf_coef",
                     "value_clip")
"""The settings a comparison's summary records of each arm (its first run's)."""


def generation_comparison(results: dict) -> tuple[dict, str]:
    """The summary (mean ± std over seeds of every figure) and the Markdown table of a generation-level
    comparison; ``results[(K, algorithm)]`` is a run per seed."""
    summary = {}
    lines = ["| algorithm | K | held-out accuracy before → after | reward before → after | KL(reference) | samples | "
             "median step (s) | peak memory (MB) | trainable / total parameters | win rate (--judge) |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for (K, algorithm), runs in results.items():
        take = lambda part, key: [run[part][key] for run in runs]  # noqa: E731
        parameters = runs[0]["training"].get("parameters", {})
        entry = {
            "group_size": K,
            "seeds": [run["seed"] for run in runs],
            "baseline": {key: mean_and_std([v for v in take("baseline", key) if v is not None] or [math.nan]) for key in METRICS},
            "final": {key: mean_and_std([v for v in take("final", key) if v is not None] or [math.nan]) for key in METRICS},
            "samples": runs[0]["samples"],
            "step_seconds": mean_and_std([run["step_seconds_median"] for run in runs]),
            "peak_memory_mb": mean_and_std([run["training"]["peak_memory_mb"] for run in runs]),
            "peak_memory_kind": runs[0]["training"]["peak_memory_kind"],
            "parameters": parameters,
            "settings": {key: runs[0]["training"].get(key) for key in COMPARED_SETTINGS},
            "run_dirs": [run.get("run_dir") for run in runs],
        }
        for key in OPTIONAL_METRICS:  # the judge's win rate and the gold reward, where the runs have them
            values = [run["final"].get(key) for run in runs if run["final"].get(key) is not None]
            if values:
                entry["final"][key] = mean_and_std(values)
        summary[f"{algorithm}-k{K}"] = entry
        lines.append(
            f"| {algorithm} | {K} | {_mean_std(take('baseline', 'accuracy'))} → {_mean_std(take('final', 'accuracy'))} | "
            f"{_mean_std(take('baseline', 'mean_reward'))} → {_mean_std(take('final', 'mean_reward'))} | "
            f"{_mean_std(take('final', 'kl_from_reference'))} | {entry['samples']} | "
            f"{_mean_std([run['step_seconds_median'] for run in runs])} | "
            f"{_mean_std([run['training']['peak_memory_mb'] for run in runs])} | "
            f"{parameters.get('trainable', 0):,} / {parameters.get('total', 0):,} | "
            f"{_mean_std([run['final'].get('win_rate') for run in runs])} |")
    return summary, "\n".join(lines)


def rlhf_table(summary: dict) -> str:
    """The RLHF pipeline's summary: the labels, the proxy reward model, then one row per RL run."""
    labels, proxy = summary["labels"], summary["reward_model"]
    lines = [
        f"# RLHF on {summary.get('dataset', 'preference-generate')} ({summary['seconds']:.0f} s in all)",
        "",
        "Seconds: " + ", ".join(f"{name.replace('_', ' ')} {value:.0f}" for name, value in summary["stage_seconds"].items()
                                if not isinstance(value, list))
        + ", RL runs " + ", ".join(f"{value:.0f}" for value in summary["stage_seconds"]["runs"]) + ".",
        "",
        f"Labels: {labels['pairs']} pairs, gold scorer with Bradley–Terry noise (τ = {labels['label_temperature']}); "
        f"on the pairs the gold scorer orders, the labels agree with it on {figure(labels['label_agreement'], 3)} "
        f"(the noise model's expectation: {figure(labels['label_ceiling'], 3)}).",
        f"Proxy reward model: held-out pairwise accuracy {figure(proxy['pairwise_accuracy'], 3)} against the labels, "
        f"{figure(proxy['gold_order_accuracy'], 3)} against the gold order ({proxy['evaluation_pairs']} held-out pairs).",
        "",
        "| algorithm | β | seed | gold win rate | gold reward (before → after) | proxy reward (before → after) "
        "| accuracy (before → after) | KL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in summary["runs"]:
        lines.append(f"| {run['algorithm']} | {run['beta']:g} | {run['seed']} | {figure(run['win_rate'])} | "
                     f"{figure(run['gold_reward'][0])} → {figure(run['gold_reward'][1])} | "
                     f"{figure(run['proxy_reward'][0])} → {figure(run['proxy_reward'][1])} | "
                     f"{figure(run['accuracy'][0])} → {figure(run['accuracy'][1])} | {figure(run['kl'])} |")
    return "\n".join(lines)


