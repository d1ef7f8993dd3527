"""The candidate level's commands: post-train one or several seeds, and compare algorithms on identical data. Every
run's inputs are checked before the first trains; outputs are written once all have finished, each under its lock.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from auto_research.candidate.trainer import load_data, train
from auto_research.config.candidate import CandidateConfig
from auto_research.data.registry import task_record
from auto_research.files import atomic_write_json, atomic_write_text, check_writable_directory
from auto_research.locks import FolderLock, check_unlocked
from auto_research.progress import Progress
from auto_research.report import tables


def _run_all(configs: list[CandidateConfig]) -> list[dict]:
    for config in configs:
        config.validate()
        check_unlocked(config.run_dir)
    prepared = [(config, load_data(config)) for config in configs]
    check_writable_directory(configs[0].output_dir)
    # A bar for several runs, shown on a terminal only: logs and tests stay clean.
    bar = Progress(len(prepared), "runs", enabled=len(prepared) > 1, lines=0, leave=False)
    runs = []
    for config, data in prepared:
        runs.append(train(config, data))
        bar.update()
    bar.close()
    return runs


def _write_runs(configs: list[CandidateConfig], runs: list[dict]) -> list[Path]:
    paths: list[Path] = []
    for run_config, metrics in zip(configs, runs):
        with FolderLock(run_config.run_dir) as lock:
            try:
                paths += tables.write_run(run_config.run_dir, metrics)
            except BaseException:
                lock.remove_created()
                raise
    return paths


def post_train(config: CandidateConfig, seeds: list[int] | None = None) -> dict:
    """Train one run per seed; write each run directory and, for several seeds, a summary. Returns
    ``{"runs": [...metrics...], "paths": [...], "summary": dict | None}``."""
    configs = [replace(config, seed=seed) for seed in seeds] if seeds else [config]
    runs = _run_all(configs)
    paths = _write_runs(configs, runs)
    summary = None
    if len(configs) > 1:
        stem = Path(config.output_dir) / f"{config.algorithm}-{config.dataset}-{tables.seeds_tag(seeds)}-summary"
        paths += tables.write_seed_summary(stem, config.algorithm, config.dataset, runs)
        summary = tables.summarise_seeds(runs)
    return {"runs": runs, "paths": paths, "summary": summary}


def compare(config: CandidateConfig, algorithms: list[str], seeds: list[int]) -> dict:
    """Run every algorithm on identical data and settings; write one summary, table and plot."""
    configs = [replace(config, algorithm=name, seed=seed) for name in algorithms for seed in seeds]
    runs = _run_all(configs)
    paths = _write_runs(configs, runs)
    by_algorithm = {name: [run for run in runs if run["algorithm"] == name] for name in algorithms}
    summaries = {name: tables.summarise_seeds(group) for name, group in by_algorithm.items()}
    # The task's short name (its record's tag): classic-post-training-gsm8k-seed42.json.
    tag = task_record(config.dataset, "candidate").tag
    stem = Path(config.output_dir) / f"classic-post-training-{tag}-{tables.seeds_tag(seeds)}"
    payload = {
        "dataset": config.dataset, "seeds": seeds,
        "settings": {key: getattr(config, key) for key in ("maximum_examples", "steps", "group_size", "learning_rate",
                                                           "beta")},
        "data_source": runs[0]["training"]["data_source"],
        "algorithms": {name: {**summaries[name], "runs": {
            str(run["seed"]): {"final": run["final"], "relative_accuracy": run["relative_accuracy"],
                               "run_dir": str(replace(config, algorithm=name, seed=run["seed"]).run_dir)}
            for run in by_algorithm[name]}} for name in algorithms},
    }
    title = f"{config.dataset}: {config.steps} steps, K={config.group_size}, {tables.seeds_tag(seeds)}"
    table = tables.summary_table(summaries)
    paths.append(atomic_write_json(stem.with_suffix(".json"), payload))
    paths.append(atomic_write_text(stem.with_suffix(".md"), f"# {title}\n\n{table}\n"))
    # Step 0 is the untrained policy, so every curve starts where training did.
    histories = {name: [[{"step": 0.0, **run["baseline"]}, *run["history"]] for run in group]
                 for name, group in by_algorithm.items()}
    # matplotlib only here: a candidate-level post-train draws nothing and must stay fast.
    from auto_research.report.plots import comparison_plot

    paths.append(comparison_plot(stem.with_suffix(".png"), histories, title))
    return {"runs": runs, "paths": paths, "summaries": summaries, "table": table}
