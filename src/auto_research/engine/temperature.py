"""What a sampling temperature may be, on every engine (the trainer's flag and a rollout server's requests alike).
Light: no torch."""

from __future__ import annotations

import math

MIN_TEMPERATURE = 0.01
"""The smallest sampling temperature above 0 (0 is greedy decoding, on every engine). vLLM raises any temperature
in (0, 0.01) to 0.01 (with a warning), so another engine sampling below it would draw from another distribution;
and far below it logits / T overflow (at 1e-300 every logit is ±inf and the softmax NaN)."""


def temperature_problem(value: float) -> str | None:
    """Why a sampling temperature is refused (a request's: 0 is greedy), or None."""
    if not (math.isfinite(value) and value >= 0):
        return f"must be a finite number >= 0, got {value}"
    if 0 < value < MIN_TEMPERATURE:
        return (f"{value:g} is below the smallest sampling temperature, {MIN_TEMPERATURE:g} (vLLM raises anything "
                f"lower to it; far lower, logits / T overflow); 0 is greedy decoding")
    return None
