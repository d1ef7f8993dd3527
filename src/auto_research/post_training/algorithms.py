"""The algorithm registry: a name maps to an advantage function and a few flags.

An algorithm decides only how advantages are estimated and which objective
turns them into a gradient; the loop that samples, scores and steps is shared.
Adding one means one small function and one ``register`` call.

Each advantage function takes the group's ``AdvantageInputs`` and the
algorithm's own small, JSON-serialisable ``state`` dict (for instance a moving
average), and returns advantages of shape ``(..., K)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from auto_research.errors import UserError
from auto_research.post_training import estimators


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage function may read about one batch of groups."""

    rewards: np.ndarray
    """(..., K) task reward r(x, y_i), before any KL shaping."""
    log_ratio: np.ndarray
    """(..., K) sampled log π(y_i|x)/π_ref(y_i|x) of each whole response."""
    beta: float
    """β, the weight of the KL penalty."""
    mask: np.ndarray | None = None
    """(..., K) samples allowed into a baseline (None: all)."""
    greedy_rewards: np.ndarray | None = None
    """(..., 1) reward of the greedy response (algorithms with ``needs_greedy``)."""
    values: np.ndarray | None = None
    """(..., K) critic's value estimates (algorithms with ``needs_critic``)."""

    def shaped(self) -> np.ndarray:
        return estimators.shaped_reward(self.rewards, self.log_ratio, self.beta)


AdvantageFunction = Callable[[AdvantageInputs, dict], np.ndarray]


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: AdvantageFunction
    objective: Literal["policy-gradient", "clipped"]
    """policy-gradient: A_i · ∇log π(y_i); clipped: PPO's clipped surrogate of ρ_i · A_i."""
    reduction: Literal["mean", "sum"]
    """How per-sample terms of a group combine: mean (1/K Σ_i) or sum (best-of-K)."""
    kl: Literal["reward", "loss", "none"]
    """reward: −β·log-ratio shapes the reward; loss: a separate KL term in the loss."""
    samples_from: Literal["policy", "rollout"]
    """policy: the current weights sample; rollout: a periodically refreshed copy (PPO-style)."""
    formula: str
    """One line for --help and the README."""
    reference_checked: bool
    """Whether the candidate level has published reference figures for it."""
    needs_critic: bool = False
    needs_greedy: bool = False
    min_group_size: int = 1
    """Smallest K the estimator is defined for (2 when the baseline uses the other samples)."""
    citation: str = ""


REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is registered twice")
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    try:
        return REGISTRY[name]
    except KeyError:
        allowed = ", ".join(REGISTRY)
        raise UserError(f"unknown algorithm {name!r}; choose one of: {allowed}") from None


def check_group_size(algorithm: Algorithm, group_size: int) -> None:
    if group_size < algorithm.min_group_size:
        raise UserError(
            f"--group-size {group_size} is too small for {algorithm.name}: its baseline comes from the "
            f"other samples of the group, so it needs K >= {algorithm.min_group_size}"
            " (leave-one-out is undefined for K = 1)"
        )


# --- advantage functions --------------------------------------------------------


def _rloo(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.leave_one_out(inputs.shaped(), inputs.mask)


def _vanilla_pg(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.no_baseline(inputs.shaped(), inputs.mask)


def _reinforce(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    shaped = inputs.shaped()
    baseline = state.get("moving_average", 0.0)
    advantages = estimators.moving_average_advantage(shaped, baseline, inputs.mask)
    # The baseline moves after it has been used, so b never contains this step's rewards.
    state["moving_average"] = estimators.update_moving_average(baseline, shaped, 0.9, inputs.mask)
    return advantages


def _remax(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.greedy_baseline(inputs.rewards, inputs.greedy_rewards, inputs.mask)


def _raft(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.best_of_k(inputs.rewards, inputs.mask)


def _grpo(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.group_normalised(inputs.rewards, inputs.mask)


def _ppo(inputs: AdvantageInputs, state: dict) -> np.ndarray:
    return estimators.group_normalised(inputs.rewards - inputs.values, inputs.mask)


register(Algorithm(
    name="rloo",
    advantages=_rloo,
    objective="policy-gradient",
    reduction="mean",
    kl="reward",
    samples_from="policy",
    min_group_size=2,
    reference_checked=True,
    formula="A_i = r̃_i − 1/(K−1) Σ_{j≠i} r̃_j with r̃_i = r_i − β log π(y_i)/π_ref(y_i); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Ahmadian et al., 2024 (arXiv 2402.14740); Kool et al., 2019",
))
register(Algorithm(
    name="ppo-rlhf",
    advantages=_ppo,
    objective="clipped",
    reduction="mean",
    kl="loss",
    samples_from="rollout",
    needs_critic=True,
    min_group_size=2,
    reference_checked=True,
    formula="A = standardise(r − V) over the group, V a learned critic; clipped surrogate of ρ_i A_i, ρ_i = π/π_rollout; KL penalty in the loss",
    citation="Schulman et al., 2017; Ouyang et al., 2022",
))
register(Algorithm(
    name="grpo",
    advantages=_grpo,
    objective="clipped",
    reduction="mean",
    kl="loss",
    samples_from="rollout",
    min_group_size=2,
    reference_checked=True,
    formula="A_i = (r_i − mean r) / (std r + 1e−6); clipped surrogate of ρ_i A_i; KL penalty in the loss",
    citation="Shao et al., 2024 (arXiv 2402.03300)",
))
register(Algorithm(
    name="remax",
    advantages=_remax,
    objective="policy-gradient",
    reduction="mean",
    kl="none",
    samples_from="policy",
    needs_greedy=True,
    reference_checked=True,
    formula="A_i = r_i − r(greedy response); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Li et al., 2023 (arXiv 2310.10505)",
))
register(Algorithm(
    name="reinforce",
    advantages=_reinforce,
    objective="policy-gradient",
    reduction="mean",
    kl="reward",
    samples_from="policy",
    reference_checked=False,
    formula="A_i = r̃_i − b, b ← 0.9 b + 0.1 mean r̃ after each step; g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Williams, 1992; the paper's 'REINFORCE with baseline'",
))
register(Algorithm(
    name="vanilla-pg",
    advantages=_vanilla_pg,
    objective="policy-gradient",
    reduction="mean",
    kl="reward",
    samples_from="policy",
    reference_checked=False,
    formula="A_i = r̃_i (no baseline); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Williams, 1992; the paper's 'vanilla policy gradient'",
))
register(Algorithm(
    name="raft",
    advantages=_raft,
    objective="policy-gradient",
    reduction="sum",
    kl="none",
    samples_from="policy",
    min_group_size=2,
    reference_checked=True,
    formula="train on the best of K samples (first drawn on ties): g = ∇log π(y_best)",
    citation="Dong et al., 2023 (arXiv 2304.06767)",
))
