"""Each estimator against numbers worked by hand and against a brute-force loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from auto_research.algorithms import candidate as estimators
from auto_research.algorithms.candidate import ADVANTAGES, AdvantageInputs
from auto_research.algorithms.registry import candidate_algorithms, get_algorithm


def test_shaped_reward_subtracts_beta_times_log_ratio():
    np.testing.assert_allclose(estimators.shaped_reward([1.0, 0.0], [0.5, -1.0], 0.1), [0.95, 0.1])


def test_leave_one_out_by_hand():
    # A_0 = 1 − (0 + .5 + .5)/3 = 2/3, A_1 = 0 − 2/3, A_2 = A_3 = .5 − 1.5/3 = 0
    np.testing.assert_allclose(estimators.leave_one_out([1.0, 0.0, 0.5, 0.5]), [2 / 3, -2 / 3, 0.0, 0.0])


def test_leave_one_out_equals_scaled_mean_centring():
    # The paper's identity: A_i = K/(K−1) · (r_i − mean r).
    values = np.array([[0.3, 1.7, -0.2, 0.9, 0.0]])
    expected = 5 / 4 * (values - values.mean())
    np.testing.assert_allclose(estimators.leave_one_out(values), expected)


def test_leave_one_out_mask_leaves_invalid_samples_out_of_the_baseline():
    # Valid: 1, 0, .5 → A = 1 − .25, 0 − .75, .5 − .5; the masked sample gets 0.
    advantages = estimators.leave_one_out([1.0, 0.0, 9.0, 0.5], [True, True, False, True])
    np.testing.assert_allclose(advantages, [0.75, -0.75, 0.0, 0.0])


def test_group_with_one_valid_sample_has_no_signal():
    advantages = estimators.leave_one_out([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], [[True, False, False], [True, True, True]])
    np.testing.assert_allclose(advantages[0], [0.0, 0.0, 0.0])
    assert estimators.groups_without_signal(advantages) == 1


def test_group_normalised_by_hand():
    # mean .5, population std sqrt((.25 + .25)/4) = sqrt(.125)
    std = math.sqrt(0.125)
    expected = np.array([0.5, -0.5, 0.0, 0.0]) / (std + 1e-6)
    np.testing.assert_allclose(estimators.group_normalised([1.0, 0.0, 0.5, 0.5]), expected)


def test_group_normalised_of_equal_rewards_is_zero():
    np.testing.assert_array_equal(estimators.group_normalised([0.5, 0.5, 0.5]), [0.0, 0.0, 0.0])
    # 0.7 is not a binary fraction: the mean carries rounding, the result stays negligible.
    np.testing.assert_allclose(estimators.group_normalised([0.7, 0.7, 0.7]), [0.0, 0.0, 0.0], atol=1e-9)


def test_moving_average_by_hand():
    assert estimators.update_moving_average(0.0, [1.0, 0.0]) == pytest.approx(0.05)
    assert estimators.update_moving_average(0.05, [0.2, 0.4]) == pytest.approx(0.9 * 0.05 + 0.1 * 0.3)
    np.testing.assert_allclose(estimators.moving_average_advantage([1.0, 0.2], 0.05), [0.95, 0.15])


def test_greedy_baseline_and_best_of_k_by_hand():
    np.testing.assert_allclose(estimators.greedy_baseline([1.0, 0.5, 0.0], [0.5]), [0.5, 0.0, -0.5])
    # Ties go to the first drawn.
    np.testing.assert_array_equal(estimators.best_of_k([0.3, 0.9, 0.9, 0.1]), [0, 1, 0, 0])
    np.testing.assert_array_equal(estimators.best_of_k([0.3, 0.9, 0.8, 0.1], [True, False, True, True]), [0, 0, 1, 0])


def test_clipped_surrogate_by_hand():
    ratio = np.array([0.5, 1.5, 1.0, 1.5, 0.5])
    advantages = np.array([1.0, 1.0, -1.0, -1.0, -1.0])
    # min(.5, .8) = .5; min(1.5, 1.2) = 1.2; −1; min(−1.5, −1.2) = −1.5; min(−.5, −.8) = −.8
    np.testing.assert_allclose(estimators.clipped_surrogate(ratio, advantages, 0.2), [0.5, 1.2, -1.0, -1.5, -0.8])


def _brute_force(name: str, rewards, log_ratio, mask, beta, greedy, values, moving_average):
    """Per-group, per-sample loops written straight from the definitions."""
    groups, K = rewards.shape
    out = np.zeros_like(rewards)
    for g in range(groups):
        valid = [i for i in range(K) if mask[g, i]]
        shaped = {i: rewards[g, i] - beta * log_ratio[g, i] for i in valid}
        for i in valid:
            if name == "rloo":
                others = [shaped[j] for j in valid if j != i]
                out[g, i] = shaped[i] - sum(others) / len(others) if others else 0.0
            elif name == "vanilla-pg":
                out[g, i] = shaped[i]
            elif name == "reinforce":
                out[g, i] = shaped[i] - moving_average
            elif name == "remax":
                out[g, i] = rewards[g, i] - greedy[g, 0]
            elif name in ("grpo", "ppo-rlhf"):
                base = {j: rewards[g, j] - (values[g, j] if name == "ppo-rlhf" else 0.0) for j in valid}
                if len(valid) < 2:
                    continue
                mean = sum(base.values()) / len(valid)
                std = math.sqrt(sum((v - mean) ** 2 for v in base.values()) / len(valid))
                out[g, i] = (base[i] - mean) / (std + 1e-6)
            elif name == "raft":
                best = max(valid, key=lambda j: (rewards[g, j], -j))
                out[g, i] = 1.0 if i == best else 0.0
        if name == "rloo" and len(valid) < 2:
            out[g] = 0.0
    return out


@pytest.mark.parametrize("name", sorted(candidate_algorithms()))
def test_every_registered_estimator_matches_a_brute_force_loop(name):
    rng = np.random.default_rng(7)
    shape = (6, 5)
    rewards = rng.normal(size=shape)
    log_ratio = rng.normal(size=shape)
    mask = rng.random(shape) > 0.3
    mask[0] = True
    mask[1] = [True, False, False, False, False]
    greedy = rng.normal(size=(shape[0], 1))
    values = rng.normal(size=shape)
    algorithm = get_algorithm(name)
    inputs = AdvantageInputs(rewards, log_ratio, 0.05, mask, greedy, values, baseline=0.25)
    got = ADVANTAGES[algorithm.candidate.advantage](inputs)
    expected = _brute_force(name, rewards, log_ratio, mask, 0.05, greedy, values, 0.25)
    np.testing.assert_allclose(got, expected, atol=1e-12)
    assert np.all(got[~mask] == 0.0)
    if algorithm.moving_average is not None:  # the loop moves the baseline afterwards, by the record's decay
        shaped = (rewards - 0.05 * log_ratio)[mask]
        after = estimators.update_moving_average(0.25, inputs.shaped(), algorithm.moving_average, mask)
        assert after == pytest.approx(0.9 * 0.25 + 0.1 * shaped.mean())
