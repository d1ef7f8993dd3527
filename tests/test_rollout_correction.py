"""The sampler/trainer mismatch correction's maths, by hand (algorithms/correction.py)."""

from __future__ import annotations

import math

import pytest
import torch

from auto_research.algorithms.correction import importance_weights, mismatch

# Two completions of 3 tokens; the second has 2 (its last position is padding).
LOG_RATIO = torch.tensor([[0.2, -0.1, 0.4], [1.0, 0.5, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_tis_truncates_each_tokens_ratio():
    weights = importance_weights(LOG_RATIO, MASK, "token-tis", 2.0)
    expected = torch.tensor([[math.exp(0.2), math.exp(-0.1), math.exp(0.4)], [2.0, math.exp(0.5), 0.0]])
    assert torch.allclose(weights, expected, atol=1e-6)


def test_sequence_tis_weights_every_token_with_the_completions_ratio():
    weights = importance_weights(LOG_RATIO, MASK, "sequence-tis", 2.0)
    first = math.exp(0.2 - 0.1 + 0.4)  # 1.6487, under the cap
    expected = torch.tensor([[first] * 3, [2.0, 2.0, 0.0]])  # exp(1.5) = 4.48 → 2
    assert torch.allclose(weights, expected, atol=1e-6)


def test_sequence_mask_drops_completions_outside_the_band():
    weights = importance_weights(LOG_RATIO, MASK, "sequence-mask", 2.0)
    assert torch.equal(weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    low = importance_weights(torch.tensor([[-0.8]]), torch.ones(1, 1), "sequence-mask", 2.0)  # 0.45 < 1/2
    assert float(low) == 0.0


def test_none_and_identical_distributions_cost_nothing():
    assert torch.equal(importance_weights(LOG_RATIO, MASK, "none", 2.0), MASK)
    for mode in ("token-tis", "sequence-tis", "sequence-mask"):
        assert torch.equal(importance_weights(torch.zeros(2, 3), MASK, mode, 2.0), MASK)
    with pytest.raises(ValueError, match="unknown rollout correction"):
        importance_weights(LOG_RATIO, MASK, "bogus", 2.0)


def test_mismatch_sums_by_hand():
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    sampler = torch.tensor([[-1.5, -2.0], [-0.25, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    drift = mismatch(trainer, sampler, mask)
    assert float(drift["absolute"]) == pytest.approx(0.5 + 0.0 + 0.25)
    assert float(drift["maximum"]) == pytest.approx(0.5)
    k3 = (math.exp(0.5) - 1 - 0.5) + 0.0 + (math.exp(-0.25) - 1 + 0.25)
    assert float(drift["k3"]) == pytest.approx(k3)
    assert float(drift["tokens"]) == 3.0
