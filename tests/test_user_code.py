"""One loader for the user's code (user_code.py): --reward, --environment, --tools, --rollout-function and --judge
each take module:name (found from the working folder) and path/file.py:name, relative or absolute, with the same
one-line errors naming the flag; a run records its code so that --config <run>/config.yaml and --resume find it
from any folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

from auto_research.config.generation import GenerationConfig
from auto_research.envs import EnvironmentFactory
from auto_research.envs.custom import load_rollout_function
from auto_research.envs.tools import load_tools
from auto_research.errors import UserError
from auto_research.rewards.gold import load_judge
from auto_research.rewards.loading import load_reward
from auto_research.rewards.verifiers import BUILT_IN
from auto_research.user_code import load_user_object, resolved_settings, resolved_spec
from conftest import run_cli

CODE = '''
def score(prompts, completions, rows):
    return [float(len(c) % 3) for c in completions]

def judge(prompt, a, b):
    return 0.5

def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b

class Echo:
    def reset(self):
        return None
    def step(self, text):
        return None, float(len(text) % 2), True

def make_env(row):
    return Echo()

def loop(rows, context):
    prompts = [context.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    ids, logprobs = context.generate(prompts, list(context.seeds))
    return [{"prompt_ids": p, "completion_ids": c, "logprobs": l, "loss_mask": [1] * len(c),
             "reward": float(len(c) % 2)} for p, c, l in zip(prompts, ids, logprobs)]

NOT_CALLABLE = 3
'''

# Each flag's own entry point, as prepare() calls it: (flag, load(spec), the name of a callable of that kind in CODE).
FLAGS = {
    "--reward": (load_reward, "score"),
    "--environment": (lambda spec: EnvironmentFactory.load(spec, {}).factory, "make_env"),
    "--tools": (lambda spec: next(iter(load_tools(spec).values())), "add"),
    "--rollout-function": (lambda spec: load_rollout_function(spec)[1], "loop"),
    "--judge": (lambda spec: load_judge(spec, None), "judge"),
}


@pytest.fixture
def code(tmp_path, monkeypatch):
    """A folder of user code (its module names unique to the test), the working folder for the test's length; the
    path and the modules the loader added are taken back after."""
    folder = tmp_path / "code"
    folder.mkdir()
    name = f"user_code_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(CODE)
    monkeypatch.chdir(folder)
    path, modules = list(sys.path), set(sys.modules)
    yield folder, name
    sys.path[:] = path
    for module in set(sys.modules) - modules:
        del sys.modules[module]


def _refused(flag: str, spec: str) -> str:
    with pytest.raises(UserError) as caught:
        FLAGS[flag][0](spec)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("flag", FLAGS)
def test_every_flag_takes_a_module_of_the_working_folder_and_a_file_relative_or_absolute(code, flag, tmp_path):
    folder, name = code
    load, attribute = FLAGS[flag]
    by_module = load(f"{name}:{attribute}")
    os.chdir(tmp_path)  # the file forms from another folder
    by_relative, by_absolute = load(f"code/{name}.py:{attribute}"), load(f"{folder / name}.py:{attribute}")
    if flag == "--judge":  # wrapped as (prompt, a, b, example): called, it answers the module's judge
        assert by_module("p", "a", "b", {}) == by_relative("p", "a", "b", {}) == 0.5
    else:  # one module, imported once, whichever form named it
        assert by_module is by_relative is by_absolute
        assert by_module.__module__ == name


@pytest.mark.parametrize("flag", FLAGS)
def test_every_flag_gets_the_same_one_line_errors_naming_it(code, flag):
    folder, name = code
    (folder / "broken_syntax.py").write_text("def f(:\n")
    (folder / "raises_at_import.py").write_text("raise RuntimeError('no database')\n")
    (folder / "imports_missing.py").write_text("import no_such_dependency_xyz\n")
    assert _refused(flag, "no_colon") == (
        f"{flag} 'no_colon': expected "
        + (f"a built-in ({', '.join(BUILT_IN)}), " if flag == "--reward" else "gold or " if flag == "--judge" else "")
        + "module:name (found from the working folder) or path/file.py:name, e.g. my_code:my_function")
    assert _refused(flag, "no_such_module_xyz:f") == (
        f"{flag} 'no_such_module_xyz:f': cannot import module 'no_such_module_xyz' (no no_such_module_xyz.py in the "
        f"working folder {folder} or on the import path)")
    assert _refused(flag, "missing/file.py:f") == f"{flag} 'missing/file.py:f': no such file {folder}/missing/file.py"
    assert _refused(flag, "broken_syntax:f") == (
        f"{flag} 'broken_syntax:f': syntax error in {folder}/broken_syntax.py:1 (invalid syntax)")
    assert _refused(flag, "broken_syntax.py:f") == (
        f"{flag} 'broken_syntax.py:f': syntax error in {folder}/broken_syntax.py:1 (invalid syntax)")
    assert _refused(flag, "raises_at_import:f") == (
        f"{flag} 'raises_at_import:f': importing raises_at_import failed (RuntimeError: no database)")
    assert _refused(flag, "imports_missing.py:f") == (
        f"{flag} 'imports_missing.py:f': importing imports_missing.py failed (ModuleNotFoundError: No module named "
        "'no_such_dependency_xyz')")
    assert _refused(flag, f"{name}:nothing") == f"{flag} '{name}:nothing': {name} has no 'nothing'"
    assert _refused(flag, f"{name}.py:NOT_CALLABLE").startswith(
        f"{flag} '{name}.py:NOT_CALLABLE': NOT_CALLABLE is int, not callable (")


def test_a_file_imports_the_modules_beside_it_and_a_package_s_file_its_relative_imports(code, tmp_path):
    folder, _ = code
    (folder / "helpers_beside.py").write_text("WEIGHT = 7\n")
    (folder / "uses_helper.py").write_text("from helpers_beside import WEIGHT\ndef f():\n    return WEIGHT\n")
    package = folder / "pkg_of_user"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "shared.py").write_text("BASE = 40\n")
    (package / "rewards.py").write_text("from .shared import BASE\ndef f():\n    return BASE + 2\n")
    os.chdir(tmp_path)
    assert load_user_object("code/uses_helper.py:f", "--reward")() == 7
    assert load_user_object(f"{package}/rewards.py:f", "--reward")() == 42
    assert load_user_object("code/pkg_of_user/rewards.py:f", "--reward").__module__ == "pkg_of_user.rewards"


def test_a_file_whose_name_another_module_holds_is_still_the_file(code, tmp_path):
    folder, _ = code
    (folder / "json.py").write_text("def f():\n    return 'mine'\n")  # the standard library's json is imported
    assert load_user_object("json.py:f", "--reward")() == "mine"
    assert json.dumps([1]) == "[1]"  # and the standard library's json is untouched


def test_a_spec_is_recorded_in_the_form_that_finds_it_from_any_folder(code):
    folder, name = code
    package = folder / "pkg_recorded"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sub.py").write_text("def f():\n    return 1\n")
    assert resolved_spec(f"{name}:score") == f"{folder}/{name}.py:score"
    assert resolved_spec("pkg_recorded.sub:f") == f"{folder}/pkg_recorded/sub.py:f"
    assert resolved_spec(f"./{name}.py:score") == f"{folder}/{name}.py:score"
    assert resolved_spec("json:dumps") == "json:dumps"  # not in the working folder: found from anywhere as it is
    assert resolved_spec("gsm8k") == "gsm8k" and resolved_spec("gold") == "gold"
    config = GenerationConfig(reward=["gsm8k", f"{name}:score"], environment=f"{name}:make_env",
                              tools=f"{name}:add, json:dumps", rollout_function=f"{name}.py:loop",
                              judge=f"{name}:judge").filled()
    here = f"{folder}/{name}.py"
    assert (config.reward, config.environment, config.tools, config.rollout_function, config.judge) == (
        ["gsm8k", f"{here}:score"], f"{here}:make_env", f"{here}:add,json:dumps", f"{here}:loop", f"{here}:judge")
    assert config.filled() == config  # recorded once: filling again changes nothing
    # A checkpoint saved before code was recorded so (its specs as typed) compares equal from the folder it ran in.
    saved = {"reward": ["gsm8k", f"{name}:score"], "tools": f"{name}:add, json:dumps", "judge": None, "steps": 3}
    assert {**saved, **resolved_settings(saved)} == {"reward": config.reward, "tools": config.tools, "judge": None,
                                                     "steps": 3}


# --- from the command line, from another working folder -----------------------------------------------------

TOOL_TEMPLATE = (
    "{%- if tools %}tools:{%- for tool in tools %} {{ tool.function.name }}{%- endfor %}\n{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}</s>\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> Path:
    """The tiny model with a small chat template that shows tools, and room for a few turns."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("tools-model")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=512).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(model: Path, data: Path, output: Path, cwd: Path, *flags: str):
    done = run_cli("post-train", "--model", str(model), "--dataset", str(data), "--steps", "1", "--prompts-per-step",
                   "1", "--group-size", "2", "--max-new-tokens", "3", "--max-turns", "2", "--evaluation-examples", "2",
                   "--offline", "--device", "cpu", "--no-progress", "--threads", "1", "--output-dir", str(output),
                   *flags, cwd=cwd, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return done


def test_each_form_of_each_flag_runs_from_the_command_line_and_the_run_resumes_from_anywhere(tools_model, sums_jsonl,
                                                                                              tmp_path):
    code, elsewhere, third = tmp_path / "code", tmp_path / "elsewhere", tmp_path / "third"
    for folder in (code, elsewhere, third):
        folder.mkdir()
    (code / "my_code.py").write_text(textwrap.dedent(CODE))
    relative, absolute = "../code/my_code.py", f"{code}/my_code.py"
    # --environment, --tools, --reward and --judge in one run; --rollout-function (with neither of the first two)
    # in its own: module:name from the folder that holds it, the file forms from another, relative and absolute.
    runs = {"module": (code, "--environment", "my_code:make_env", "--tools", "my_code:add", "--reward", "my_code:score",
                       "--judge", "my_code:judge"),
            "files": (elsewhere, "--environment", f"{relative}:make_env", "--tools", f"{absolute}:add", "--reward",
                      f"{relative}:score", "--judge", f"{absolute}:judge"),
            "files-swapped": (elsewhere, "--environment", f"{absolute}:make_env", "--tools", f"{relative}:add",
                              "--reward", f"{absolute}:score", "--judge", f"{relative}:judge"),
            "loop-module": (code, "--rollout-function", "my_code:loop"),
            "loop-relative": (elsewhere, "--rollout-function", f"{relative}:loop"),
            "loop-absolute": (elsewhere, "--rollout-function", f"{absolute}:loop")}
    for name, (cwd, *flags) in runs.items():
        _run(tools_model, sums_jsonl, tmp_path / name, cwd, *flags)
    run_dir = tmp_path / "module" / "rloo-sums-seed42"
    recorded = (run_dir / "config.yaml").read_text()
    assert f"environment: {absolute}:make_env" in recorded and "my_code:" not in recorded
    # The run's config.yaml from a third folder: the same code found, and --resume agrees it is the same run.
    again = _run(tools_model, sums_jsonl, tmp_path / "module", third, "--config", str(run_dir / "config.yaml"),
                 "--resume")
    assert "different settings" not in again.stderr


DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"


def _doc_files(text: str) -> dict[str, str]:
    """The page's files: each ```python block that starts with ``# name.py``, and its ```jsonl block."""
    files = {}
    for info, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        first = body.split("\n", 1)[0]
        if info == "jsonl":
            files["my_rows.jsonl"] = body
        elif info == "python" and re.fullmatch(r"# \w+\.py", first):
            files[first[2:]] = body
    return files


def _doc_commands(text: str) -> list[list[str]]:
    """The page's ``auto-research`` commands (indented, continued with a backslash), as arguments."""
    commands, lines = [], iter(text.splitlines())
    for line in lines:
        if line.startswith("    auto-research "):
            command = line.strip()
            while command.endswith("\\"):
                command = command[:-1] + " " + next(lines).strip()
            commands.append(shlex.split(command)[1:])
    return commands


def test_the_environments_page_s_commands_run_as_written_on_its_files(tools_model, tmp_path):
    text = DOC.read_text()
    files, commands = _doc_files(text), _doc_commands(text)
    assert set(files) == {"my_rows.jsonl", "my_envs.py", "my_tools.py", "my_rewards.py", "my_loop.py"}
    assert [command[command.index("--dataset") + 1] for command in commands] == ["my_rows.jsonl"] * 3
    folder = tmp_path / "docs"
    folder.mkdir()
    for name, body in files.items():
        (folder / name).write_text(body)
    for index, command in enumerate(commands):
        model = command.index("--model") + 1  # the page's SmolLM2 (tests/test_docs_commands.py runs it): a tiny one
        arguments = [str(tools_model) if index == model else argument for index, argument in enumerate(command)]
        done = run_cli(*arguments, "--steps", "1", "--prompts-per-step", "1", "--group-size", "2", "--max-new-tokens",
                       "3", "--evaluation-examples", "1", "--offline", "--device", "cpu", "--no-progress", "--threads",
                       "1", "--output-dir", str(tmp_path / f"run{index}"), cwd=folder, env={"OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, (command, done.stderr[-3000:])
        assert list((tmp_path / f"run{index}").glob("*/checkpoints/step-000001"))
