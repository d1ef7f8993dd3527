"""Group construction against values checked by hand for the first problems."""

from __future__ import annotations

import math

import numpy as np
import pytest

from auto_research.candidate.groups import arithmetic_groups, gsm8k_groups
from auto_research.data.gsm8k import parse_gold, read_gsm8k


def test_gold_parsing():
    assert parse_gold("so 48 + 24 = 72\n#### 72") == 72.0
    assert parse_gold("#### 1,234.5") == 1234.5
    assert parse_gold("####   -7") == -7.0
    assert parse_gold("no final answer") is None


def test_first_gsm8k_train_problems(shared_data):
    rows = read_gsm8k(shared_data / "gsm8k" / "train.jsonl", 2)
    assert [row.gold for row in rows] == [72.0, 10.0]  # Natalia's clips; Weng's babysitting
    groups = gsm8k_groups([row.gold for row in rows], seed=42)
    # Problem 1: gold 72, scale = 0.06·72 = 4.32; the shuffle put offsets (1, −1, 5, 2, −3, 0)·4.32 in place.
    np.testing.assert_allclose(groups.values[0], [76.32, 67.68, 93.6, 80.64, 59.04, 72.0])
    assert groups.gold[0] == 5
    # Problem 2: gold 10, scale = max(1, 0.6) = 1, so the candidates are 10 + (0, −3, −1, 1, 2, 5).
    assert sorted(groups.values[1]) == [7.0, 9.0, 10.0, 11.0, 12.0, 15.0]
    assert groups.values[1][groups.gold[1]] == 10.0

    phi = groups.features[0]
    np.testing.assert_allclose(phi[:, 0], 1.0)
    np.testing.assert_allclose(phi[5, 1], math.tanh(0.72))
    np.testing.assert_allclose(phi[:, 2], np.tanh(np.abs(groups.values[0]) / 100))
    np.testing.assert_array_equal(phi[:, 3], [0, 0, 0, 0, 0, 1])  # only 72 is whole
    # steps = position mod 4 + 1 = 1, 2, 3, 4, 1, 2
    np.testing.assert_allclose(phi[:, 4], [1, 1 / 2, 1 / 3, 1 / 4, 1, 1 / 2])
    np.testing.assert_array_equal(phi[:, 5], [0, 1, 1, 1, 0, 1])
    np.testing.assert_allclose(phi[:, 6], [0.25, 0.5, 0.75, 1.0, 0.25, 0.5])
    assert np.all((phi[:, 7] >= 0) & (phi[:, 7] <= 1))
    # Reward = .7·outcome + .05·format + .2·process + .05·brevity with process in [0, 1].
    known = 0.7 * np.array([0, 0, 0, 0, 0, 1]) + 0.05 * phi[:, 3] + 0.05 * np.array([1, 1 / 2, 1 / 3, 1 / 4, 1, 1 / 2])
    process = (groups.rewards[0] - known) / 0.2
    assert np.all((process >= -1e-12) & (process <= 1 + 1e-12))
    # The gold's process score sits near 1: 1 − 0 + N(0, 0.18) noise, clipped.
    assert process[5] > 0.9


def test_first_gsm8k_validation_problem_uses_seed_plus_one(shared_data):
    rows = read_gsm8k(shared_data / "gsm8k" / "test.jsonl", 1)
    assert rows[0].gold == 18.0  # Janet's ducks
    groups = gsm8k_groups([rows[0].gold], seed=43)
    # scale = max(1, 1.08) = 1.08
    assert sorted(np.round(groups.values[0], 6)) == [14.76, 16.92, 18.0, 19.08, 20.16, 23.4]
    assert groups.values[0][groups.gold[0]] == 18.0


def test_first_arithmetic_smoke_problem():
    groups = arithmetic_groups(1, np.random.default_rng(42))
    # Seed 42 draws a = 8, b = 62, op = 1 (subtract): gold = −54;
    # offsets (0, 1, −1, 2, −3, 5) shuffled to (2, 0, 5, −1, −3, 1).
    np.testing.assert_allclose(groups.values[0], [-52, -54, -49, -55, -57, -53])
    assert groups.gold[0] == 1
    phi = groups.features[0]
    np.testing.assert_allclose(phi[:, 1], np.tanh(np.array([-52, -54, -49, -55, -57, -53]) / 100))
    np.testing.assert_allclose(phi[:, 4], [1, 1 / 2, 1 / 3, 1, 1 / 2, 1 / 3])  # steps = position mod 3 + 1
    # Format is 1 for every candidate; brevity 1/(1 + position mod 3).
    known = 0.7 * np.array([0, 1, 0, 0, 0, 0]) + 0.05 + 0.05 * np.array([1, 1 / 2, 1 / 3, 1, 1 / 2, 1 / 3])
    process = (groups.rewards[0] - known) / 0.2
    assert np.all((process >= -1e-12) & (process <= 1 + 1e-12))


def test_row_without_gold_keeps_its_place_and_draws_nothing(tmp_path):
    lines = [
        '{"question": "q1", "answer": "#### 5"}',
        '{"question": "q2", "answer": "no number here"}',
        '{"question": "q3", "answer": "#### 1,200"}',
        '{"question": "q4", "answer": "#### 9"}',
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = read_gsm8k(path, 3)
    assert [row.gold for row in rows] == [5.0, None, 1200.0]  # the third row is still among the first 3
    with_gap = gsm8k_groups([row.gold for row in rows], seed=1)
    without = gsm8k_groups([5.0, 1200.0], seed=1)
    assert len(with_gap) == 2
    np.testing.assert_array_equal(with_gap.features, without.features)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "train.jsonl:2: not valid JSON"),
        ('{"question": "q"}', "train.jsonl:2: row has no field 'answer'"),
        ('["question", "answer"]', "train.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    from auto_research.errors import UserError

    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        read_gsm8k(path, 10)
