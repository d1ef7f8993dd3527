"""``compare`` at the generation level: every (K, algorithm, seed) on identical data and settings, each run in
a process of its own (so that its time and peak memory are its own), given its settings as a JSON file.

Writes ``classic-post-training-<dataset>-<seeds>.json``, ``.md`` and ``.png`` (held-out accuracy against
samples generated; reward against KL) in the output folder.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from auto_research.config.files import write_config_file
from auto_research.config.generation import GenerationConfig
from auto_research.data.tasks import load_task
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, atomic_write_text
from auto_research.locks import check_unlocked
from auto_research.report import tables
from auto_research.train.prepare import prepare


def run_child(config: GenerationConfig, capture: bool = True) -> subprocess.CompletedProcess:
    """``auto-research post-train`` in a process of its own, its settings in a JSON file; its stderr captured
    (``capture``), or shown as it goes."""
    with tempfile.TemporaryDirectory(prefix="auto-research-run-") as folder:
        path = write_config_file(Path(folder) / "config.json", config)
        command = [sys.executable, "-m", "auto_research", "post-train", "--config", str(path)]
        if capture:
            return subprocess.run(command, capture_output=True, text=True)
        return subprocess.run(command, stdout=subprocess.DEVNULL, text=True)


def compare_generation(base: GenerationConfig, algorithms: list[str], seeds: list[int], group_sizes: list[int],
                       log=print) -> dict:
    output = Path(base.output_dir)
    planned = []
    for K in group_sizes:
        for algorithm in algorithms:
            for seed in seeds:
                folder = output / f"k{K}" if len(group_sizes) > 1 else output
                config = replace(base, algorithm=algorithm, group_size=K, seed=seed, output_dir=folder).filled()
                prepared = prepare(config, log)  # every run's settings are checked before the first one starts
                if prepared.task.verifier is None:
                    raise UserError(f"compare ranks algorithms by held-out accuracy, and {prepared.task.name}'s rows "
                                    "have no answers; run post-train for each algorithm instead")
                check_unlocked(config.run_dir)
                planned.append(config)
    # torch (the warm start) and matplotlib only now that every run's settings have passed.
    from auto_research.report.plots import generation_comparison_plot
    from auto_research.train.warm_start import ensure_warm_started

    if planned[0].model is None:
        # Warm-start the embedded model once, here, so that no run's time or memory includes it.
        ensure_warm_started(load_task(planned[0]), log=log)
    results: dict[tuple[int, str], list[dict]] = {}
    for index, config in enumerate(planned, start=1):
        started = time.perf_counter()
        log(f"run {index}/{len(planned)}: {config.algorithm}, K = {config.group_size}, seed {config.seed}")
        finished = run_child(replace(config, progress=False))
        if finished.returncode != 0:
            last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"compare: {config.algorithm} (K = {config.group_size}, seed {config.seed}) failed: {last}")
        metrics = json.loads((config.run_dir / "metrics.json").read_text())
        rows = tables.read_jsonl(config.run_dir / "metrics.jsonl")
        metrics["step_seconds_median"] = statistics.median(row["step_seconds"] for row in rows)
        metrics["samples_per_step"] = config.prompts_per_step * config.group_size
        metrics["samples"] = metrics["samples_per_step"] * config.steps
        metrics["wall_seconds"] = time.perf_counter() - started
        metrics["run_dir"] = str(config.run_dir)
        results.setdefault((config.group_size, config.algorithm), []).append(metrics)
        log(f"  held-out accuracy {metrics['baseline']['accuracy']:.3f} -> {metrics['final']['accuracy']:.3f}, "
            f"median step {metrics['step_seconds_median']:.3f} s, peak memory "
            f"{metrics['training']['peak_memory_mb']:.1f} MB ({metrics['wall_seconds']:.0f} s)")
    summary, table = tables.generation_comparison(results)
    dataset, tag = planned[0].dataset_name, tables.seeds_tag(seeds)
    stem = output / f"classic-post-training-{dataset}-{tag}"
    kind = next(iter(summary.values()))["peak_memory_kind"]
    paths = [atomic_write_json(stem.with_suffix(".json"), {"dataset": dataset, "seeds": seeds, "algorithms": summary}),
             atomic_write_text(stem.with_suffix(".md"), f"# {dataset}, {tag}\n\n{table}\n\nPeak memory: {kind}.\n"),
             generation_comparison_plot(stem.with_suffix(".png"), dataset, tag, results)]
    return {"summaries": summary, "table": table, "paths": paths}
