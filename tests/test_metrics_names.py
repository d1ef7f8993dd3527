"""One meaning per metric name (issue 37, item 5): each reward function's own mean and std per step
(``reward/<name>`` for the mean, ``reward/<name>.std``), checked against the values the functions gave, recomputed
by hand; ``entropy`` per token in the rows and in metrics.json; metrics.json's counts the sums of the rows'."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from auto_research.cli import main
from auto_research.rewards.combine import metric_names
from auto_research.rewards.verifiers import BUILT_IN, final_number

REWARDS = '''
import json

def length(prompts, completions, rows):
    with open("calls.jsonl", "a") as stream:  # what the test recomputes the figures from
        stream.write(json.dumps(completions) + "\\n")
    return [float(len(c)) for c in completions]

def parity(completions, **kwargs):  # TRL's calling convention
    return [float(len(c) % 2) for c in completions]

def thirds(prompts, completions, rows):
    return [None if len(c.strip()) % 3 == 0 else 0.5 * len(c.strip()) for c in completions]
'''

WEIGHTS = (1.0, 2.0, 0.5, 3.0)


def _functions(text: str) -> dict:
    return {"length": float(len(text)), "parity": float(len(text) % 2),
            "thirds": None if len(text.strip()) % 3 == 0 else 0.5 * len(text.strip()),
            "format": float(final_number(text) is not None)}


def _figures(completions: list[str]) -> dict:
    """By hand: each function's mean and population std over the values it gave; the weighted sum's mean over the
    samples every function scored; the groups of 4 whose scored sums do not all agree."""
    values = [_functions(text) for text in completions]
    expected = {}
    for name in ("length", "parity", "thirds", "format"):
        given = [row[name] for row in values if row[name] is not None]
        expected[f"reward/{name}"] = statistics.fmean(given) if given else None
        expected[f"reward/{name}.std"] = statistics.pstdev(given) if given else None
    sums = [None if any(v is None for v in row.values()) else sum(w * v for w, v in zip(WEIGHTS, row.values()))
            for row in values]
    scored = [value for value in sums if value is not None]
    expected["reward_mean"] = statistics.fmean(scored)
    groups = [[v for v in sums[i: i + 4] if v is not None] for i in range(0, len(sums), 4)]
    expected["no_signal_groups"] = sum(len(g) < 2 or max(g) == min(g) for g in groups)
    expected["unscored_samples"] = sum(value is None for value in sums)
    return expected


def test_metric_names_are_trl_s():
    def reward(prompts, completions, rows):
        return [0.0] * len(completions)

    class Scorer:
        def __call__(self, prompts, completions, rows):
            return [0.0] * len(completions)

    assert metric_names([("format", BUILT_IN["format"]), ("my_rewards:reward", reward), ("other.py:reward", reward),
                         ("scorer", Scorer()), ("reward-url:http://h:1/s", None),
                         ("reward-model:runs/rlhf/reward-model", None), ("check", lambda p, c, r: [])]) == [
        "format", "reward", "reward_2", "Scorer", "reward_url", "reward-model", "check"]


def test_each_reward_function_s_mean_per_step_and_the_counts_agree_with_the_rows(tiny_model_dir, sums_jsonl, tmp_path,
                                                                                 monkeypatch, capsys):
    (tmp_path / "named_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "3",
                 "--prompts-per-step", "2", "--max-new-tokens", "4", "--evaluation-examples", "4", "--eval-every",
                 "0", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "out"),
                 "--reward", "named_rewards:length", "--reward", "named_rewards:parity", "--reward",
                 "named_rewards:thirds", "--reward", "format", "--reward-weights", ",".join(map(str, WEIGHTS))])
    assert code == 0, capsys.readouterr().err
    run = tmp_path / "out" / "rloo-sums-seed42"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    steps = [batch for batch in calls if len(batch) == 8]  # 2 prompts × K = 4; the evaluations score 4
    assert len(steps) == len(rows) == 3
    for row, completions in zip(rows, steps):
        for key, value in _figures(completions).items():
            assert row[key] == (None if value is None else pytest.approx(value, abs=1e-6)), key
        assert row["no_signal_fraction"] == row["no_signal_groups"] / 2
    metrics = json.loads((run / "metrics.json").read_text())
    for key in ("no_signal_groups", "unscored_samples", "invalid_rewards"):
        assert metrics["training"][key] == sum(row[key] for row in rows), key
    # Entropy per token everywhere: no more than the uniform distribution's over the vocabulary, in the rows and in
    # the evaluations (summed over a completion of several tokens, an untrained model's is several times that).
    ceiling = math.log(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])
    assert all(0 < row["entropy"] <= ceiling + 1e-6 for row in rows)
    assert 0 < metrics["baseline"]["entropy"] <= ceiling + 1e-6 and 0 < metrics["final"]["entropy"] <= ceiling + 1e-6
