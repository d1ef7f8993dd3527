"""Meeting users where they are (issue 17): rewards in TRL's convention, conversational prompts, completion tables."""

from __future__ import annotations

import asyncio
import re

import pytest

from auto_research.data.tasks import rows_task
from auto_research.data.types import Example
from auto_research.engine.models import format_prompt
from auto_research.errors import UserError
from auto_research.rewards.combine import build_reward
from auto_research.rewards.loading import POSITIONAL, TRL, calling_convention, resolve_rewards


# Written the way TRL's documentation shows reward functions: completions by keyword, columns as lists, **kwargs.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def match_answer(completions, answer, **kwargs):
    return [1.0 if completion.strip() == str(gold) else 0.0 for completion, gold in zip(completions, answer)]


def think_format(completions, **kwargs):
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(r"^<think>.*?</think>", content) else 0.0 for content in contents]


def sees_everything(prompts, completions, completion_ids, difficulty, **kwargs):
    return [float(len(ids)) + level for ids, level in zip(completion_ids, difficulty)]


def ours(prompts, completions, rows):
    return [float(row["answer"] in text) for text, row in zip(completions, rows)]


def _examples(count=2):
    return [Example(f"{i}+1=", str(i + 1), fields={"prompt": f"{i}+1=", "answer": str(i + 1), "difficulty": i})
            for i in range(count)]


def _reward(*functions):
    return build_reward(resolve_rewards([], None, None, [(f.__name__, f) for f in functions]), None, None, "match")


def test_the_convention_is_read_from_the_signature():
    assert calling_convention("a", reward_len) == TRL
    assert calling_convention("b", match_answer) == TRL
    assert calling_convention("c", ours) == POSITIONAL
    assert calling_convention("d", lambda p, c, r: [0.0] * len(c)) == POSITIONAL
    assert calling_convention("e", lambda completions, answer: [0.0]) == TRL
    with pytest.raises(UserError, match=r"could be ours \(prompts, completions, rows\) or TRL's"):
        calling_convention("f", lambda prompts, completions, completion_ids: [0.0])
    with pytest.raises(UserError, match=r"reward 'g' takes \(texts\): neither our form"):
        calling_convention("g", lambda texts: [0.0])
    with pytest.raises(UserError, match="neither our form"):
        resolve_rewards([], None, None, [("g", lambda a, b: [0.0])])


def test_trl_rewards_get_keywords_columns_and_ids():
    reward = _reward(reward_len, match_answer, sees_everything, ours)
    completions = ["3", "x2 and more text here"]
    values = reward(["0+1=", "1+1="], completions, _examples(), [[5, 6], [7, 8, 9]])
    # reward_len: −|20 − len|; match_answer: exact; sees_everything: len(ids) + difficulty; ours: answer in text.
    expected = [-(20 - 1) + 0.0 + (2 + 0) + 0.0, -(21 - 20) + 0.0 + (3 + 1) + 1.0]
    assert values == pytest.approx(expected)


def test_async_rewards_are_awaited_together():
    """Each of two async rewards waits for the other to have started: run one after the other they would
    wait forever (the timeout fails the test); awaited concurrently they both finish."""
    started = {}

    async def first(completions, **kwargs):
        started["first"] = True
        await asyncio.wait_for(_until(lambda: "second" in started), 5)
        return [1.0] * len(completions)

    async def second(completions, **kwargs):
        started["second"] = True
        await asyncio.wait_for(_until(lambda: "first" in started), 5)
        return [2.0] * len(completions)

    assert _reward(first, second)(["a", "b"], ["x", "y"], _examples()) == [3.0, 3.0]


async def _until(condition):
    while not condition():
        await asyncio.sleep(0.01)


def test_conversational_rows_render_with_the_chat_template_and_reach_trl_rewards_as_messages():
    from auto_research.engine.tiny import build_tokenizer

    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    task = rows_task(enumerate([{"prompt": conversation, "answer": "4"}, {"prompt": "1+1?", "answer": "2"}], 1),
                     "rows", "rows", "rows", "prompt", "answer", evaluation_examples=1)
    example = task.train[0]
    assert example.messages == tuple(conversation) and example.prompt == "2+2?"
    tokenizer = build_tokenizer()
    with pytest.raises(UserError, match="need a model with a chat template"):
        format_prompt(tokenizer, example.messages, True)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert format_prompt(tokenizer, example.messages, True) == "<system>Be brief.<user>2+2?<assistant>"
    with pytest.raises(UserError, match="drop --no-chat-template"):
        format_prompt(tokenizer, example.messages, False)
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0]

    _reward(spy)(["<rendered>"], ["4"], [example])
    assert seen["prompts"] == [list(conversation)]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]
    assert _reward(think_format)(["<rendered>"], ["<think>ok</think>4"], [example]) == [1.0]
    assert _reward(think_format)(["<rendered>"], ["4"], [example]) == [0.0]


@pytest.mark.parametrize("prompt, message", [
    ([], "is an empty list"),
    ([{"role": "user"}], "message 0 is"),
    (["hello"], "message 0 is"),
    ({"role": "user", "content": "x"}, "expected text"),
])
def test_a_malformed_conversation_is_one_line_naming_the_row(prompt, message):
    with pytest.raises(UserError, match=message) as error:
        rows_task(enumerate([{"prompt": "ok", "answer": "1"}, {"prompt": prompt, "answer": "2"}], 1),
                  "data.jsonl", "d", "d", "prompt", "answer", evaluation_examples=1)
    assert str(error.value).startswith("data.jsonl:2:") and "\n" not in str(error.value)


