"""The candidate level's math as NumPy functions, and each algorithm's twin built on it (``estimators.py``'s torch
estimators are tested against these). Arrays are ``(..., K)``: one group of K samples per row.

``mask`` (same shape, boolean) marks the samples that may enter a baseline; one outside it gets advantage 0 and is
left out of its group's statistics. A group with fewer than two valid samples gets advantage 0 under a group
baseline. Equation numbers refer to Ahmadian et al., 2024 (arXiv 2402.14740).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

LOG_EPSILON = 1e-12
"""Added inside logarithms of probabilities (candidate-level protocol)."""


def _valid(values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    if mask is None:
        return np.ones(np.shape(values), dtype=bool)
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != np.shape(values):
        raise ValueError(f"mask shape {mask.shape} differs from values shape {np.shape(values)}")
    return mask


def shaped_reward(rewards: np.ndarray, log_ratio: np.ndarray, beta: float) -> np.ndarray:
    """r̃_i = r(x, y_i) − β · log π(y_i|x)/π_ref(y_i|x): the KL penalty in the reward (the paper's §2), part of what
    the baseline is subtracted from, no gradient of its own. ``log_ratio``: the whole response's (summed per token)."""
    return np.asarray(rewards, dtype=float) - beta * np.asarray(log_ratio, dtype=float)


def leave_one_out(values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """A_i = v_i − 1/(K−1) · Σ_{j≠i} v_j: RLOO's baseline (Eq. 5); with a mask K counts the valid samples."""
    values = np.asarray(values, dtype=float)
    valid = _valid(values, mask)
    kept = np.where(valid, values, 0.0)
    count = valid.sum(axis=-1, keepdims=True)
    total = kept.sum(axis=-1, keepdims=True)
    advantages = kept - (total - kept) / np.maximum(1, count - 1)
    return np.where(valid & (count >= 2), advantages, 0.0)


def group_normalised(values: np.ndarray, mask: np.ndarray | None = None, epsilon: float = 1e-6) -> np.ndarray:
    """A_i = (v_i − mean v) / (std v + ε), population std over the group (GRPO)."""
    values = np.asarray(values, dtype=float)
    valid = _valid(values, mask)
    count = valid.sum(axis=-1, keepdims=True)
    safe_count = np.maximum(count, 1)
    mean = np.where(valid, values, 0.0).sum(axis=-1, keepdims=True) / safe_count
    centred = np.where(valid, values - mean, 0.0)
    std = np.sqrt((centred * centred).sum(axis=-1, keepdims=True) / safe_count)
    return np.where(valid & (count >= 2), centred / (std + epsilon), 0.0)


def no_baseline(values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """A_i = v_i: the vanilla policy gradient's advantage is the (shaped) reward itself."""
    values = np.asarray(values, dtype=float)
    return np.where(_valid(values, mask), values, 0.0)


def moving_average_advantage(values: np.ndarray, baseline: float, mask: np.ndarray | None = None) -> np.ndarray:
    """A_i = v_i − b, with b a running average of past rewards (REINFORCE with a baseline)."""
    values = np.asarray(values, dtype=float)
    return np.where(_valid(values, mask), values - baseline, 0.0)


def update_moving_average(baseline: float, values: np.ndarray, decay: float = 0.9, mask: np.ndarray | None = None) -> float:
    """b ← decay · b + (1 − decay) · mean of this step's valid values."""
    values = np.asarray(values, dtype=float)
    valid = _valid(values, mask)
    if not valid.any():
        return float(baseline)
    return float(decay * baseline + (1.0 - decay) * values[valid].mean())


def greedy_baseline(rewards: np.ndarray, greedy_rewards: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """A_i = r_i − r(greedy response): ReMax's baseline (Li et al., 2023)."""
    rewards = np.asarray(rewards, dtype=float)
    return np.where(_valid(rewards, mask), rewards - np.asarray(greedy_rewards, dtype=float), 0.0)


def best_of_k(rewards: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """One-hot weight on the best sample of each group (RAFT; first drawn on ties): SFT on the best of K."""
    rewards = np.asarray(rewards, dtype=float)
    valid = _valid(rewards, mask)
    scored = np.where(valid, rewards, -np.inf)
    chosen = np.argmax(scored, axis=-1)[..., None]
    onehot = np.arange(rewards.shape[-1]) == chosen
    return (onehot & valid).astype(float)


def clipped_surrogate(ratio, advantages, clip_range: float = 0.2):
    """min(ρ_i · A_i, clip(ρ_i, 1 − ε, 1 + ε) · A_i): PPO's surrogate (Schulman et al., 2017), in array methods
    only, so that it takes NumPy arrays and torch tensors alike (keeping ``ratio``'s autograd graph)."""
    unclipped = ratio * advantages
    clipped = ratio.clip(1.0 - clip_range, 1.0 + clip_range) * advantages
    # min(a, b) = a − max(a − b, 0), in methods that NumPy and torch share.
    return unclipped - (unclipped - clipped).clip(min=0.0)


def groups_without_signal(advantages: np.ndarray) -> int:
    """Number of groups (rows) whose advantages are all zero: no gradient from them."""
    advantages = np.asarray(advantages, dtype=float)
    return int(np.all(advantages == 0.0, axis=-1).sum())


# --- the twins: one advantage function per record (registry.py names them) ----------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What a candidate-level advantage function may read about one group."""

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
    baseline: float = 0.0
    """The loop's moving-average baseline b (algorithms with ``moving_average``)."""

    def shaped(self) -> np.ndarray:
        return shaped_reward(self.rewards, self.log_ratio, self.beta)


ADVANTAGES: dict[str, Callable[[AdvantageInputs], np.ndarray]] = {
    "rloo": lambda inputs: leave_one_out(inputs.shaped(), inputs.mask),
    "vanilla-pg": lambda inputs: no_baseline(inputs.shaped(), inputs.mask),
    "reinforce": lambda inputs: moving_average_advantage(inputs.shaped(), inputs.baseline, inputs.mask),
    "remax": lambda inputs: greedy_baseline(inputs.rewards, inputs.greedy_rewards, inputs.mask),
    "raft": lambda inputs: best_of_k(inputs.rewards, inputs.mask),
    "grpo": lambda inputs: group_normalised(inputs.rewards, inputs.mask),
    "ppo": lambda inputs: group_normalised(inputs.rewards - inputs.values, inputs.mask),
}
