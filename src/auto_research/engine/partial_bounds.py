"""How many groups partial rollouts may decode at once (--in-flight-pool F, a rollout server's ``pool_groups``):
the trainer's flag and a server's rounds alike. Light: no torch."""

from __future__ import annotations

import math

MAX_IN_FLIGHT_POOL = 4
"""The most groups decoding at once, in steps' worth: F ≤ 4, ``pool_groups`` ≤ 4 · ``per_step``."""


def pool_groups(pool: float, per_step: int) -> int:
    """The groups decoding at once for a step of ``per_step`` groups: F · P rounded up (1.5 × 5 → 8)."""
    return max(per_step, math.ceil(pool * per_step - 1e-9))