def test_every_evaluation_writes_a_completion_table(tiny_model_dir, sums_jsonl, tmp_path):
    import json

    from auto_research.cli import main

    args = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "4",
            "--prompts-per-step", "2", "--max-new-tokens", "3", "--evaluation-examples", "5", "--eval-every", "2",
            "--log-completions", "3", "--offline", "--no-progress", "--output-dir", str(tmp_path)]
    assert main(args) == 0
    run_dir = tmp_path / "rloo-sums-seed42"
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 0, 0, 2, 2, 2, 4, 4, 4]
    held_out = [line for line in sums_jsonl.read_text().splitlines()][-5:][:3]
    assert [row["prompt"] for row in rows[:3]] == [json.loads(line)["prompt"] for line in held_out]
    for row in rows:
        assert row["reward"] == float(row["correct"])  # the default reward is the verifier itself
    report = (run_dir / "report.md").read_text()
    assert "## Held-out completions (greedy, step 4)" in report
    assert report.count("| ✓ |") + report.count("| ✗ |") == 3
    last = json.loads((run_dir / "metrics.json").read_text())["completions"]
    assert last["step"] == 4 and [dict(row, step=4) for row in last["rows"]] == rows[-3:]
    assert main(args[:-4] + ["--output-dir", str(tmp_path / "none"), "--log-completions", "0"]) == 0
    assert not (tmp_path / "none" / "rloo-sums-seed42" / "completions.jsonl").exists()


def test_the_run_folder_keeps_its_resolved_config_which_reruns_it(tiny_model_dir, sums_jsonl, tmp_path):
    import json

    import yaml

    from auto_research.cli import main

    args = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2",
            "--prompts-per-step", "2", "--max-new-tokens", "3", "--offline", "--no-progress", "--output-dir",
            str(tmp_path / "first"), "--seed", "7"]
    assert main(args) == 0
    saved = tmp_path / "first" / "rloo-sums-seed7" / "config.yaml"
    settings = yaml.safe_load(saved.read_text())
    assert settings["steps"] == 2 and settings["seed"] == 7 and settings["max-new-tokens"] == 3
    assert settings["temperature"] == 1.0 and "resume" not in settings  # a preset filled in; run control left out
    assert main(["post-train", "--config", str(saved), "--output-dir", str(tmp_path / "again")]) == 0
    first, again = (json.loads((tmp_path / name / "rloo-sums-seed7" / "metrics.json").read_text())
                    for name in ("first", "again"))
    assert first["final"] == again["final"] and first["history"] == again["history"]


def test_compare_and_rlhf_read_config_files_and_flags_win(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    import json

    import yaml

    from auto_research.cli import main

    # One file for compare: the generation settings and compare's own keys side by side; the flags win.
    (tmp_path / "compare.yaml").write_text(f"model: {tiny_model_dir}\ndataset: {sums_jsonl}\nsteps: 2\n"
                                           "prompts-per-step: 2\nmax-new-tokens: 3\noffline: true\nprogress: false\n"
                                           "algorithms: rloo,grpo\n")
    code = main(["compare", "--config", str(tmp_path / "compare.yaml"), "--steps", "1", "--output-dir",
                 str(tmp_path / "compare")])
    assert code == 0, capsys.readouterr().err
    for name in ("rloo", "grpo"):
        metrics = json.loads((tmp_path / "compare" / f"{name}-sums-seed42" / "metrics.json").read_text())
        assert metrics["training"]["steps"] == 1  # the flag won over the file's steps: 2
        assert yaml.safe_load((tmp_path / "compare" / f"{name}-sums-seed42" / "config.yaml").read_text())[
            "max-new-tokens"] == 3
    # rlhf reads its own settings from a file: a key of another command's is named, with the nearest of its own.
    (tmp_path / "rlhf.yaml").write_text("pairs: 8\nreward-model-steps: 5\nstep: 3\n")
    capsys.readouterr()
    assert main(["rlhf", "--config", str(tmp_path / "rlhf.yaml"), "--output-dir", str(tmp_path / "rlhf")]) == 2
    assert capsys.readouterr().err.strip() == (f"auto-research: error: --config {tmp_path / 'rlhf.yaml'}: unknown key "
                                               "'step'; did you mean steps?")


@pytest.mark.parametrize("text, message", [
    ("learning-rat: 0.1\n", "unknown key 'learning-rat'; did you mean learning-rate?"),
    ("steps: many\n", "steps must be an integer, got \"many\""),
    ("temperature: [1.0\n", "not valid YAML at line 2, column 1 (expected ',' or ']', but got '<stream end>')"),
    ("- steps\n", "expected a mapping of settings (key: value), got list"),
])
def test_a_bad_config_file_is_one_line(text, message, tmp_path, capsys):
    from auto_research.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["post-train", "--config", str(path), "--output-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip() == f"auto-research: error: --config {path}: {message}"
    assert not (tmp_path / "runs").exists()
