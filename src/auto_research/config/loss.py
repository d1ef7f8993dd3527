"""The loss settings of a generation-level run, checked against the algorithm's record: each choice from its one
list in ``algorithms/registry.py``, each range, and the knobs an algorithm cannot take. Light: no torch."""

from __future__ import annotations

import math

from auto_research.algorithms.registry import (AGGREGATIONS, KL_ESTIMATORS, KL_PLACEMENTS, POLICY_LOSSES,
                                               RATIO_FREE_LOSSES, REGISTRY, STANDARD_DEVIATIONS, names_by)
from auto_research.config.fields import check_choice, check_non_negative_finite
from auto_research.errors import UserError


def by_algorithm(attribute: str, choices) -> str:
    """``a (rloo, grpo), b (…)``: each choice with the algorithms whose record defaults to it."""
    grouped = names_by(attribute)
    return ", ".join(f"{choice} ({', '.join(grouped[choice])})" for choice in choices if choice in grouped)


def having(attribute: str) -> str:
    return ", ".join(name for name, algorithm in REGISTRY.items() if getattr(algorithm, attribute))


def check_loss(config, algorithm) -> None:
    """The loss settings of ``config`` (a GenerationConfig): choices, ranges, and the knobs ``algorithm`` (its
    record) cannot take. One line and exit 2 (``UserError``) for the first wrong one."""
    for flag, value, allowed in (("--kl-estimator", config.kl_estimator, KL_ESTIMATORS),
                                 ("--kl-in", config.kl_in, KL_PLACEMENTS),
                                 ("--loss-aggregation", config.loss_aggregation, AGGREGATIONS),
                                 ("--policy-loss", config.policy_loss, POLICY_LOSSES),
                                 ("--std", config.std, STANDARD_DEVIATIONS)):
        check_choice(flag, value, allowed)
    if config.clip_range is not None and not (math.isfinite(config.clip_range) and 0 <= config.clip_range <= 1):
        raise UserError(f"--clip-range must be in [0, 1], got {config.clip_range}")
    if config.clip_low is not None and not (math.isfinite(config.clip_low) and 0 <= config.clip_low <= 1):
        raise UserError(f"--clip-low must be in [0, 1] (the ratio's lower bound 1 − ε_low is a probability "
                        f"ratio, >= 0), got {config.clip_low}")
    if config.clip_high is not None:
        check_non_negative_finite("--clip-high", config.clip_high)
    if config.std is not None and algorithm.std is None:
        raise UserError(f"--std applies to the algorithms that divide by the group's standard deviation "
                        f"({having('std')}); {algorithm.name} has none")
    if config.normalize_advantages and algorithm.whiten:
        raise UserError(f"--normalize-advantages: {algorithm.name} already whitens its advantages over the batch "
                        "(--no-whiten-advantages turns that off)")
    several = config.updates_per_batch > 1 or config.ppo_mini_batches > 1
    if config.policy_loss in RATIO_FREE_LOSSES and several:
        raise UserError(f"--policy-loss {config.policy_loss} is the policy gradient only at the sampling weights; a "
                        "batch that serves several updates (--ppo-epochs, --ppo-mini-batches) needs a ratio: "
                        f"{', '.join(name for name in POLICY_LOSSES if name not in RATIO_FREE_LOSSES)}")
    check_non_negative_finite("--entropy-coef", config.entropy_coef)
    if config.overlong_buffer is not None and config.overlong_buffer < 0:
        raise UserError(f"--overlong-buffer must be >= 0, got {config.overlong_buffer}")
    if config.overlong_buffer and config.max_new_tokens is not None and config.overlong_buffer >= config.max_new_tokens:
        raise UserError(f"--overlong-buffer {config.overlong_buffer} must be below --max-new-tokens "
                        f"{config.max_new_tokens}: the punishment starts at max-new-tokens − buffer tokens")
    if config.overlong_penalty is not None:
        check_non_negative_finite("--overlong-penalty", config.overlong_penalty)
        if not config.overlong_buffer:
            raise UserError("--overlong-penalty needs --overlong-buffer L > 0 (the punishment is off without it)")
