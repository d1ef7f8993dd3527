"""``auto-research rlhf``: warm start → sample and label pairs → reward model → RL (every algorithm × β × seed,
each in its own process, its settings in a JSON file) against it → gold win rate, and the proxy and gold
rewards against the KL (recipes/preferences.py describes the task)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from auto_research.config.generation import GenerationConfig
from auto_research.config.recipes import RLHFConfig
from auto_research.data.tasks import preference_task
from auto_research.engine.sources import check_model_source
from auto_research.engine.tiny import build_tokenizer
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, atomic_write_text, check_writable_directory
from auto_research.locks import locked
from auto_research.recipes import preferences
from auto_research.recipes.compare import run_child
from auto_research.recipes.reward_model import preference_pairs, train_reward_model
from auto_research.report import plots, tables
from auto_research.report.tables import figure
from auto_research.train.warm_start import ensure_warm_started

OUTPUTS = ("preferences.jsonl", "reward-model", "runs", "rlhf-summary.json", "rlhf-summary.md", "rlhf.png")


def run(config: RLHFConfig, log=print) -> dict:
    config.validate()
    check_writable_directory(config.output_dir)
    # A failure keeps what the pipeline wrote (pairs, the reward model, runs with their metrics).
    with locked(config.output_dir, "rlhf pipeline", keep=lambda: any((Path(config.output_dir) / name).exists()
                                                                    for name in OUTPUTS)):
        return _pipeline(config, Path(config.output_dir), log)


def _pipeline(config: RLHFConfig, output: Path, log) -> dict:
    """Warm start → pairs → proxy reward model → every RL run → summary, table, plot; with each stage's seconds."""
    _clear_earlier(output, config.overwrite)
    started = time.perf_counter()
    task = preference_task(config.dataset)
    warm = _warm_start(config, task, log)
    stages = {"warm_start": time.perf_counter() - started}
    rows, pairs, label_stats = _pairs(config, task, warm, output, log)
    stages["pairs"] = time.perf_counter() - started - sum(stages.values())
    reward_metrics = _reward_model(config, warm, rows, pairs, label_stats, output, log)
    stages["reward_model"] = time.perf_counter() - started - sum(stages.values())
    results, stages["runs"] = _rl_runs(config, output, log)
    summary = {"dataset": config.dataset, "seconds": time.perf_counter() - started, "stage_seconds": stages,
               "labels": label_stats, "reward_model": {key: value for key, value in reward_metrics.items()
                                                       if key != "history"},
               "runs": [_summary_row(result) for result in results]}
    atomic_write_json(output / "rlhf-summary.json", summary)
    table = tables.rlhf_table(summary)
    atomic_write_text(output / "rlhf-summary.md", table + "\n")
    plot = plots.over_optimisation_plot(output / "rlhf.png", summary)
    return {"summary": summary, "table": table,
            "paths": [output / "rlhf-summary.json", output / "rlhf-summary.md", plot, output / "reward-model"]}


def _clear_earlier(output: Path, overwrite: bool) -> None:
    """An earlier pipeline's outputs in ``output`` are refused, or removed with --overwrite (nothing else there)."""
    found = [name for name in OUTPUTS if (output / name).exists()]
    if found and not overwrite:
        raise UserError(f"{output} holds an earlier pipeline ({', '.join(found)}): --overwrite replaces it")
    for name in found:
        target = output / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def _warm_start(config: RLHFConfig, task, log) -> Path:
    """The policy the pipeline starts from: --model as given, else the task's warm-started model."""
    if config.model is not None:
        check_model_source(config.model, True)
        return Path(config.model)
    return ensure_warm_started(task, progress=config.progress, log=log)


def _pairs(config: RLHFConfig, task, warm: Path, output: Path, log):
    """--pairs pairs sampled and labelled into preferences.jsonl; its rows, the pairs read back, the labels' stats."""
    log(f"[1/3] sampling and labelling {config.pairs} preference pairs from the warm-started policy")
    label_stats = preferences.make_preferences(warm, task, output / "preferences.jsonl", config.pairs, seed=0,
                                               temperature=preferences.PAIR_TEMPERATURE, max_new_tokens=6, log=log)
    rows = [json.loads(line) for line in (output / "preferences.jsonl").read_text().splitlines()]
    pairs = preference_pairs(rows, "preferences.jsonl", "prompt", "chosen", "rejected", None, build_tokenizer(), log)
    return rows, pairs, label_stats


