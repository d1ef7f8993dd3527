"""What the loop carries from step to step (the prompt generator, counters, baselines, the evaluation
history), and what a checkpoint saves of it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np


def _totals() -> dict:
    return {"no_signal_groups": 0, "unscored_samples": 0, "invalid_rewards": 0, "generated_tokens": 0, "seconds": 0.0}


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
        """The parts a checkpoint's trainer_state.json holds (the numpy generator's state is saved with
        the other random states)."""
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


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _numpy_state(value) -> bool:
    """A state the prompt generator's kind of bit generator takes."""
    try:
        np.random.default_rng(0).bit_generator.state = value
    except (TypeError, ValueError, KeyError, OverflowError):
        return False
    return True


_SAVED = {  # key: (what it must be, the test, whether checkpoints of every version hold it)
    "step": ("a step number", _count, True),
    "updates": ("a count", _count, True),
    "critic_updates": ("a count", _count, False),
    "world_size": ("a number of processes", lambda v: _count(v) and v > 0, False),
    "config": ("a mapping of settings", lambda v: isinstance(v, dict), True),
    "model": ("text", lambda v: isinstance(v, str), False),
    "history": ("a list of evaluations", lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v), True),
    "baseline": ("an evaluation or null", lambda v: v is None or isinstance(v, dict), True),
    "algorithm_state": ("a mapping with a finite moving_average",
                        lambda v: isinstance(v, dict) and _number(v.get("moving_average", 0.0)), True),
    "totals": ("a mapping of finite counts", lambda v: isinstance(v, dict) and set(_totals()) <= set(v)
               and all(_number(v[key]) for key in _totals()), True),
    "baseline_completions": ("a list of text or null",
                             lambda v: v is None or isinstance(v, list) and all(isinstance(t, str) for t in v), False),
    "completions": ("a completion table or null", lambda v: v is None or isinstance(v, dict), False),
    "numpy_rng": ("the prompt generator's state", _numpy_state, True),
    "in_flight": ("a list per process of batches", lambda v: v is None or isinstance(v, list), False),
}


def saved_problem(saved, step: int) -> str | None:
    """Why a checkpoint's trainer_state.json cannot be restored (a value missing, of the wrong kind, or another
    step's), or None: checked before anything is loaded, so that such a checkpoint is skipped like a damaged one."""
    if not isinstance(saved, dict):
        return "is not a mapping"
    for key, (kind, test, always) in _SAVED.items():
        if key not in saved:
            if always:
                return f"{key!r} is missing"
        elif not test(saved[key]):
            return f"{key!r} is {json.dumps(saved[key])[:60]}, not {kind}"
    if saved["step"] != step:
        return f"holds step {saved['step']}, and its folder is step {step}"
    return None
