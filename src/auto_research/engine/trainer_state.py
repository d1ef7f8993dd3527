"""What a checkpoint's trainer_state.json must hold to be restored: each value of the kind the loop saved
(``train/state.py``'s ``LoopState.saved``). Light: NumPy only."""

from __future__ import annotations

import json
import math

import numpy as np

TOTALS = ("no_signal_groups", "unscored_samples", "invalid_rewards", "generated_tokens", "seconds")
"""The run's running totals a checkpoint carries (``LoopState.totals``)."""


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
    "totals": ("a mapping of finite counts", lambda v: isinstance(v, dict) and set(TOTALS) <= set(v)
               and all(_number(v[key]) for key in TOTALS), True),
    "baseline_completions": ("a list of text or null",
                             lambda v: v is None or isinstance(v, list) and all(isinstance(t, str) for t in v), False),
    "completions": ("a completion table or null", lambda v: v is None or isinstance(v, dict), False),
    "numpy_rng": ("the prompt generator's state", _numpy_state, True),
    "in_flight": ("a list per process of batches", lambda v: v is None or isinstance(v, list), False),
}


def saved_problem(saved, step: int) -> str | None:
    """Why a checkpoint's trainer_state.json cannot be restored (a value missing, of the wrong kind, or another
    step's), or None: checked before anything is loaded, so such a checkpoint is skipped like a damaged one."""
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
