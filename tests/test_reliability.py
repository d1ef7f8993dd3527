"""What a new user's own data, mistakes and crashes used to break (issue 6), one test each.

Every bad input: one line on stderr, exit status 2, nothing half-written and no
run folder created. Every crash: the last good checkpoint kept and usable.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from auto_research.cli import main
from conftest import run_cli

# --- silently wrong results ------------------------------------------------------------


TEXTS = ["Q: what is 4+5? A:", "47+38=", "  Two  spaces,\ttabs\nand CAPITALS!", "héllo ✓ 日本語", "~`{}[]<>\\\"'"]


def test_embedded_tokenizer_round_trips_any_text_through_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    from auto_research.engine.tiny import BYTE_OFFSET, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == [BYTE_OFFSET + byte for byte in text.encode("utf-8")], text
        assert reloaded(text, add_special_tokens=False)["input_ids"] == ids, text
        for decoder in (tokenizer, reloaded):
            assert decoder.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    # Every printable ASCII character is its own token: nothing maps to <unk>.
    printable = "".join(chr(code) for code in range(32, 127))
    assert tokenizer.unk_token_id not in reloaded(printable, add_special_tokens=False)["input_ids"]


def test_sft_model_scores_the_same_after_saving(tmp_path, capsys):
    # Prompts with capitals, spaces and '?': the saved model must see them as training did.
    rows = [{"prompt": f"Q: What is {a}+{b}? A:", "answer": str(a + b)} for a in range(5) for b in range(5)]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["sft", "--dataset", str(path), "--steps", "60", "--batch-size", "16", "--learning-rate", "3e-3",
                 "--device", "cpu", "--output-dir", str(tmp_path / "model")]) == 0
    printed = float(capsys.readouterr().out.splitlines()[-2].split()[-1])

    from auto_research.config.generation import GenerationConfig
    from auto_research.train.evaluation import greedy_accuracy
    from auto_research.engine.models import load_policy
    from auto_research.data.tasks import load_task

    model, tokenizer = load_policy(str(tmp_path / "model"), "cpu", None, offline=True)
    task = load_task(GenerationConfig(dataset=str(path)).filled().data)
    assert greedy_accuracy(model, tokenizer, task, 128) == printed


@pytest.mark.parametrize("row, message", [
    ({"prompt": None, "answer": "1"}, "rows.jsonl:2: field 'prompt' is null"),
    # A list is read as a conversation (TRL's format), so a list of plain strings is a malformed one.
    ({"prompt": ["a", "b"], "answer": "1"}, "rows.jsonl:2: field 'prompt' message 0 is \"a\""),
    ({"prompt": 12, "answer": "1"}, "rows.jsonl:2: field 'prompt' is a number"),
    ({"prompt": "1+1=", "answer": None}, "rows.jsonl:2: field 'answer' is null, expected text or a number"),
    ({"prompt": "1+1=", "answer": [2]}, "rows.jsonl:2: field 'answer' is a list"),
])
def test_jsonl_values_that_are_not_text_are_refused_with_the_line(tiny_model_dir, tmp_path, capsys, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(path), "--offline", "--device", "cpu",
                 "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_numeric_answers_are_converted_to_text():
    import tempfile
    from pathlib import Path

    from auto_research.data.tasks import jsonl_task

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "numbers.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": value}) + "\n"
                                for i, value in enumerate([2, 3.5, "4", 5])))
        task = jsonl_task(path, "prompt", "answer", evaluation_examples=1)
    assert [example.answer for example in task.train + task.evaluation] == ["2", "3.5", "4", "5"]


REWARDS = '''
import math

def never(prompts, completions, rows):
    return [None for _ in completions]

def half_none(prompts, completions, rows):
    return [None if i % 2 else 1.0 for i in range(len(completions))]

def raises(prompts, completions, rows):
    raise KeyError("solution")

def generator(prompts, completions, rows):
    return (1.0 for _ in completions)

def numpy_scores(prompts, completions, rows):
    import numpy
    return numpy.ones(len(completions), dtype=numpy.float32)

def none_after_first_step(prompts, completions, rows):
    none_after_first_step.calls = getattr(none_after_first_step, "calls", 0) + 1
    # call 1: evaluation before training; 2: step 1; from 3 on (step 2) nothing is scored
    return [float(len(c)) if none_after_first_step.calls < 3 else None for c in completions]
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_rewards", None)
    return "user_rewards"


def _run(tiny_model_dir, dataset, output, *flags):
    return main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(dataset), "--steps", "4",
                 "--prompts-per-step", "2", "--max-new-tokens", "3", "--evaluation-examples", "4", "--eval-every", "0",
                 "--checkpoint-every", "1", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(output),
                 *flags])


def test_a_reward_that_scores_nothing_stops_before_anything_is_written(tiny_model_dir, sums_jsonl, tmp_path, rewards, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "out", "--reward", f"{rewards}:never") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("auto-research: error: no sample of step 1 could be scored")
    assert not (tmp_path / "out").exists()


def test_a_step_with_no_scored_sample_mid_run_saves_the_last_good_step(tiny_model_dir, sums_jsonl, tmp_path, rewards, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--reward", f"{rewards}:none_after_first_step") == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no sample of step 2 could be scored" in error and "saved the last good step (1)" in error


def test_unscored_samples_warn_once_and_metrics_stay_valid_json(tiny_model_dir, sums_jsonl, tmp_path, rewards, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--reward", f"{rewards}:half_none") == 0
    err = capsys.readouterr().err
    assert err.count("warning: the reward returned None for 4 of 8 samples at step 1") == 1
    assert "warning: 16 samples of this run could not be scored" in err
    lines = (tmp_path / "rloo-sums-seed42" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl")) for line in lines]
    assert [row["unscored_samples"] for row in rows] == [4, 4, 4, 4]


def test_non_finite_figures_are_written_as_null(tmp_path):
    from auto_research.train.metrics import MetricsLog

    MetricsLog(tmp_path).append({"step": 1, "reward_std": math.nan, "kl": math.inf, "loss": 0.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward_std": None, "kl": None, "loss": 0.5}


def test_maximum_examples_applies_at_the_generation_level_and_overreach_is_refused(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    from auto_research.config.generation import GenerationConfig
    from auto_research.data.tasks import load_task

    assert len(load_task(GenerationConfig(maximum_examples=100).filled().data).train) == 100
    assert len(load_task(GenerationConfig().filled().data).train) == 9150
    # sums.jsonl: 36 rows, 7 held out, 29 to train on.
    for flags, message in ((["--maximum-examples", "30"], "--maximum-examples 30: sums has 29 training prompts"),
                           (["--prompts-per-step", "100000"], "--prompts-per-step 100000: a step draws distinct prompts, "
                                                              "and sums has 29 training prompts"),
                           (["--evaluation-examples", "36"], "--evaluation-examples 36: "),
                           (["--prompt-field", "q", "--dataset", "arithmetic-generate"], "--prompt-field applies to .jsonl")):
        code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--offline",
                     "--device", "cpu", "--output-dir", str(tmp_path / "out"), *flags])
        assert code == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


# --- lost work ---------------------------------------------------------------------------


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _checkpoints(run_dir):
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir() if path.name.startswith("step-"))


def test_running_again_refuses_to_delete_an_earlier_run_unless_overwrite(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path) == 0
    run_dir = tmp_path / "rloo-sums-seed42"
    before = _checkpoints(run_dir)
    capsys.readouterr()
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "2") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"{run_dir} holds an earlier run (checkpoints up to step-000004)" in error and "--overwrite" in error
    assert _checkpoints(run_dir) == before
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "2", "--overwrite") == 0
    assert _checkpoints(run_dir) == ["step-000001", "step-000002"]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--resume", "--overwrite") == 2
    assert "choose one" in capsys.readouterr().err


SLOW = '''
import time

def slow(prompts, completions, rows):
    time.sleep(0.3)
    return [float(len(c)) for c in completions]
'''


def test_sigterm_saves_a_checkpoint_like_ctrl_c(tiny_model_dir, sums_jsonl, tmp_path):
    (tmp_path / "slow_reward.py").write_text(SLOW)
    args = [sys.executable, "-m", "auto_research", "post-train", "--model", str(tiny_model_dir), "--dataset",
            str(sums_jsonl), "--steps", "50", "--prompts-per-step", "2", "--max-new-tokens", "3",
            "--evaluation-examples", "4", "--eval-every", "0", "--checkpoint-every", "100", "--offline", "--device",
            "cpu", "--no-progress", "--reward", "slow_reward:slow", "--output-dir", str(tmp_path / "out")]
    # No PYTHONPATH: a reward module in the working directory is found, as users expect.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    process = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "out" / "rloo-sums-seed42"
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "metrics.jsonl").is_file() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    assert "SIGTERM: finishing this step" in stderr and "checkpoint saved" in stderr
    assert "Traceback" not in stderr
    assert len(_checkpoints(run_dir)) == 1


def test_resume_skips_a_damaged_checkpoint_and_names_the_bad_file(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    from auto_research.engine.run_folder import checkpoint_problem

    from safetensors.torch import load_file

    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "whole", "--steps", "3") == 0
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "cut", "--steps", "3") == 0
    run_dir = tmp_path / "cut" / "rloo-sums-seed42"
    newest = run_dir / "checkpoints" / "step-000003"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    assert "model.safetensors has" in checkpoint_problem(newest) and "truncated" in checkpoint_problem(newest)
    capsys.readouterr()
    # Step 3 is done again from step 2 (the older, good checkpoint), ending as the unbroken run did.
    code = _run(tiny_model_dir, sums_jsonl, tmp_path / "cut", "--resume", "--steps", "3")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning: --resume skips 1 damaged checkpoint(s)" in err and "resuming from step-000002" in err
    expected = load_file(str(tmp_path / "whole" / "rloo-sums-seed42" / "checkpoints" / "step-000003" / "model.safetensors"))
    got = load_file(str(weights))
    assert all(torch_equal(expected[name], got[name]) for name in expected)
    # Every checkpoint damaged (one byte changed, same size): one line naming the newest one's bad file.
    for folder in (run_dir / "checkpoints").iterdir():
        state = folder / "optimizer.json"
        text = state.read_text()
        state.write_text(text.replace("0", "1", 1))
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "cut", "--resume", "--steps", "3") == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "no checkpoint" in error and "optimizer.json does not match its checksum" in error


def test_a_full_disk_is_one_line_and_keeps_the_last_good_checkpoint(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, capsys):
    from auto_research.engine import checkpoint, run_folder

    real = checkpoint.write_manifest
    calls = []

    def full_after_two(folder):
        calls.append(folder)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(folder)

    monkeypatch.setattr(checkpoint, "write_manifest", full_after_two)
    assert _run(tiny_model_dir, sums_jsonl, tmp_path) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    error = lines[-1]
    run_dir = tmp_path / "rloo-sums-seed42"
    assert error.startswith("auto-research: error: cannot write to") and "Traceback" not in "\n".join(lines)
    assert "No space left on device" in error and f"the last good checkpoint is {run_dir / 'checkpoints' / 'step-000002'}" in error
    assert _checkpoints(run_dir) == ["step-000001", "step-000002"]
    assert run_folder.checkpoint_problem(run_dir / "checkpoints" / "step-000002") is None
    assert not [path for path in (run_dir / "checkpoints").iterdir() if path.name.startswith(".")]
    # Full from the first checkpoint: nothing resumable, and the figures so far are kept (a failure never deletes
    # them; a later run is told to start afresh with --overwrite).
    calls.extend([None, None])
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "first") == 2
    assert "no checkpoint had been saved yet" in capsys.readouterr().err
    first = tmp_path / "first" / "rloo-sums-seed42"
    assert [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not [path for path in (first / "checkpoints").iterdir()]


# --- tracebacks where one line belongs -------------------------------------------------------


@pytest.mark.parametrize("function, message", [
    ("raises", "reward 'user_rewards:raises' raised KeyError: 'solution'"),
    ("generator", "reward 'user_rewards:generator' returned generator, not a list"),
])
def test_a_reward_that_fails_is_one_line_and_leaves_no_folder(tiny_model_dir, sums_jsonl, tmp_path, rewards, capsys,
                                                              function, message):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "out", "--reward", f"{rewards}:{function}") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("auto-research: error: ") and message in lines[-1], lines
    assert "Traceback" not in "\n".join(lines)
    assert not (tmp_path / "out").exists()


def test_reward_arrays_are_accepted(tiny_model_dir, sums_jsonl, tmp_path, rewards):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--reward", f"{rewards}:numpy_scores", "--steps", "1") == 0


@pytest.mark.parametrize("source, message", [
    ("def score(prompts, completions, rows)\n    return []\n", "syntax error in"),
    ("import no_such_dependency_xyz\n", "broken_reward.py failed (ModuleNotFoundError: No module named "
                                        "'no_such_dependency_xyz')"),
    ("raise RuntimeError('needs an API key')\n", "broken_reward.py failed (RuntimeError: needs an API key)"),
])
def test_a_reward_module_that_cannot_be_imported_is_one_line(tiny_model_dir, sums_jsonl, tmp_path, source, message):
    (tmp_path / "broken_reward.py").write_text(source)
    result = run_cli("post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--offline",
                     "--reward", "broken_reward:score", "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_garbage_weights_in_a_model_folder_are_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    code = main(["post-train", "--model", str(broken), "--dataset", str(sums_jsonl), "--offline", "--device", "cpu",
                 "--output-dir", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines[-1].startswith(f"auto-research: error: --model {broken}: cannot load (")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_utf8_names_the_line(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(path), "--offline",
                 "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert f"{path}:2: not UTF-8 text (byte 0xe9 at column 16)" in capsys.readouterr().err


@pytest.mark.parametrize("train, message", [
    ("", "train.jsonl has no rows"),
    ('{"question": "q", "answer": "no final answer"}\n' * 3, "has no row with a '#### <number>' final answer"),
    ('{"question": 7, "answer": "#### 7"}\n', "train.jsonl:1: field 'question' is a number"),
])
@pytest.mark.parametrize("dataset", ["gsm8k-candidate", "gsm8k-generate"])
def test_unusable_gsm8k_files_are_one_line(tiny_model_dir, tmp_path, capsys, train, message, dataset):
    folder = tmp_path / "data" / "gsm8k"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text(train)
    (folder / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n' * 40)
    model = ["--model", str(tiny_model_dir)] if dataset == "gsm8k-generate" else []
    code = main(["post-train", "--dataset", dataset, *model, "--offline", "--dataset-dir", str(tmp_path / "data"),
                 "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and message in error, error
    assert not (tmp_path / "out").exists()


def test_gsm8k_gold_numbers_of_a_million_and_more_are_kept_whole(tmp_path):
    from auto_research.rewards.verifiers import is_correct
    from auto_research.data.tasks import gsm8k_task

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    rows = [{"question": "How many?", "answer": "So 1,450,000.\n#### 1450000"}, {"question": "q", "answer": "#### 2.5"}]
    for name in ("train.jsonl", "test.jsonl"):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = gsm8k_task(tmp_path, offline=True, maximum_examples=None, evaluation_examples=None)
    assert [example.answer for example in task.train] == ["1450000", "2.5"]
    assert is_correct("gsm8k", "It is 1,450,000", task.train[0]) and not is_correct("gsm8k", "6", task.train[0])


def test_device_names_are_checked(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--device", "tpu",
                 "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert "--device 'tpu': choose auto, cpu, cuda, cuda:N or mps" in capsys.readouterr().err


def test_a_huge_candidate_learning_rate_runs_or_says_why_not(tmp_path, capsys):
    # The softmax underflows to exact zeros; drawing K distinct candidates must still work.
    assert main(["post-train", "--learning-rate", "1000", "--output-dir", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "rloo-arithmetic-smoke-seed42" / "metrics.json").read_text())
    assert all(math.isfinite(value) for value in metrics["final"].values())
    capsys.readouterr()
    # PPO's critic shares the step size and diverges: refused with the reason, nothing written.
    assert main(["post-train", "--algorithm", "ppo-rlhf", "--learning-rate", "1000", "--output-dir", str(tmp_path / "ppo")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "ppo-rlhf diverged at step" in captured.err and "critic" in captured.err
    assert not (tmp_path / "ppo").exists()


def test_draws_without_replacement_follow_the_renormalised_softmax():
    import numpy as np

    from auto_research.candidate.trainer import draw_without_replacement, softmax

    logits = np.array([2000.0, 1000.0, 500.0, -5.0, -5.0, -1e6])  # softmax: [1, 0, 0, 0, 0, 0] in float64
    rng = np.random.default_rng(0)
    draws = np.array([draw_without_replacement(rng, logits, softmax(logits), 4) for _ in range(2000)])
    # The first three are forced; the fourth is −5 or −5 (equally likely), never −1e6.
    assert (draws[:, :3] == [0, 1, 2]).all()
    assert set(draws[:, 3]) == {3, 4} and abs(np.mean(draws[:, 3] == 3) - 0.5) < 0.05
    # Where π is positive everywhere, the draw is numpy's own, so the protocol's figures stay put.
    usual = np.array([0.5, 1.0, -0.5, 0.0, 0.2, 0.1])
    assert (draw_without_replacement(np.random.default_rng(3), usual, softmax(usual), 4)
            == np.random.default_rng(3).choice(6, size=4, replace=False, p=softmax(usual))).all()


# --- small things a user notices ---------------------------------------------------------------


def test_outputs_respect_the_umask(tiny_model_dir, sums_jsonl, tmp_path):
    previous = os.umask(0o022)
    try:
        assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "1") == 0
    finally:
        os.umask(previous)
    run_dir = tmp_path / "rloo-sums-seed42"
    checkpoint = run_dir / "checkpoints" / "step-000001"
    for path in [run_dir / "metrics.json", run_dir / "report.md", run_dir / "curves.png", run_dir / "metrics.jsonl",
                 *checkpoint.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o755


@pytest.mark.parametrize("flags, message", [
    (["--device", "tpu"], "--device 'tpu'"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--dataset", "no-such.jsonl"], "dataset file not found: no-such.jsonl"),
    (["--maximum-examples", "99999"], "--maximum-examples 99999: arithmetic-generate has 9150 training prompts"),
])
def test_generation_flags_are_checked_before_torch_is_imported(tiny_model_dir, tmp_path, flags, message):
    flags = ["--model", str(tiny_model_dir), *flags]
    code = (
        "import sys\n"
        "from auto_research.cli import main\n"
        f"assert main(['post-train', '--dataset', 'arithmetic-generate', *{flags!r}, '--output-dir', {str(tmp_path)!r}]) == 2\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert message in result.stderr


def test_progress_without_a_terminal_is_plain_lines(tiny_model_dir, sums_jsonl, tmp_path):
    result = run_cli("post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "40",
                     "--prompts-per-step", "2", "--max-new-tokens", "2", "--evaluation-examples", "2", "--eval-every",
                     "0", "--checkpoint-every", "0", "--offline", "--device", "cpu", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("rloo on sums: ")]
    # One line every 40 // 20 = 2 steps.
    assert [line.split()[3] for line in lines] == [f"{step}/40" for step in range(2, 41, 2)]
    assert "reward " in lines[-1] and "kl " in lines[-1]


@pytest.mark.parametrize("args, message", [
    (["sft", "--dataset", "arithmetic-smoke"], "arithmetic-smoke is a candidate-level dataset (no text to generate)"),
    (["post-train", "--dataset", "rows.txt", "--model", "m"], "--dataset rows.txt: a data file must be .jsonl (JSON Lines)"),
    (["post-train", "--dataset", "rows.txt"], "--dataset rows.txt: a data file must be .jsonl (JSON Lines)"),
    (["post-train", "--dataset", "sums.jsonl"], "--model is required for sums.jsonl"),
])
def test_messages_say_what_is_wrong(tmp_path, capsys, args, message):
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_help_texts_list_only_what_the_command_takes(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    compare = capsys.readouterr().out
    # compare now runs both levels: what its help lists, it takes (tests/test_lm_core.py runs it on a .jsonl).
    assert "gsm8k-candidate" in compare and "arithmetic-generate" in compare and "--ppo-epochs" in compare
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    # Every flag has a help text: argparse prints it after the flag (two spaces apart) or on the next line.
    lines = capsys.readouterr().out.splitlines()
    flags = [index for index, line in enumerate(lines) if line.startswith("  --")]
    assert len(flags) >= 15
    for index in flags:
        line = lines[index]
        assert "  " in line.strip() or lines[index + 1].startswith(" " * 10), line


def test_the_report_says_before_and_after_and_names_the_model(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "1") == 0
    out = capsys.readouterr().out
    assert f"model: {tiny_model_dir}" in out and "before       after" in out and "untrained" not in out
    report = (tmp_path / "rloo-sums-seed42" / "report.md").read_text()
    assert f"Model: {tiny_model_dir}" in report and "| metric | before | after |" in report


# --- one writer per run folder (issue 13) --------------------------------------------------------------


@pytest.mark.parametrize("flag", [None, "--resume", "--overwrite"])
def test_a_run_folder_in_use_is_refused_in_one_line_before_anything_is_touched(tiny_model_dir, sums_jsonl, tmp_path,
                                                                                capsys, flag):
    from auto_research.locks import FolderLock

    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "2") == 0
    run_dir = tmp_path / "rloo-sums-seed42"
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    capsys.readouterr()
    with FolderLock(run_dir):  # a live run of this very process: flock locks open files, not processes
        code = _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "3", *([flag] if flag else []))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and f"{run_dir} is in use by another run (host " in lines[0], lines
    assert f"PID {os.getpid()}, since " in lines[0]
    # Nothing read into, deleted or written: every file as it was, and no lock file left behind.
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before


def test_every_command_refuses_a_folder_in_use(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    from auto_research import GenerationConfig, post_train
    from auto_research.errors import UserError
    from auto_research.locks import FolderLock

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "p", "chosen": f"a{i}", "rejected": f"b{i}"}) + "\n" for i in range(4)))
    commands = {
        "sft": (["sft", "--dataset", str(sums_jsonl), "--steps", "1", "--output-dir", str(tmp_path / "sft")],
                tmp_path / "sft"),
        "reward-model": (["reward-model", "--dataset", str(pairs), "--steps", "1", "--output-dir", str(tmp_path / "rm")],
                         tmp_path / "rm"),
        "rlhf": (["rlhf", "--output-dir", str(tmp_path / "rlhf")], tmp_path / "rlhf"),
        "compare": (["compare", "--dataset", str(sums_jsonl), "--model", str(tiny_model_dir), "--algorithms", "rloo",
                     "--offline", "--output-dir", str(tmp_path / "cmp")], tmp_path / "cmp" / "rloo-sums-seed42"),
        "candidate": (["post-train", "--output-dir", str(tmp_path / "cand")],
                      tmp_path / "cand" / "rloo-arithmetic-smoke-seed42"),
    }
    for name, (args, folder) in commands.items():
        with FolderLock(folder):
            assert main(args) == 2, name
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"{folder} is in use by another " in error[0], (name, error)
        assert list(folder.iterdir()) == [], name  # nothing was made there (the lock file went with the lock)
    config = GenerationConfig(model=str(tiny_model_dir), offline=True, device="cpu", progress=False, output_dir=tmp_path)
    with FolderLock(tmp_path / "rloo-sums-seed42"):
        with pytest.raises(UserError, match="rloo-sums-seed42 is in use by another run"):
            post_train(str(sums_jsonl), config=config, steps=1)


def test_a_filesystem_that_cannot_lock_warns_once_and_the_run_goes_on(tiny_model_dir, sums_jsonl, tmp_path, capsys,
                                                                      monkeypatch):
    import fcntl

    from auto_research import locks

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(locks, "_warned", False)
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--steps", "1") == 0
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "again", "--steps", "1") == 0
    err = capsys.readouterr().err
    assert err.count("filesystem cannot lock (No locks available); nothing stops a second run") == 1


def test_a_run_folder_that_is_not_writable_is_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "rloo-sums-seed42"
    run_dir.mkdir()
    # (Tests may run as root, for whom no mode bit denies a write: the check is made through os.access.)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(run_dir) else real(path, mode))
    assert _run(tiny_model_dir, sums_jsonl, tmp_path) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"auto-research: error: cannot write to {run_dir}: no permission (the run folder must be writable)"]


VANDALS = '''
import shutil
from pathlib import Path

RUN = Path(__file__).parent / "out" / "rloo-sums-seed42"

def deletes_the_run_folder(prompts, completions, rows):
    deletes_the_run_folder.calls = getattr(deletes_the_run_folder, "calls", 0) + 1
    if deletes_the_run_folder.calls == 3:  # the baseline evaluation, step 1, then during step 2
        shutil.rmtree(RUN)
    return [float(len(c)) for c in completions]

def replaces_checkpoints_with_a_file(prompts, completions, rows):
    replaces_checkpoints_with_a_file.calls = getattr(replaces_checkpoints_with_a_file, "calls", 0) + 1
    if replaces_checkpoints_with_a_file.calls == 3:
        shutil.rmtree(RUN / "checkpoints")
        (RUN / "checkpoints").write_text("not a folder")
    return [float(len(c)) for c in completions]
'''


@pytest.mark.parametrize("vandal, message", [
    ("deletes_the_run_folder", "rloo-sums-seed42 was deleted or replaced while the run was running; stopped without "
                               "writing anything more"),
    ("replaces_checkpoints_with_a_file", "checkpoints is not a folder any more (something replaced it while the run "
                                         "was live): stopped without writing"),
])
def test_a_run_folder_damaged_while_the_run_is_live_stops_it_in_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys,
                                                                        monkeypatch, vandal, message):
    (tmp_path / "vandals.py").write_text(VANDALS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("vandals", None)
    assert _run(tiny_model_dir, sums_jsonl, tmp_path / "out", "--reward", f"vandals:{vandal}") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("auto-research: error: ") and message in lines[-1], lines
    assert "Traceback" not in "\n".join(lines)
    # Not made again by a later write (and, with nothing resumable left, the folder the run created is removed).
    assert not (tmp_path / "out" / "rloo-sums-seed42" / "checkpoints").is_dir()


def test_checkpoints_that_are_a_file_are_one_line_on_resume(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    run_dir = tmp_path / "rloo-sums-seed42"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--resume") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"auto-research: error: --resume: {run_dir / 'checkpoints'} is a file, not a folder of checkpoints"]


def test_a_server_gone_while_a_checkpoint_reads_the_rollout_side_names_the_last_good_one(tiny_model_dir, sums_jsonl,
                                                                                        tmp_path, monkeypatch, capsys):
    """A checkpoint reads the rollout side's batches (and a rollout server's state) before it writes anything: an
    engine gone then is the same one line as a server gone mid-step, naming the checkpoint to resume from."""
    from auto_research.errors import RolloutEngineError
    from auto_research.train.in_flight import InFlight

    real, calls = InFlight.checkpoint, []

    def gone_at_the_second(self, step):
        calls.append(step)
        if len(calls) == 2:
            raise RolloutEngineError("rollout server 127.0.0.1:9 is gone")
        return real(self, step)

    monkeypatch.setattr(InFlight, "checkpoint", gone_at_the_second)
    assert _run(tiny_model_dir, sums_jsonl, tmp_path, "--max-staleness", "1") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    run_dir = tmp_path / "rloo-sums-seed42"
    assert lines[-1] == (f"auto-research: error: rollout server 127.0.0.1:9 is gone; the last good checkpoint is "
                         f"{run_dir / 'checkpoints' / 'step-000001'} (continue with the same command and --resume)")
    assert calls == [1, 2] and _checkpoints(run_dir) == ["step-000001"]
