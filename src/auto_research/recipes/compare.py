"""``compare`` at the generation level: every (algorithm, K, seed) on identical data and settings, each run in a
process of its own (its time and peak memory its own), given its settings as a JSON file.

``--samples-per-step N``: every run trains on N / K prompts a step (the RLOO paper's equal samples), checked from
the completions each run logged. ``--resume``: a finished run is read, an interrupted one continues from its latest
checkpoint, one killed before its first starts again. ``--drop-checkpoints``: a finished run's checkpoints go once
its metrics are read. Writes ``classic-post-training-<dataset>-<seeds>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from auto_research.config.files import read_config_file, write_config_file
from auto_research.config.generation import GenerationConfig
from auto_research.data.tasks import load_task
from auto_research.engine.run_folder import checkpoint_dirs, differing_settings
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, atomic_write_text
from auto_research.locks import check_unlocked
from auto_research.report import tables
from auto_research.train.prepare import prepare


def run_child(config: GenerationConfig, capture: bool = True) -> subprocess.CompletedProcess:
    """``auto-research post-train`` in a process of its own; its stderr captured (``capture``), or shown."""
    with tempfile.TemporaryDirectory(prefix="auto-research-run-") as folder:
        path = write_config_file(Path(folder) / "config.json", config)
        command = [sys.executable, "-m", "auto_research", "post-train", "--config", str(path)]
        if capture:
            return subprocess.run(command, capture_output=True, text=True)
        return subprocess.run(command, stdout=subprocess.DEVNULL, text=True)


def prompts_per_step(samples_per_step: int, group_size: int) -> int:
    """The prompts a step draws so that it trains on ``samples_per_step`` completions, K per prompt."""
    if samples_per_step < 1 or samples_per_step % group_size:
        raise UserError(f"--samples-per-step {samples_per_step} is not a positive multiple of K = {group_size}: each "
                        "prompt gives K completions")
    return samples_per_step // group_size


def _finished(config: GenerationConfig) -> bool:
    """With --resume, whether the run in ``config.run_dir`` finished, with these settings (else one line)."""
    if not config.resume or not (config.run_dir / "metrics.json").is_file():
        return False
    saved = config.run_dir / "config.yaml"
    if not saved.is_file():
        raise UserError(f"--resume: {config.run_dir} holds a finished run without its config.yaml, so its settings "
                        "cannot be checked: run it again with --overwrite (which deletes it)")
    recorded = GenerationConfig(**read_config_file(saved, [GenerationConfig]))
    if recorded.steps != config.steps:  # longer (or shorter): continued (or refused) from its checkpoint
        return False
    differing = differing_settings(recorded.to_json(), config.to_json())
    if differing:
        raise UserError(f"--resume: the finished run in {config.run_dir} ran other settings: {', '.join(differing)}; "
                        "run it again with --overwrite (which deletes it)")
    return True


def plan(base: GenerationConfig, runs: list[tuple[str, int]], seeds: list[int], samples_per_step: int | None,
         log) -> list[tuple[GenerationConfig, bool]]:
    """Every run's settings and whether it already finished, every run checked before the first one starts."""
    if samples_per_step is not None and base.prompts_per_step is not None:
        raise UserError("--samples-per-step sets each run's prompts per step (samples / K): leave --prompts-per-step "
                        "out")
    # A folder per K where runs differ in K, and always at equal samples, where a run is named by its K: so that
    # a later command with fewer runs (--resume) finds the same folders.
    several = len({K for _, K in runs}) > 1 or samples_per_step is not None
    planned = []
    for algorithm, K in runs:
        prompts = base.prompts_per_step if samples_per_step is None else prompts_per_step(samples_per_step, K)
        folder = Path(base.output_dir) / f"k{K}" if several else Path(base.output_dir)
        for seed in seeds:
            config = replace(base, algorithm=algorithm, group_size=K, seed=seed, output_dir=folder,
                             prompts_per_step=prompts).filled()
            check_unlocked(config.run_dir)
            done = _finished(config)
            if config.resume and not done and not checkpoint_dirs(config.run_dir):
                # Nothing to continue from (not started, or killed before its first checkpoint): start afresh.
                config = replace(config, resume=False, overwrite=True)
            if not done:
                prepared = prepare(config, log)  # every run's settings are checked before the first one starts
                if prepared.task.verifier is None:
                    raise UserError(f"compare ranks algorithms by held-out accuracy, and {prepared.task.name}'s rows "
                                    "have no answers; run post-train for each algorithm instead")
            planned.append((config, done))
    return planned


