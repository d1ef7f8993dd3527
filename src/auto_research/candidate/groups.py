"""Turning problems into groups of 6 candidate answers (the candidate protocol). Every random draw happens here in
the protocol's order, so a seed gives the same groups on every machine: one Generator per split, one problem at a
time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CANDIDATES = 6
FEATURES = ("bias", "signed value", "magnitude", "integer", "concise", "has equation", "step count", "self-check")
REWARD_WEIGHTS = {"outcome": 0.7, "format": 0.05, "reasoning": 0.2, "brevity": 0.05}


@dataclass(frozen=True)
class CandidateGroups:
    """G groups of 6 candidates: what the policy sees and what the reward says."""

    features: np.ndarray  # (G, 6, 8) φ, in the order of FEATURES
    rewards: np.ndarray  # (G, 6) scalar reward
    gold: np.ndarray  # (G,) index of the correct candidate
    values: np.ndarray  # (G, 6) the candidate answers themselves

    def __len__(self) -> int:
        return len(self.gold)


def _features(values: np.ndarray, steps: np.ndarray, self_check: np.ndarray) -> np.ndarray:
    integer = (values == np.floor(values)).astype(float)
    return np.stack([np.ones(CANDIDATES), np.tanh(values / 100), np.tanh(np.abs(values) / 100), integer, 1 / steps,
                     (steps > 1).astype(float), np.minimum(steps / 4, 1), self_check], axis=1)


def _scalar_reward(outcome, format_, reasoning, brevity) -> np.ndarray:
    weights = REWARD_WEIGHTS
    return (weights["outcome"] * outcome + weights["format"] * format_ + weights["reasoning"] * reasoning
            + weights["brevity"] * brevity)


def _group(rng: np.random.Generator, gold: float, offsets: np.ndarray, spread: float, noise: tuple[float, float],
           steps: np.ndarray) -> tuple:
    """One problem's candidates gold + ``offsets`` (shuffled), drawing in the protocol's order: the shuffle, the
    process noise, the self-check noise. Its format reward is the integer feature (always 1 on arithmetic)."""
    rng.shuffle(offsets)
    values = gold + offsets
    process = np.clip(1 - np.abs(offsets) / spread + rng.normal(0, noise[0], CANDIDATES), 0, 1)
    self_check = np.clip(process + rng.normal(0, noise[1], CANDIDATES), 0, 1)
    phi = _features(values, steps, self_check)
    reward = _scalar_reward((offsets == 0).astype(float), phi[:, 3], process, 1 / steps)
    return phi, reward, int(np.flatnonzero(offsets == 0)[0]), values


def _stack(groups: list[tuple[np.ndarray, np.ndarray, int, np.ndarray]]) -> CandidateGroups:
    if not groups:
        empty = np.zeros((0, CANDIDATES))
        return CandidateGroups(np.zeros((0, CANDIDATES, len(FEATURES))), empty, np.zeros(0, dtype=int), empty)
    features, rewards, gold, values = zip(*groups)
    return CandidateGroups(np.stack(features), np.stack(rewards), np.array(gold), np.stack(values))


def gsm8k_groups(golds: list[float | None], seed: int) -> CandidateGroups:
    """``gsm8k-candidate``: distractors at gold + [−3, −1, 1, 2, 5]·scale; no group for a problem without gold."""
    rng = np.random.default_rng(seed)
    steps = np.arange(CANDIDATES) % 4 + 1
    groups = []
    for gold in golds:
        if gold is None:
            continue
        scale = max(1.0, 0.06 * abs(gold))
        offsets = np.array([0.0, -3.0, -1.0, 1.0, 2.0, 5.0]) * scale
        groups.append(_group(rng, gold, offsets, 5 * scale, (0.18, 0.12), steps))
    return _stack(groups)


def arithmetic_groups(count: int, rng: np.random.Generator) -> CandidateGroups:
    """``arithmetic-smoke``: a op b with a, b in [2, 80) and distractors gold + [1, −1, 2, −3, 5]."""
    steps = np.arange(CANDIDATES) % 3 + 1
    groups = []
    for _ in range(count):
        a = rng.integers(2, 80)
        b = rng.integers(2, 80)
        op = rng.integers(0, 3)
        gold = float((a + b, a - b, a * b)[op])
        groups.append(_group(rng, gold, np.array([0.0, 1.0, -1.0, 2.0, -3.0, 5.0]), 5, (0.12, 0.08), steps))
    return _stack(groups)
