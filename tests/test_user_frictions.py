"""What still tripped a TRL user on a second afternoon (issue 53, items 1, 2, 3, 4, 6, 8 and 9), each answered as
the user expected, or refused in one line that names the way: a run extended by --resume --steps keeps a warmup
derived from its steps; a reward's missing column is found before torch; a reward that raises names the user's own
frame (--verbose: the traceback); TRL's script keys and a mistyped flag's nearest; --tools on the plain packaged
model names the one with tools; --no-progress with --log-every prints its lines and the phases before training;
a reward given from Python is named in config.yaml, or refused on a rerun with what to do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from auto_research.cli import build_parser, main
from auto_research.cli.commands import _levels
from auto_research.config.generation import GenerationConfig

SMALL = ("--prompts-per-step", "2", "--max-new-tokens", "2", "--evaluation-examples", "2", "--offline", "--device",
         "cpu")


def _lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()


# --- 1: --resume --steps on a named dataset, whose preset's warmup is a tenth of the steps --------------------------


def test_resume_with_more_steps_keeps_the_warmup_derived_from_the_steps(tiny_model_dir, tmp_path, capsys):
    run = ["post-train", "--dataset", "arithmetic-generate", "--model", str(tiny_model_dir), "--group-size", "2",
           "--eval-every", "0", "--no-progress", *SMALL, "--output-dir", str(tmp_path)]
    assert main([*run, "--steps", "20"]) == 0  # the preset's warmup: min(10, 20 // 10) = 2
    capsys.readouterr()
    assert main([*run, "--steps", "30", "--resume"]) == 0, capsys.readouterr().err
    assert "--resume: keeps the run's warmup_steps 2 (derived from its --steps, not given)" in _lines(capsys)
    folder = tmp_path / "rloo-arithmetic-generate-seed42"
    state = json.loads((folder / "checkpoints" / "step-000030" / "trainer_state.json").read_text())
    assert state["config"]["warmup_steps"] == 2 and state["config"]["steps"] == 30
    # A warmup given, and changed, is refused in one line that says how to resume.
    assert main([*run, "--steps", "40", "--resume", "--warmup-steps", "4"]) == 2
    assert _lines(capsys)[-1] == (
        f"auto-research: error: --resume: the run in {folder} was started with different settings: warmup_steps "
        "(was 2, now 4); resume with its own (--warmup-steps 2), or start a new run (--overwrite, or another "
        "--run-name)")


# --- 2: a reward's keyword that names a column the data lacks ------------------------------------------------------


def test_a_rewards_missing_column_is_one_line_before_torch(tiny_model_dir, sums_jsonl, tmp_path):
    (tmp_path / "column_rewards.py").write_text(
        "def needs_solution(completions, solution, **kwargs):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    args = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--reward",
            "column_rewards:needs_solution", "--output-dir", str(tmp_path / "out"), *SMALL]
    script = (f"import sys\nfrom auto_research.cli import main\nstatus = main({args!r})\n"
              "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(status)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout.strip() == "no torch", result.stderr
    assert result.stderr.strip().splitlines() == [
        f"auto-research: error: reward '{tmp_path}/column_rewards.py:needs_solution' takes 'solution', a column sums "
        "lacks (its columns: answer): give rows with that column, or the parameter a default (solution=None)"]
    assert not (tmp_path / "out").exists()


# --- 3: a reward that raises --------------------------------------------------------------------------------------


def test_a_reward_that_raises_names_the_users_frame_and_verbose_shows_the_traceback(
        tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, capsys):
    (tmp_path / "raising_rewards_53.py").write_text(
        "def helper(row):\n"
        "    return row['solution']\n"
        "\n\n"
        "def raises(prompts, completions, rows):\n"
        "    return [float(helper(row) == c) for row, c in zip(rows, completions)]\n")
    monkeypatch.chdir(tmp_path)
    args = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--reward",
            "raising_rewards_53:raises", "--no-progress", "--output-dir", str(tmp_path / "out"), *SMALL]
    assert main(args) == 2
    lines = _lines(capsys)
    assert lines[-1].startswith(f"auto-research: error: reward '{tmp_path}/raising_rewards_53.py:raises' raised "
                                "KeyError: 'solution' (at raising_rewards_53.py:2, in helper) on a batch of"), lines
    assert "--verbose shows the traceback" in lines[-1]
    assert main([*args, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and "KeyError: 'solution'" in err
    assert f'File "{tmp_path}/raising_rewards_53.py", line 2, in helper' in err
    assert err.strip().splitlines()[-1] == lines[-1]  # the one line still ends it


# --- 4: TRL's script keys, and a mistyped flag --------------------------------------------------------------------


def test_trls_script_keys_name_the_model_and_the_dataset(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: rows.jsonl\nnum_generations: 2\n")
    args = build_parser("post-train").parse_args(["post-train", "--config", str(recipe)])
    assert _levels(args, [GenerationConfig])[0] == {"model": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": "rows.jsonl",
                                                    "group_size": 2}
    args = build_parser("post-train").parse_args(["post-train", "--model_name_or_path", "m", "--dataset-name",
                                                  "d.jsonl"])
    assert _levels(args, [GenerationConfig])[0] == {"model": "m", "dataset": "d.jsonl"}
    assert GenerationConfig.from_trl({"model_name_or_path": "m", "dataset_name": "d.jsonl"}).model == "m"


@pytest.mark.parametrize("typed, nearest", [("--num-generaions", "--num-generations"),
                                            ("--num_generaions", "--num_generations"),
                                            ("--learnig-rate=3e-6", "--learning-rate")])
def test_a_mistyped_flag_gets_the_nearest_one(capsys, typed, nearest):
    assert main(["post-train", typed, "4"]) == 2
    assert _lines(capsys) == [f"auto-research: error: unrecognized arguments: {typed} 4; did you mean {nearest}?"]


# --- 6: --tools on the plain packaged model -----------------------------------------------------------------------


def test_tools_on_the_plain_packaged_model_name_the_one_with_tools(sums_jsonl, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    (cache / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    (cache / "models" / "smollm2-135m-instruct" / "config.json").write_text("{}")  # converted before: no wheel read
    monkeypatch.setenv("AUTO_RESEARCH_CACHE", str(cache))
    (tmp_path / "tools_53.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n'
                                          '        a: first\n        b: second\n    """\n    return a + b\n')
    monkeypatch.chdir(tmp_path)
    assert main(["post-train", "--model", "smollm2-135m-instruct", "--dataset", str(sums_jsonl), "--tools",
                 "tools_53:add", "--output-dir", str(tmp_path / "out"), *SMALL]) == 2
    assert _lines(capsys) == ["auto-research: error: --tools: smollm2-135m-instruct's chat template does not show "
                              "tools to the model; --model smollm2-135m-instruct-tools is the same weights with a "
                              "template that does"]


