"""Generation-level datasets, rewards and the sft command."""

from __future__ import annotations

import json

import pytest

from auto_research.cli import main
from auto_research.data import tasks
from auto_research.errors import RewardError
from auto_research.rewards.combine import CombinedReward
from auto_research.rewards.verifiers import arithmetic_reward, final_number, format_reward, is_correct


def test_arithmetic_task_split_is_fixed_and_disjoint():
    task = tasks.arithmetic_task()
    assert (len(task.evaluation), len(task.demonstrations), len(task.train)) == (500, 350, 9150)
    prompts = [e.prompt for e in task.evaluation + task.demonstrations + task.train]
    assert len(set(prompts)) == 10_000
    example = task.train[0]
    a, b = example.fields["a"], example.fields["b"]
    assert example.prompt == f"{a}+{b}=" and example.answer == str(a + b)[::-1]
    assert tasks.arithmetic_task().train[:5] == task.train[:5]


def test_arithmetic_reward_and_exact_match_by_hand():
    example = tasks.Example("47+38=", "58")
    # exact: ½ + ½·2/2; one digit right: ½·1/2; extra digit: ½·2/3.
    assert arithmetic_reward([""] * 3, ["58", "48", "581"], [example] * 3) == [1.0, 0.25, pytest.approx(1 / 3)]
    assert is_correct("arithmetic", " 58", example) and not is_correct("arithmetic", "85", example)


def test_gsm8k_verifier_and_format_reward():
    example = tasks.Example("q", "72")
    assert final_number("so 48 + 24 = 72 clips") == 72.0
    assert final_number("#### 1,234") == 1234.0
    assert is_correct("gsm8k", "She sold 72.", example)
    assert not is_correct("gsm8k", "72 then 73", example)
    assert format_reward([""] * 2, ["answer: 5", "no idea"], [example] * 2) == [1.0, 0.0]
    assert is_correct("match", "  Paris ", tasks.Example("q", "paris"))


def test_combined_reward_weights_none_and_non_numbers():
    examples = [tasks.Example("q", "1")] * 3
    first = lambda p, c, e: [1.0, None, 0.5]  # noqa: E731
    second = lambda p, c, e: [2.0, 1.0, 1.0]  # noqa: E731
    combined = CombinedReward([("first", first, 1.0), ("second", second, 0.5)])
    assert combined(["a", "b", "c"], ["x", "y", "z"], examples) == [2.0, None, 1.0]
    broken = CombinedReward([("broken", lambda p, c, e: [1.0, "high", 0.0], 1.0)])
    with pytest.raises(RewardError, match="reward 'broken' returned 'high' for prompt 'b'"):
        broken(["a", "b", "c"], ["x", "y", "z"], examples)


def test_gsm8k_generate_reads_questions_and_gold_numbers(shared_data):
    task = tasks.gsm8k_task(shared_data, offline=True, maximum_examples=16, evaluation_examples=8)
    assert len(task.train) == 16 and len(task.evaluation) == 8
    assert task.train[0].prompt.startswith("Question: Natalia sold clips") and task.train[0].prompt.endswith("Answer:")
    assert task.train[0].answer == "72"
    assert "<<" not in task.train[0].solution and task.train[0].solution.endswith("#### 72")
    assert task.evaluation[0].answer == "18"


def test_gsm8k_prompts_longer_than_the_context_are_refused(tiny_model_dir, shared_data, tmp_path, capsys):
    code = main(["post-train", "--dataset", "gsm8k-generate", "--model", str(tiny_model_dir), "--dataset-dir",
                 str(shared_data), "--offline", "--device", "cpu", "--maximum-examples", "8", "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert "exceed the model's context of 32 tokens" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_generation_dataset_needs_a_model(tmp_path, capsys):
    assert main(["post-train", "--dataset", "gsm8k-generate", "--output-dir", str(tmp_path / "out")]) == 2
    assert "--model is required for gsm8k-generate" in capsys.readouterr().err


def test_candidate_dataset_rejects_generation_flags(tmp_path, capsys):
    assert main(["post-train", "--dataset", "arithmetic-smoke", "--temperature", "0.7", "--output-dir", str(tmp_path)]) == 2
    assert "--temperature applies to the generation level only" in capsys.readouterr().err


def test_sft_command_trains_and_saves_a_loadable_model(sums_jsonl, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    code = main(["sft", "--dataset", str(sums_jsonl), "--steps", "150", "--batch-size", "16", "--learning-rate", "3e-3",
                 "--device", "cpu", "--output-dir", str(tmp_path / "model")])
    out = capsys.readouterr().out
    assert code == 0, out
    record = json.loads((tmp_path / "model" / "sft.json").read_text())
    assert record["steps"] == 150 and record["demonstrations"] == 29  # 36 rows, the last 7 held out
    losses = [row["loss"] for row in record["history"]]
    assert losses[-1] < losses[0] / 2
    AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    # The trained model is a valid --model for post-train.
    code = main(["post-train", "--model", str(tmp_path / "model"), "--dataset", str(sums_jsonl), "--steps", "2",
                 "--max-new-tokens", "4", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "runs")])
    assert code == 0


def _reward_model_dir(tmp_path):
    """A tiny sequence-classification model whose tokenizer numbers characters differently from the policy's."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    characters = list(reversed("0123456789+-*=,.:;| abcdefghijklmnopqrstuvwxyz"))
    vocabulary = {token: index for index, token in enumerate(["<unk>", "<pad>", "</s>"] + characters)}
    core = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    config = Qwen2Config(vocab_size=len(vocabulary), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    folder = tmp_path / "reward-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model.eval(), tokenizer


def test_reward_model_rescores_decoded_text_with_its_own_tokenizer(tmp_path):
    import torch

    from auto_research.rewards.reward_model import RewardModel

    folder, model, tokenizer = _reward_model_dir(tmp_path)
    reward_model = RewardModel(str(folder), "cpu", offline=True)
    scores = reward_model(["1+2=", "30+4="], ["3", "43"], [None, None])
    with torch.no_grad():
        expected = [model(**tokenizer([text], return_tensors="pt")).logits[0, 0].item() for text in ("1+2=3", "30+4=43")]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert scores[0] != scores[1]


def test_post_train_with_a_reward_model_and_weights(tiny_model_dir, sums_jsonl, tmp_path):
    folder, _, _ = _reward_model_dir(tmp_path)
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--reward", "match",
                 "--reward-model", str(folder), "--reward-weights", "1,0.5", "--steps", "2", "--prompts-per-step", "2",
                 "--max-new-tokens", "3", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "runs")])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "runs" / "rloo-sums-seed42" / "metrics.jsonl").read_text().splitlines()]
    # The reward model's scores are real numbers, not 0/1: the mean reward is no multiple of 1/8.
    assert any(abs(row["reward_mean"] * 8 - round(row["reward_mean"] * 8)) > 1e-6 for row in rows)


def test_a_critic_of_another_vocabulary_is_refused(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    folder, _, _ = _reward_model_dir(tmp_path)  # 49 tokens; the policy has 260
    code = main(["post-train", "--algorithm", "ppo-rlhf", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl),
                 "--critic-model", str(folder), "--offline", "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert code == 2
    error = capsys.readouterr().err
    assert f"--critic-model {folder}: its vocabulary has 49 tokens, the policy's 260" in error
    assert not (tmp_path / "out").exists()
