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


# --- data as TRL users have it: rows without answers, `messages` conversations, fields found by themselves ---

TOY_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
                "{% if add_generation_prompt %}a:{% endif %}")  # short: the tiny model's context is 32 tokens


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def chat_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with a chat template (conversations need one)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOY_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def _run(model, data, output, *extra):
    return main(["post-train", "--model", str(model), "--dataset", str(data), "--steps", "2", "--prompts-per-step",
                 "2", "--max-new-tokens", "3", "--evaluation-examples", "3", "--eval-every", "1", "--log-completions",
                 "3", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(output), *extra])


def test_rows_without_answers_train_on_a_user_reward_and_report_no_accuracy(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """A TRL-style reward-only dataset (a prompt column, no answer): the verifier's default reward is refused in one
    line; with the user's reward it runs, held-out accuracy is null and the mean reward is the user's."""
    data = _jsonl(tmp_path / "noanswer.jsonl", [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)])
    (tmp_path / "answerless_rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [float(len(text)) for text in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _run(tiny_model_dir, data, tmp_path / "refused") == 2
    error = capsys.readouterr().err.strip()
    assert error.endswith("noanswer has no answers (the first row has no 'answer' field, or --answer-field none), so "
                          "the default reward, its verifier, has nothing to compare with: give --reward "
                          "module:function, --reward-model or --reward-url (or --answer-field, or --algorithm opd "
                          "--teacher-model)"), error
    assert not (tmp_path / "refused").exists()
    assert _run(tiny_model_dir, data, tmp_path / "runs", "--reward", "answerless_rewards:length") == 0, \
        capsys.readouterr().err
    run_dir = tmp_path / "runs" / "rloo-noanswer-seed42"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["baseline"]["accuracy"] is None and metrics["final"]["accuracy"] is None
    assert metrics["relative_accuracy"] is None
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps if "reward_mean" in row] == [1, 2]
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert len(table) == 9 and all(row["answer"] is None and row["correct"] is None for row in table)
    assert all(row["reward"] == len(row["completion"]) for row in table)  # the user's reward, by hand
    final = [row for row in table if row["step"] == 2]
    assert metrics["final"]["mean_reward"] == pytest.approx(sum(row["reward"] for row in final) / 3)
    assert "No accuracy: the rows have no answers" in (run_dir / "report.md").read_text()
    # --answer-field none says so of rows that have an answer column: the verifier may not read it.
    answered = _jsonl(tmp_path / "answered.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)])
    assert _run(tiny_model_dir, answered, tmp_path / "none", "--answer-field", "none", "--reward", "match") == 2
    assert "--reward match compares completions with the rows' answers, and answered has none" in \
        capsys.readouterr().err


def test_a_messages_column_is_the_prompt_up_to_its_last_user_turn(chat_model_dir, tmp_path, capsys):
    """TRL's conversational `messages` column, found without --prompt-field: the prompt is the conversation up to
    its last user turn (the reply that follows is dropped from it, and kept as sft's demonstration)."""
    from auto_research.engine.models import format_prompt
    from transformers import AutoTokenizer

    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}+{b}="},
                          {"role": "assistant", "content": str(a + b)}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    data = _jsonl(tmp_path / "chats.jsonl", rows)
    task = tasks.jsonl_task(data, None, None, evaluation_examples=3)
    example = task.train[0]
    assert example.messages == tuple(rows[0]["messages"][:2]) and example.solution == "0" and example.answer == "0"
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    assert format_prompt(tokenizer, example.messages, True) == "s:Be brief.|u:0+0=|a:"
    assert _run(chat_model_dir, data, tmp_path / "runs") == 0, capsys.readouterr().err
    run_dir = tmp_path / "runs" / "rloo-chats-seed42"
    assert isinstance(json.loads((run_dir / "metrics.json").read_text())["final"]["accuracy"], float)
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in table[:3]] == ["3+1=", "3+2=", "3+3="]  # the held-out rows' user turns


def test_conversations_are_cut_and_continued_as_trl_reads_them(chat_model_dir):
    """A `messages` conversation ends at its last user turn (later turns dropped, the next assistant turn its reply);
    one without a user turn is refused; a `prompt` conversation ending with an assistant turn is continued, as TRL
    renders prompt-only data (continue_final_message), not closed and followed by a new turn."""
    from auto_research.engine.models import format_prompt
    from auto_research.errors import UserError
    from transformers import AutoTokenizer

    user, assistant = ({"role": role, "content": text} for role, text in (("user", "a?"), ("assistant", "b")))
    later = ({"role": "user", "content": "c?"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"})
    assert tasks.conversation_prompt("f", 1, (user, assistant) + later) == ((user, assistant) + later, None)
    assert tasks.conversation_prompt("f", 1, (user, assistant) + later[:2]) == ((user, assistant, later[0]), "d")
    with pytest.raises(UserError, match="^f:3: field 'messages' has no user message"):
        tasks.conversation_prompt("f", 3, ({"role": "system", "content": "s"}, assistant))
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    assert format_prompt(tokenizer, (user, {"role": "assistant", "content": "The answer is"}), True) == \
        "u:a?|a:The answer is"


@pytest.mark.parametrize("rows, flags, message", [
    ([{"question": "1+1=", "answer": "2"}], [],
     "rows.jsonl:1: row has no field 'prompt' (fields: question, answer); the prompt is found in 'prompt' or "
     "'messages', or name it with --prompt-field"),
    ([{"question": "1+1=", "answer": "2"}], ["--prompt-field", "query"],
     "rows.jsonl:1: row has no field 'query' (fields: question, answer); --prompt-field names the prompt's field"),
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}], [],
     "rows.jsonl:2: row has no field 'answer' (fields: prompt); the first row has an answer, so every row needs one "
     "(--answer-field none: rows without answers)"),
    ([{"prompt": "1+1="}], ["--answer-field", "gold"],
     "rows.jsonl:1: row has no field 'gold' (fields: prompt); --answer-field names the answer's field (none: rows "
     "without answers)"),
], ids=["no-prompt", "named-prompt", "answer-in-first-row-only", "named-answer"])
def test_a_missing_field_lists_the_columns_and_the_flag(tiny_model_dir, tmp_path, capsys, rows, flags, message):
    data = _jsonl(tmp_path / "rows.jsonl", rows + [{"prompt": "3+3=", "answer": "6"}] * 3)
    assert main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(data), "--offline", "--device", "cpu",
                 "--output-dir", str(tmp_path / "out"), *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"auto-research: error: {tmp_path}/{message}", lines
    assert not (tmp_path / "out").exists()