def read_run(config: GenerationConfig, samples_per_step: int | None) -> dict:
    """A finished run's metrics, its median step time and the samples it trained on, summed from the completions
    it logged at each step; with ``samples_per_step``, every step must have trained on exactly that many."""
    metrics = json.loads((config.run_dir / "metrics.json").read_text())
    rows = tables.read_jsonl(config.run_dir / "metrics.jsonl")
    counts = [row.get("completions") for row in rows]
    name = f"{config.algorithm} (K = {config.group_size}, seed {config.seed})"
    if None in counts:
        raise UserError(f"compare: {name} in {config.run_dir} logged no completion count at some step (an older "
                        "version ran it): run it again with --overwrite")
    if samples_per_step is not None:
        wrong = [(row["step"], count) for row, count in zip(rows, counts) if count != samples_per_step]
        if len(rows) != config.steps or wrong:
            raise UserError(f"compare: {name} did not train on equal samples: {len(rows)} steps logged of "
                            f"{config.steps}, completions {wrong[0][1] if wrong else samples_per_step} at step "
                            f"{wrong[0][0] if wrong else '-'} (--samples-per-step {samples_per_step})")
    metrics["step_seconds_median"] = statistics.median(row["step_seconds"] for row in rows)
    metrics["samples_per_step"] = config.prompts_per_step * config.group_size
    metrics["samples"] = sum(counts)
    metrics["run_dir"] = str(config.run_dir)
    return metrics


def _train(config: GenerationConfig, label: str, log) -> float:
    """One run in its own process; its wall time."""
    log(f"{label}: {config.algorithm}, K = {config.group_size}, seed {config.seed}"
        + (", resumed from its latest checkpoint" if config.resume else ""))
    started = time.perf_counter()
    finished = run_child(replace(config, progress=False))
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"compare: {config.algorithm} (K = {config.group_size}, seed {config.seed}) failed: {last}")
    return time.perf_counter() - started


def compare_generation(base: GenerationConfig, runs: list[tuple[str, int]], seeds: list[int], log=print,
                       samples_per_step: int | None = None, drop_checkpoints: bool = False) -> dict:
    """Every (algorithm, K) of ``runs`` at every seed; the summary, its table and the files written."""
    planned = plan(base, runs, seeds, samples_per_step, log)
    # torch (the warm start) and matplotlib only now that every run's settings have passed.
    from auto_research.report.plots import generation_comparison_plot
    from auto_research.train.warm_start import ensure_warm_started

    if planned[0][0].model is None:
        # Warm-start the embedded model once, here, so that no run's time or memory includes it.
        ensure_warm_started(load_task(planned[0][0].data), log=log)
    results: dict[tuple[int, str], list[dict]] = {}
    for index, (config, done) in enumerate(planned, start=1):
        label = f"run {index}/{len(planned)}"
        if done:
            log(f"{label}: {config.algorithm}, K = {config.group_size}, seed {config.seed}: finished earlier, read "
                f"from {config.run_dir}")
        wall = None if done else _train(config, label, log)
        metrics = {**read_run(config, samples_per_step), "wall_seconds": wall}
        if drop_checkpoints:
            shutil.rmtree(config.run_dir / "checkpoints", ignore_errors=True)
        results.setdefault((config.group_size, config.algorithm), []).append(metrics)
        log(f"  held-out accuracy {metrics['baseline']['accuracy']:.3f} -> {metrics['final']['accuracy']:.3f}, "
            f"{metrics['samples']} samples, median step {metrics['step_seconds_median']:.3f} s, peak memory "
            f"{metrics['training']['peak_memory_mb']:.1f} MB" + (f" ({wall:.0f} s)" if wall is not None else ""))
    summary, table = tables.generation_comparison(results)
    dataset, tag = planned[0][0].dataset_name, tables.seeds_tag(seeds)
    stem = Path(base.output_dir) / f"classic-post-training-{dataset}-{tag}"
    kind = next(iter(summary.values()))["peak_memory_kind"]
    paths = [atomic_write_json(stem.with_suffix(".json"), {"dataset": dataset, "seeds": seeds, "algorithms": summary}),
             atomic_write_text(stem.with_suffix(".md"), f"# {dataset}, {tag}\n\n{table}\n\nPeak memory: {kind}.\n"),
             generation_comparison_plot(stem.with_suffix(".png"), dataset, tag, results)]
    return {"summaries": summary, "table": table, "paths": paths}
