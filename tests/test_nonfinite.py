"""Non-finite figures (issue 38, case 8; issue 37, item 8): a reward of NaN, ±inf or beyond ±1e6, from a reward
function, an environment or a reward server, is that sample's failure (unscored, counted in invalid_rewards, named
in the one line when every sample fails); every JSON a run writes has null where a figure is not finite; ``rlhf``
with a --pairs too small for its held-out figures runs and writes null for them."""

from __future__ import annotations

import json
import math

import pytest

from auto_research.cli import main
from auto_research.data.types import Example
from auto_research.rewards.combine import MAX_REWARD, CombinedReward, Scored, checked

REWARDS = '''
import math

def all_nan(prompts, completions, rows):
    return [math.nan for _ in completions]

def all_inf(prompts, completions, rows):
    return [-math.inf for _ in completions]

def all_huge(prompts, completions, rows):
    return [1e308 for _ in completions]

def odd_nan(prompts, completions, rows):
    return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

class Nan:
    """Says "done" and scores it NaN (or inf): the environment's own reward is invalid."""
    def __init__(self, value):
        self.value = value
    def reset(self):
        return None
    def step(self, text):
        return None, self.value, True

def nan_env(row):
    return Nan(math.nan)
'''


def strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "nf_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "nf_rewards"


def _run(model, data, output, *flags):
    return main(["post-train", "--model", str(model), "--dataset", str(data), "--steps", "2", "--prompts-per-step",
                 "2", "--max-new-tokens", "3", "--evaluation-examples", "4", "--eval-every", "0", "--offline",
                 "--device", "cpu", "--no-progress", "--output-dir", str(output), *flags])


def test_invalid_values_are_unscored_with_their_cause_and_the_bound_is_inclusive():
    assert MAX_REWARD == 1e6
    values = checked([math.nan, math.inf, -math.inf, 1e308, 2e6, -1e6, 1.5, None], "reward 'f'")
    assert values == [None, None, None, None, None, -1e6, 1.5, None]
    assert values.causes == ["reward 'f' returned nan", "reward 'f' returned inf", "reward 'f' returned -inf",
                             "reward 'f' returned a value beyond ±1,000,000",
                             "reward 'f' returned a value beyond ±1,000,000", None, None, None]


def test_a_component_s_invalid_value_is_that_sample_s_failure_and_its_own_values_are_kept():
    examples = [Example("q", "1")] * 4
    first = lambda p, c, e: [1.0, math.nan, 0.5, None]  # noqa: E731
    second = lambda p, c, e: [2.0, 1.0, 1e300, 3.0]  # noqa: E731
    combined = CombinedReward([("first", first, 1.0), ("second", second, 0.5)])(["a"] * 4, ["x"] * 4, examples)
    assert isinstance(combined, Scored) and combined == [2.0, None, None, None]
    assert combined.causes == [None, "reward 'first' returned nan", "reward 'second' returned a value beyond "
                                                                   "±1,000,000", None]
    assert combined.parts == {"first": [1.0, None, 0.5, None], "second": [2.0, 1.0, None, 3.0]}
    # Two weighted values within the bound whose sum is not: the sum is the failure.
    big = CombinedReward([("a", lambda p, c, e: [9e5], 1.0), ("b", lambda p, c, e: [9e5], 1.0)])(["a"], ["x"],
                                                                                             examples[:1])
    assert big == [None] and big.causes == ["the weighted sum of the rewards returned a value beyond ±1,000,000"]


def test_the_one_line_gives_each_cause_with_its_count_most_frequent_first():
    from auto_research.train.rollouts import unscored_reasons

    assert unscored_reasons({}, 8, 8, "completions") == "the reward returned None for all 8 completions"
    assert unscored_reasons({"reward 'f' returned nan": 2, "the environment's reward was inf": 1}, 8, 8,
                            "completions") == ("the reward returned None for 5 of 8 completions, reward 'f' returned "
                                               "nan for 2, the environment's reward was inf for 1")


@pytest.mark.parametrize("function, shown", [("all_nan", "nan"), ("all_inf", "-inf"),
                                             ("all_huge", "a value beyond ±1,000,000")])
def test_a_reward_invalid_for_every_sample_is_one_line_naming_the_function(tiny_model_dir, sums_jsonl, tmp_path,
                                                                          rewards, capsys, function, shown):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "out", "--reward", f"{rewards}:{function}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "JSON compliant" not in err
    # The reward as the run records it (user_code.py: a module of the working folder by its file's path).
    recorded = f"{tmp_path.resolve() / rewards}.py:{function}"
    assert err.strip().splitlines()[-1] == (f"auto-research: error: no sample of step 1 could be scored: reward "
                                            f"'{recorded}' returned {shown} for all 8 completions; nothing "
                                            "was written")