def _reward_model(config: RLHFConfig, warm: Path, rows: list[dict], pairs, label_stats: dict, output: Path,
                  log) -> dict:
    """The proxy reward model trained on the pairs (a tenth held out, at most 500) into reward-model/; its metrics,
    with its accuracy against the gold order on the held-out pairs and the labels' own agreement with it."""
    held = max(1, min(500, len(pairs) // 10))
    log(f"[2/3] training the proxy reward model on {len(pairs) - held} pairs ({held} held out)")
    reward_metrics = train_reward_model(str(warm), pairs, output / "reward-model", config.reward_model_steps, 64,
                                        1e-3, held, 0, "cpu", True, progress=config.progress, log=log)
    held_rows = [rows[i] for i in reward_metrics.pop("evaluation_indices")]
    reward_metrics["gold_order_accuracy"] = preferences.gold_accuracy_of_reward_model(output / "reward-model",
                                                                                      held_rows)
    reward_metrics["label_agreement"] = label_stats["label_agreement"]
    reward_metrics["label_ceiling"] = label_stats["label_ceiling"]
    atomic_write_json(output / "reward-model" / "metrics.json", reward_metrics)
    ordered = sum(row["gold_chosen"] != row["gold_rejected"] for row in held_rows)
    log(f"      held-out pairwise accuracy {figure(reward_metrics['pairwise_accuracy'], 3)} against the noisy labels "
        f"(their own agreement with the gold order: {figure(label_stats['label_agreement'], 3)}, expected "
        f"{figure(label_stats['label_ceiling'], 3)}); {figure(reward_metrics['gold_order_accuracy'], 3)} against the "
        f"gold order on the {ordered} of {len(held_rows)} held-out pairs it orders")
    return reward_metrics


def _rl_runs(config: RLHFConfig, output: Path, log) -> tuple[list[dict], list[float]]:
    """Every algorithm × β × seed trained against the proxy reward model, each in a process of its own and judged
    by the gold reward; each run's metrics.json, and its seconds. A run that fails stops the pipeline."""
    results, seconds = [], []
    combinations = [(a, b, s) for a in config.algorithm_list() for b in config.beta_list() for s in config.seed_list()]
    for index, (algorithm, beta, seed) in enumerate(combinations, 1):
        log(f"[3/3] RL against the proxy ({index}/{len(combinations)}): {algorithm}, β = {beta}, seed {seed}")
        run_config = GenerationConfig(algorithm=algorithm, dataset=config.dataset,
                                      reward_model=str(output / "reward-model"), judge="gold", beta=beta, seed=seed,
                                      group_size=config.group_size, offline=True,
                                      output_dir=output / "runs" / f"beta-{beta:g}", device="cpu", model=config.model,
                                      steps=config.steps, eval_every=config.eval_every, progress=config.progress)
        run_started = time.perf_counter()
        finished = run_child(run_config, capture=False)
        seconds.append(time.perf_counter() - run_started)
        if finished.returncode:
            raise UserError(f"the {algorithm} run (β = {beta}, seed {seed}) failed with status {finished.returncode}")
        metrics = json.loads((run_config.run_dir / "metrics.json").read_text())
        results.append({"algorithm": algorithm, "beta": beta, "seed": seed, "metrics": metrics})
    return results, seconds


def _summary_row(result: dict) -> dict:
    before, after = result["metrics"]["baseline"], result["metrics"]["final"]
    return {"algorithm": result["algorithm"], "beta": result["beta"], "seed": result["seed"],
            "win_rate": after.get("win_rate"),
            "gold_reward": [before.get("gold_reward"), after.get("gold_reward")],
            "proxy_reward": [before.get("mean_reward"), after.get("mean_reward")],
            "accuracy": [before["accuracy"], after["accuracy"]],
            "kl": after["kl_from_reference"],
            "history": [{"step": 0.0, **before}, *result["metrics"]["history"]]}
