"""What the loop carries from step to step (prompt generator, counters, baselines, history); a checkpoint saves it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from auto_research.engine.trainer_state import TOTALS


def _totals() -> dict:
    return {key: 0.0 if key == "seconds" else 0 for key in TOTALS}


@dataclass
class LoopState:
    rng: np.random.Generator
    """Draws each step's prompts (the same on every rank)."""
    step: int = 0
    """The last step done."""
    updates: int = 0
    """Optimizer steps of the policy so far (the learning-rate schedule's position)."""
    critic_updates: int = 0
    moving_average: float = 0.0
    """The baseline of an algorithm with a ``moving_average`` decay (REINFORCE's b), the loop's own."""
    history: list[dict] = field(default_factory=list)
    """Held-out evaluations during training."""
    baseline: dict | None = None
    """The held-out evaluation before training."""
    baseline_completions: list[str] | None = None
    """The starting policy's greedy held-out completions (what the judge's win rate compares against)."""
    completions: dict | None = None
    """The last evaluation's completion table, {"step", "rows"} (--log-completions)."""
    totals: dict = field(default_factory=_totals)
    warned_unscored: bool = False
    warned_refills: bool = False

    @classmethod
    def fresh(cls, seed: int) -> "LoopState":
        return cls(np.random.default_rng(seed))

    def saved(self, uses_moving_average: bool) -> dict:
        """The parts trainer_state.json holds (the numpy generator's state is saved with the random states)."""
        return {"algorithm_state": {"moving_average": self.moving_average} if uses_moving_average else {},
                "history": self.history, "baseline": self.baseline, "updates": self.updates, "totals": self.totals,
                "critic_updates": self.critic_updates, "baseline_completions": self.baseline_completions,
                "completions": self.completions}

    def restore(self, saved: dict) -> None:
        self.step = saved["step"]
        self.moving_average = saved["algorithm_state"].get("moving_average", 0.0)
        self.history, self.baseline = saved["history"], saved["baseline"]
        self.updates, self.totals = saved["updates"], {**_totals(), **saved["totals"]}  # an older run's lacks some
        self.critic_updates = saved.get("critic_updates", 0)
        self.baseline_completions = saved.get("baseline_completions")
        self.completions = saved.get("completions")