# --- 8: --no-progress with --log-every (TRL's disable_tqdm with logging_steps), and the phases before training -----


def test_logging_steps_with_the_bar_off_prints_a_line_a_step_and_the_phases(tiny_model_dir, sums_jsonl, tmp_path,
                                                                            capsys):
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("disable_tqdm: true\nlogging_steps: 1\nmax_steps: 2\n")
    run = ["post-train", "--config", str(recipe), "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl),
           *SMALL]
    assert main([*run, "--output-dir", str(tmp_path / "logged")]) == 0
    lines = _lines(capsys)
    assert lines[0] == f"loading the model {tiny_model_dir} on cpu"
    assert lines[1] == "evaluating the starting policy on 2 held-out prompts (greedy), before training"
    assert [line.split("  ")[0] for line in lines if line.startswith("rloo on sums: ") and "(" in line] == [
        "rloo on sums: 1/2", "rloo on sums: 2/2"]
    # --no-progress alone stays quiet: no phase lines, no step lines.
    assert main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2",
                 "--no-progress", *SMALL, "--output-dir", str(tmp_path / "quiet")]) == 0
    lines = _lines(capsys)
    assert not [line for line in lines if line.startswith(("loading the model", "evaluating", "rloo on sums: 1/"))]


# --- 9: a reward given from Python, in config.yaml -----------------------------------------------------------------


def test_a_reward_from_python_is_named_in_config_yaml_or_refused_on_a_rerun(tiny_model_dir, sums_jsonl, tmp_path,
                                                                          monkeypatch, capsys):
    from auto_research import post_train

    (tmp_path / "python_rewards_53.py").write_text("def shorter(prompts, completions, rows):\n"
                                                   "    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import python_rewards_53

    config = GenerationConfig(model=str(tiny_model_dir), steps=1, prompts_per_step=2, max_new_tokens=2,
                              evaluation_examples=2, offline=True, device="cpu", progress=False)
    settings = dict(config=config, log=lambda text: None)
    post_train(str(sums_jsonl), reward=python_rewards_53.shorter, output_dir=str(tmp_path / "named"), **settings)
    saved = tmp_path / "named" / "rloo-sums-seed42" / "config.yaml"
    assert f"reward:\n- {tmp_path}/python_rewards_53.py:shorter\n" in saved.read_text()
    assert main(["post-train", "--config", str(saved), "--output-dir", str(tmp_path / "again")]) == 0
    capsys.readouterr()

    def scripted(prompts, completions, rows):
        return [0.0 for _ in completions]

    post_train(str(sums_jsonl), reward=scripted, output_dir=str(tmp_path / "unnamed"), **settings)
    saved = tmp_path / "unnamed" / "rloo-sums-seed42" / "config.yaml"
    text = saved.read_text()
    assert "reward:\n- from-python:scripted\n" in text
    assert ("# reward from-python:scripted: given from Python (post_train(reward=...)) and not importable by name, so "
            "not rerun from here: pass it again, or put it in a module and give --reward module:function\n") in text
    assert main(["post-train", "--config", str(saved), "--output-dir", str(tmp_path / "refused")]) == 2
    assert _lines(capsys) == [
        "auto-research: error: --reward from-python:scripted: this reward was a function given from Python "
        "(post_train(reward=...)) that cannot be imported by name: pass it again (post_train(reward=...)), or put it "
        "in a module and give --reward module:function"]
    # Passed again from Python, with the file's settings: it runs.
    post_train(str(sums_jsonl), reward=scripted, output_dir=str(tmp_path / "passed"),
               **{**settings, "config": GenerationConfig(**{**vars(config), "reward": ["from-python:scripted"]})})
