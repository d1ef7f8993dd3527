"""What curves.png and report.md show of a run (issue 53, item 7): the panels TRL users watch, from what the step rows
hold; no flat staleness panel in a synchronous run; the last evaluation drawn without evaluations during training;
only the settings the algorithm's record uses."""

from __future__ import annotations

import pytest

from auto_research import GenerationConfig
from auto_research.report.plots import curve_panels, training_curves_plot

BASE = ["reward of the samples", "sampled KL(π ‖ π_ref) per completion", "held-out greedy accuracy",
        "entropy of the samples, per token", "completion length (tokens)", "loss"]


def _row(step: int, **figures) -> dict:
    return {"step": step, "loss": 0.1 * step, "reward_mean": 0.5, "kl": 0.01 * step, "entropy": 2.0,
            "completion_length": 7.0, "clip_fraction": 0.0, "staleness_mean": 0.0, "staleness_max": 0, **figures}


def _metrics(steps: int, history: list[dict]) -> dict:
    evaluation = {"accuracy": 0.25, "mean_reward": 0.5, "entropy": 2.0, "kl_from_reference": 0.0}
    return {"algorithm": "rloo", "dataset": "sums", "seed": 1, "training": {"steps": steps},
            "baseline": {**evaluation, "accuracy": 0.1}, "final": evaluation, "history": history}


def _panels(rows, metrics) -> dict:
    return {panel["ylabel"]: [label for label, _, _ in panel["lines"]] for panel in curve_panels(rows, metrics)}


def test_a_synchronous_rloo_run_shows_the_watched_panels_and_no_flat_staleness_or_clip():
    rows = [_row(step, **{"reward/correct": 0.5, "reward/correct.std": 0.1}) for step in (1, 2, 3)]
    panels = _panels(rows, _metrics(3, [{"step": 3.0, "loss": 0.3, "accuracy": 0.25}]))
    assert list(panels) == BASE
    assert panels["reward of the samples"] == ["mean reward"]  # its one function is the mean: drawn once


def test_per_reward_curves_clip_ratio_staleness_and_the_critics_loss_where_the_rows_hold_them():
    rows = [_row(step, **{"reward/correct": 1.0, "reward/brief": -0.5, "reward/brief.std": 0.1,
                          "clip_fraction": 0.02 * (step - 1), "staleness_max": min(step - 1, 1),
                          "staleness_mean": min(step - 1, 1), "value_loss": 0.3}) for step in (1, 2, 3)]
    panels = _panels(rows, _metrics(3, []))
    assert list(panels) == [*BASE, "critic's value loss", "clip ratio (share of tokens clipped)",
                            "staleness of the batch (weights versions)"]
    assert panels["reward of the samples"] == ["mean reward", "reward/brief", "reward/correct"]
    assert panels["staleness of the batch (weights versions)"] == ["staleness max", "staleness mean"]


def test_the_after_training_evaluation_is_drawn_without_evaluations_during_training(tmp_path):
    rows = [_row(step) for step in (1, 2, 3, 4)]
    held_out = next(panel for panel in curve_panels(rows, _metrics(4, [])) if panel["evaluations"])
    assert [(steps, values) for _, steps, values in held_out["lines"]] == [([0.0, 4.0], [0.1, 0.25])]
    every_two = _metrics(4, [{"step": 2.0, "accuracy": 0.2}, {"step": 4.0, "accuracy": 0.25}])
    held_out = next(panel for panel in curve_panels(rows, every_two) if panel["evaluations"])
    assert held_out["lines"][0][1:] == ([0.0, 2.0, 4.0], [0.1, 0.2, 0.25])  # the last evaluation, once
    no_answers = _metrics(4, [])
    no_answers["baseline"]["accuracy"] = no_answers["final"]["accuracy"] = None
    held_out = next(panel for panel in curve_panels(rows, no_answers) if panel["evaluations"])
    assert held_out["ylabel"] == "held-out mean reward (rows without answers)"
    assert training_curves_plot(tmp_path / "curves.png", rows, _metrics(4, [])).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("algorithm, critic, shown, left_out", [
    ("rloo", False, {"beta", "policy_loss"}, {"whiten_advantages", "std", "clip_low", "clip_high", "clip_range",
                                              "gae_lambda", "value_clip", "vf_coef"}),
    ("ppo-rlhf", True, {"whiten_advantages", "gae_lambda", "value_clip", "clip_low"}, {"normalize_advantages", "std"}),
    ("grpo", False, {"std", "clip_low", "clip_high", "normalize_advantages"}, {"whiten_advantages", "gae_lambda"}),
])
def test_the_reported_settings_are_those_the_algorithms_record_uses(algorithm, critic, shown, left_out):
    """metrics.json's ``training`` (listed in report.md): RLOO's has no PPO-only settings."""
    settings = GenerationConfig(algorithm=algorithm, dataset="x.jsonl").filled().reported_settings(critic=critic)
    assert shown <= set(settings) and not left_out & set(settings)
