"""The RLHF pipeline: Bradley–Terry reward models, win rates, preference-generate, bad inputs."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from auto_research.cli import main
from auto_research.recipes.preferences import label_pairs
from auto_research.rewards.gold import gold_scores, win_rate
from auto_research.recipes.reward_model import bradley_terry_loss


def test_bradley_terry_loss_and_gradient_by_hand():
    chosen = torch.tensor([2.0], requires_grad=True)
    rejected = torch.tensor([0.5], requires_grad=True)
    loss = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-6)  # 0.20141
    loss.backward()
    sigma = 1 / (1 + math.exp(1.5))  # σ(−1.5): the gradient pushes r_w up and r_l down by it
    assert float(chosen.grad) == pytest.approx(-sigma, abs=1e-6)
    assert float(rejected.grad) == pytest.approx(sigma, abs=1e-6)
    # A margin of 1 leaves a difference of 0.5; centring adds c · (r_w + r_l)² = 0.1 · 2.5².
    assert bradley_terry_loss(chosen, rejected, torch.tensor([1.0])).item() == pytest.approx(math.log(1 + math.exp(-0.5)), abs=1e-6)
    centred = bradley_terry_loss(chosen, rejected, center_coefficient=0.1)
    assert centred.item() == pytest.approx(math.log(1 + math.exp(-1.5)) + 0.625, abs=1e-6)


def test_win_rate_counts_both_orders():
    prompts, examples = ["p"] * 4, [None] * 4
    new, old = ["a", "b", "c", "d"], ["e", "f", "g", "h"]
    always_first = lambda prompt, a, b, example: 1.0  # noqa: E731 - a judge biased to position A
    total, count = win_rate(always_first, "first", prompts, examples, new, old)
    assert total / count == 0.5
    prefers_new = lambda prompt, a, b, example: 1.0 if a in new else 0.0  # noqa: E731
    total, count = win_rate(prefers_new, "new", prompts, examples, new, old)
    assert total / count == 1.0


def test_gold_labels_and_their_ceiling():
    # 1 − |length − 4| / 4: "1234" is the best answer, "12" and "123456" are equally far.
    assert gold_scores(None, ["1234", "12", "123456", " 123 "], None) == [1.0, 0.5, 0.5, 0.75]
    random.seed(0)
    prompts = [f"{i}+1=" for i in range(400)]
    first = ["1234"] * 200 + ["12"] * 200
    second = ["12"] * 200 + ["12"] * 199 + ["123"]
    rows, statistics = label_pairs(prompts, [None] * 400, first, second, seed=3)
    assert statistics["identical_pairs_dropped"] == 199 and statistics["pairs"] == 201
    # Gold differences of 0.5 and 0.25: the labels agree with the gold order with probability σ(Δ/τ).
    expected = (200 * (1 / (1 + math.exp(-0.5 / 0.15))) + 1 / (1 + math.exp(-0.25 / 0.15))) / 201
    assert statistics["label_ceiling"] == pytest.approx(expected, abs=1e-9)
    assert abs(statistics["label_agreement"] - expected) < 0.06


def _pairs(path, count=80):
    generator = random.Random(1)
    rows = []
    for _ in range(count):
        digits = "".join(generator.choice("0123456789") for _ in range(3))
        rows.append({"prompt": f"{digits}=", "chosen": f"{digits}!", "rejected": f"{digits}?"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_reward_model_learns_a_separable_toy_set_and_loads_as_a_reward(tmp_path, capsys):
    data = _pairs(tmp_path / "prefs.jsonl")
    code = main(["reward-model", "--dataset", str(data), "--output-dir", str(tmp_path / "rm"), "--steps", "120",
                 "--batch-size", "16", "--learning-rate", "3e-3", "--evaluation-examples", "20", "--device", "cpu",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "rm" / "metrics.json").read_text())
    assert metrics["pairwise_accuracy"] == 1.0 and metrics["evaluation_pairs"] == 20
    assert metrics["reward_gap"] > 0 and (tmp_path / "rm" / "calibration.png").is_file()
    from auto_research.rewards.reward_model import RewardModel

    reward = RewardModel(str(tmp_path / "rm"), "cpu", offline=True)
    good, bad = reward(["123=", "123="], ["123!", "123?"], [None, None])
    assert good > bad


def test_other_preference_formats_load(tmp_path, capsys):
    """Parquet, CSV, a save_to_disk folder, and TRL's conversational and implicit-prompt forms."""
    import datasets

    rows = [json.loads(line) for line in _pairs(tmp_path / "p.jsonl", 12).read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "p.csv"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]
    (tmp_path / "implicit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in implicit))
    for name, extra in (("p.parquet", []), ("p.csv", []), ("saved", []), ("chat.jsonl", []),
                        ("implicit.jsonl", ["--prompt-field", "none"])):
        code = main(["reward-model", "--dataset", str(tmp_path / name), "--output-dir", str(tmp_path / f"rm-{name}"),
                     "--steps", "2", "--device", "cpu", "--no-progress", *extra])
        assert code == 0, (name, capsys.readouterr().err)
        assert json.loads((tmp_path / f"rm-{name}" / "metrics.json").read_text())["train_pairs"] > 0


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "1=", "chosen": "a"}], "row 1 has no field 'rejected'"),
    ([], "no rows"),
    ([{"prompt": "1=", "chosen": "a", "rejected": "a"}] * 3, "0 usable pair(s)"),
])
def test_bad_preference_data_is_one_line(tmp_path, capsys, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) if rows else "")
    code = main(["reward-model", "--dataset", str(path), "--output-dir", str(tmp_path / "rm"), "--steps", "2",
                 "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.startswith("auto-research: error")]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "rm").exists() and not (tmp_path / ".rm.partial").exists()


def test_equal_sides_are_warned_about_and_left_out(tmp_path, capsys):
    path = _pairs(tmp_path / "p.jsonl", 20)
    path.write_text(path.read_text() + json.dumps({"prompt": "1=", "chosen": "x", "rejected": "x"}) + "\n")
    code = main(["reward-model", "--dataset", str(path), "--output-dir", str(tmp_path / "rm"), "--steps", "2",
                 "--device", "cpu", "--no-progress"])
    assert code == 0
    assert "1 of 21 pairs have chosen == rejected" in capsys.readouterr().err


JUDGES = '''
def raises(prompt, a, b):
    raise RuntimeError("the judge is down")

def too_sure(prompt, a, b):
    return 1.5

def first(prompt, a, b):
    return 1.0
'''


@pytest.mark.parametrize("judge, message", [("raises", "--judge my_judges:raises: raised RuntimeError: the judge is down"),
                                            ("too_sure", "returned 1.5, not a probability in [0, 1]")])
def test_a_bad_judge_is_one_line_before_training(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, capsys, judge, message):
    (tmp_path / "my_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--judge",
                 f"my_judges:{judge}", "--steps", "2", "--max-new-tokens", "3", "--offline", "--device", "cpu", "--no-progress",
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_position_biased_judge_reports_one_half(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--judge", "my_judges:first",
                 "--steps", "2", "--prompts-per-step", "2", "--max-new-tokens", "3", "--learning-rate", "1e-2",
                 "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "out" / "rloo-sums-seed42" / "metrics.json").read_text())
    assert metrics["baseline"]["win_rate"] == 0.5 and metrics["final"]["win_rate"] == 0.5


def test_a_reward_model_with_two_labels_is_refused(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    model.save_pretrained(tmp_path / "rm2")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "rm2")
    from auto_research.errors import UserError
    from auto_research.rewards.reward_model import RewardModel

    with pytest.raises(UserError, match="its head gives 2 scores per text, a reward model gives one"):
        RewardModel(str(tmp_path / "rm2"), "cpu", offline=True)


def test_preference_generate_needs_a_learned_reward(tmp_path, capsys):
    code = main(["post-train", "--dataset", "preference-generate", "--output-dir", str(tmp_path), "--offline"])
    assert code == 2
    assert "preference-generate is optimised against a learned reward model" in capsys.readouterr().err


def test_the_whole_pipeline_runs_and_reports_win_rate_and_both_rewards(tiny_model_dir, tmp_path, capsys):
    code = main(["rlhf", "--model", str(tiny_model_dir), "--pairs", "200", "--reward-model-steps", "5", "--steps", "2",
                 "--eval-every", "1", "--betas", "0.05,0.5", "--output-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = json.loads((tmp_path / "rlhf-summary.json").read_text())
    assert [run["beta"] for run in summary["runs"]] == [0.05, 0.5]
    for run in summary["runs"]:
        assert 0.0 <= run["win_rate"] <= 1.0
        assert len(run["history"]) == 3  # before, then an evaluation at steps 1 and 2
        assert all("gold_reward" in row and "mean_reward" in row for row in run["history"])
    assert 0.5 <= summary["labels"]["label_ceiling"] <= 1.0
    assert "gold win rate" in out.out and (tmp_path / "rlhf.png").is_file()
    assert (tmp_path / "reward-model" / "model.safetensors").is_file()


def test_post_train_reads_prompt_files_through_datasets(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    """Parquet and CSV prompts, and a save_to_disk folder, train like the same rows in JSONL."""
    import datasets

    rows = [json.loads(line) for line in sums_jsonl.read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "sums.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "sums-folder"))
    for source in (tmp_path / "sums.parquet", tmp_path / "sums-folder"):
        code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(source), "--steps", "1",
                     "--prompts-per-step", "2", "--max-new-tokens", "2", "--offline", "--device", "cpu",
                     "--no-progress", "--output-dir", str(tmp_path / "out")])
        assert code == 0, capsys.readouterr().err
        metrics = json.loads((tmp_path / "out" / f"rloo-{source.stem}-seed42" / "metrics.json").read_text())
        assert metrics["training"]["train_examples"] + metrics["training"]["validation_examples"] == len(rows)


def test_preference_arithmetic_judges_by_the_sum():
    """The second embedded preference task: gold is the arithmetic partial credit, its judge strict."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.data.tasks import load_task

    config = GenerationConfig(dataset="preference-arithmetic", reward_model="rm").filled()
    task = load_task(config.data)
    example = task.evaluation[0]  # the answer is the sum written least-significant digit first
    right, wrong = example.answer, "9" * len(example.answer) if example.answer != "9" * len(example.answer) else "0"
    assert task.gold([example.prompt] * 2, [right, wrong], [example] * 2)[0] == 1.0
    assert task.gold_judge(example.prompt, right, wrong, example) == 1.0
    assert task.gold_judge(example.prompt, wrong, right, example) == 0.0
    assert task.gold_judge(example.prompt, right, right, example) == 0.5
    assert task.base == "arithmetic-generate"  # it starts from the same cached warm start
