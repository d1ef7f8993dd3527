"""The figures of a step (one row of metrics.jsonl) and where they are written.

``objective`` is the paper's E[r − β·KL] over the sampled completions (it should rise); ``pg_loss`` the surrogate.
Per-sequence figures are gathered from every rank in rank order, so the row is the same on 1 or N processes.
``entropy`` is per token, ``kl`` summed over a completion (as the held-out evaluation's); a count in metrics.json's
``training`` is the sum of the rows' figure of the same name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from auto_research.files import append_json_lines, atomic_write_text, finite_or_null
from auto_research.train.components import RunContext
from auto_research.train.experience import Experience
from auto_research.train.update import Advantages


def step_metrics(run: RunContext, optimizer, step: int, experience: Experience, advantages: Advantages, actor: dict,
                 critic: dict, elapsed: float, totals: dict, drift: dict) -> dict:
    """The step's row; ``drift``: ``drift_figures`` of its experience (computed once, before the update)."""
    config, mask, gather = run.config, experience.mask, run.world.gather
    scores = experience.scores
    scored = gather(scores.scored)
    all_rewards = gather(scores.rewards.double())
    rewards = all_rewards[scored]
    kl_sequence = gather(experience.streams["kl"].sum(1).double())
    objective = (all_rewards - config.loss.beta * kl_sequence)[scored]
    sequence_advantages = gather(((advantages.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)).double())
    lengths = gather(mask.sum(1).double())
    entropy = float(gather(experience.entropy.sum(1).double()).sum())
    generated = int(lengths.sum())
    sequences = lengths.shape[0]
    totals["unscored_samples"] += int((~scored).sum())
    totals["invalid_rewards"] += scores.invalid
    totals["generated_tokens"] += generated
    totals["seconds"] += elapsed
    return {
        "step": step,
        **actor,
        **drift,
        "objective": float(objective.mean()),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)) if rewards.numel() else float("nan"),
        **scores.functions,
        "kl": float(kl_sequence.mean()),
        "entropy": entropy / max(generated, 1),
        "completion_length": generated / sequences,
        "completions": sequences,  # samples this step trained on: compare checks equal samples from these
        "advantage_mean": float(sequence_advantages.mean()),
        "advantage_std": float(sequence_advantages.double().std(unbiased=False)),
        "advantage_abs_max": float(sequence_advantages.abs().max()),
        "unscored_samples": int((~scored).sum()),
        "invalid_rewards": scores.invalid,
        **critic,
        **outside_figures(run, experience, advantages),
        "learning_rate": optimizer.param_groups[0]["lr"],
        "tokens_per_second": generated / elapsed,
        "step_seconds": elapsed,
    }


def outside_figures(run: RunContext, experience: Experience, advantages: Advantages) -> dict:
    """The figures of the signals from outside (``signals``: a teacher's), and their counts."""
    from auto_research.train.signals import OUTSIDE  # noqa: PLC0415

    figures = {}
    for outside in OUTSIDE.values():
        figures.update(outside.figures(run, experience, advantages))
    return {**figures, **experience.scores.counts}


def drift_figures(run: RunContext, experience: Experience) -> dict:
    """The sampler/trainer mismatch and correction weights over every rank's tokens (``{}`` without them)."""
    if experience.drift is None:
        return {}
    drift, mask = experience.drift, experience.mask
    absolute, k3, tokens = run.world.total(torch.stack([drift["absolute"], drift["k3"], drift["tokens"]])).tolist()
    weights = experience.rollout_weights
    sequence_weight = run.world.gather(((weights * mask).sum(1) / mask.sum(1).clamp(min=1)).double())
    return {"rollout_logprob_diff_mean": absolute / max(tokens, 1.0),
            "rollout_logprob_diff_max": float(run.world.gather(drift["maximum"].reshape(1)).max()),
            "rollout_k3_kl": k3 / max(tokens, 1.0),
            "rollout_weight_mean": float(sequence_weight.mean()),
            "rollout_weight_zero_fraction": float((sequence_weight == 0).double().mean())}


COMPLETIONS = "completions.jsonl"


class MetricsLog:
    """metrics.jsonl (a figure that could not be computed is null), completions.jsonl, and the same events for each
    tracker of --report-to; rank 0 only. Nothing is written before ``open`` (the run folder's first write): the
    evaluation before training waits in memory."""

    def __init__(self, run_dir: Path, logging=None, settings: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.logging, self.settings, self.trackers, self.pending = logging, settings, None, []

    def open(self, resumed: bool, warn=print) -> None:
        """Start the trackers (``--report-to``) and write what waited."""
        from auto_research.report.trackers import Trackers, parse_report_to

        names = parse_report_to(self.logging.report_to) if self.logging is not None else ()
        if names:
            self.trackers = Trackers(names, self.path.parent, self.logging.tracker_project, self.settings, resumed,
                                     warn)
        pending, self.pending = self.pending, None
        for method, args in pending:
            getattr(self, method)(*args)

    def append(self, row: dict) -> None:
        clean = finite_or_null(row)
        append_json_lines(self.path, [clean])
        if self.trackers is not None:
            self.trackers.scalars({f"train/{key}": value for key, value in clean.items()
                                   if key != "step" and isinstance(value, (int, float))}, row["step"])

    def evaluation(self, step: int, metrics: dict) -> None:
        if self.pending is not None:
            self.pending.append(("evaluation", (step, metrics)))
        elif self.trackers is not None:
            self.trackers.scalars({f"eval/{key}": value for key, value in metrics.items()
                                   if isinstance(value, (int, float)) and math.isfinite(value)}, step)

    def completions(self, step: int, table: list[dict]) -> None:
        """One evaluation's completion table: a row per prompt in completions.jsonl, and a table for each tracker."""
        if self.pending is not None:
            self.pending.append(("completions", (step, table)))
            return
        append_json_lines(self.path.parent / COMPLETIONS, [{"step": step, **row} for row in table])
        if self.trackers is not None:
            self.trackers.table("eval/completions", table, step)

    def truncate(self, step: int) -> None:
        """Keep the rows up to ``step`` (a resumed run continues from its checkpoint), completions too."""
        for path in (self.path, self.path.parent / COMPLETIONS):
            if path.is_file():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= step]
                atomic_write_text(path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