def test_some_invalid_rewards_are_counted_and_the_run_goes_on(tiny_model_dir, sums_jsonl, tmp_path, rewards, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--reward", f"{rewards}:odd_nan") == 0
    err = capsys.readouterr().err
    recorded = f"{tmp_path.resolve() / rewards}.py:odd_nan"  # as the run records it (user_code.py)
    assert err.count(f"warning: reward '{recorded}' returned nan for 4 of 8 samples at step 1;") == 1
    run = tmp_path / "rloo-sums-seed42"
    rows = [strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["invalid_rewards"], row["unscored_samples"]) for row in rows] == [(4, 4), (4, 4)]
    # The scored half all got 1.0: the function's own mean and std, and the combined reward's.
    assert [(row["reward/odd_nan"], row["reward/odd_nan.std"], row["reward_mean"]) for row in rows] == [
        (1.0, 0.0, 1.0)] * 2
    training = strict((run / "metrics.json").read_text())["training"]
    assert training["invalid_rewards"] == 8 and training["unscored_samples"] == 8


def test_an_environment_s_nan_reward_is_its_sample_s_failure_named_in_one_line(tiny_model_dir, sums_jsonl, tmp_path,
                                                                              rewards, capsys):
    # Two turns of 3 tokens: the first reply always reaches step() (one turn would be cut at its token budget).
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "out", "--environment", f"{rewards}:nan_env",
                "--max-turns", "2") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # The environment's step() fails its sample in the environment's words (envs/__init__.py).
    assert err.strip().splitlines()[-1] == ("auto-research: error: no sample of step 1 could be scored: the "
                                            "environment failed on 8 of 8 samples (the first: ValueError: step()'s "
                                            "reward is nan, not a finite number (or None)); nothing was written")


def test_a_reward_server_s_nan_inf_and_huge_values_are_unscored_and_named(monkeypatch):
    from auto_research.rewards import remote
    from auto_research.rewards.combine import build_reward
    from auto_research.rewards.loading import resolve_rewards

    # The server's answer as Python's json.loads reads it: NaN, Infinity and 1e999 are nan, inf and inf.
    monkeypatch.setattr(remote, "request", lambda *args: b"[NaN, Infinity, 1e999, 1e308, 0.25]")
    url = "http://127.0.0.1:9/score"
    reward = build_reward(resolve_rewards([], None, None, reward_url=url), None, None, "match")
    values = reward(["p"] * 5, ["a", "b", "c", "d", "e"], [Example("p", "1")] * 5)
    name = f"reward-url:{url}"
    assert values == [None, None, None, None, 0.25]
    assert values.causes == [f"reward {name!r} returned nan", f"reward {name!r} returned inf",
                             f"reward {name!r} returned inf", f"reward {name!r} returned a value beyond ±1,000,000",
                             None]
    assert values.parts == {"reward_url": [None, None, None, None, 0.25]}


def test_every_json_the_run_writes_has_null_for_a_non_finite_figure(tmp_path):
    from auto_research.files import append_json_lines, atomic_write_json
    from auto_research.train.metrics import MetricsLog

    atomic_write_json(tmp_path / "a.json", {"x": math.nan, "nested": [{"y": -math.inf}, (1.0, math.inf)], "z": 2})
    assert strict((tmp_path / "a.json").read_text()) == {"x": None, "nested": [{"y": None}, [1.0, None]], "z": 2}
    append_json_lines(tmp_path / "b.jsonl", [{"step": 1, "v": math.nan}, {"step": 2, "v": 0.5}])
    assert [strict(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()] == [
        {"step": 1, "v": None}, {"step": 2, "v": 0.5}]
    log = MetricsLog(tmp_path)
    log.pending = None  # opened: completions go straight to the file
    log.completions(3, [{"prompt": "p", "completion": "c", "reward": math.nan}])
    assert strict((tmp_path / "completions.jsonl").read_text()) == {"step": 3, "prompt": "p", "completion": "c",
                                                                    "reward": None}


def test_rlhf_with_too_few_pairs_for_a_gold_ordered_held_out_pair_runs_and_writes_null(tiny_model_dir, tmp_path,
                                                                                      capsys):
    """--pairs 2 from the tiny model: the gold scorer (4-character answers) ties both pairs, so the labels'
    agreement with it and the proxy's gold-order accuracy have nothing to be measured on (they were NaN, and
    writing them was a traceback)."""
    code = main(["rlhf", "--model", str(tiny_model_dir), "--pairs", "2", "--reward-model-steps", "2", "--steps", "1",
                 "--eval-every", "1", "--output-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [json.loads(line) for line in (tmp_path / "preferences.jsonl").read_text().splitlines()]
    assert rows and all(row["gold_chosen"] == row["gold_rejected"] for row in rows)  # what this test is about
    metrics = strict((tmp_path / "reward-model" / "metrics.json").read_text())
    assert metrics["gold_order_accuracy"] is None and metrics["label_agreement"] is None
    summary = strict((tmp_path / "rlhf-summary.json").read_text())
    assert summary["labels"]["label_agreement"] is None and summary["reward_model"]["gold_order_accuracy"] is None
    assert "nan" not in out.out + out.err
    assert "n/a against the gold order on the 0 of 1 held-out pairs it orders" in out.err  # the log
    assert "agree with it on n/a (the noise model's expectation: n/a)" in out.out  # the summary table
