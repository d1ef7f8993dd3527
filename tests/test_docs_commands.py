"""Every command README.md and docs/*.md show is checked against the code, so that a doc's command cannot drift
from it: each `auto-research` command's flags must be flags of its subcommand, each `python benchmarks/x.py`
command's flags must be options the script declares, and the commands that take seconds run as written."""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from auto_research.cli import SUBCOMMANDS, build_parser
from tests.conftest import REPOSITORY, run_cli

DOCUMENTS = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
INLINE = re.compile(r"`([^`\n]+)`")
PROGRAM = re.compile(r"(^|\s)(auto-research|-m auto_research)(\s|$)|(^|\s)python benchmarks/")
# Commands that take seconds (no model, no training at the generation level): run as written, from another folder.
RUN_AS_WRITTEN = {
    "auto-research post-train --algorithm rloo --dataset arithmetic-smoke",
    "auto-research post-train --help",
}


def _code_lines(text: str) -> list[str]:
    """Lines of indented and fenced code blocks, a trailing backslash joining a line to the next; and inline code."""
    lines, fenced, found = text.splitlines(), False, []
    for line in lines:
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            found.append(line.strip())
        else:
            found.extend(span for span in INLINE.findall(line))
    joined: list[str] = []
    for line in found:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line
        else:
            joined.append(line)
    return joined


def _commands(line: str) -> list[str]:
    """The commands of one code line: split at ``&&``, ``|`` and ``;``, environment settings, ``taskset -c N`` and
    a comment dropped, optional parts (``[--flag value]``) kept as flags."""
    commands = []
    for part in re.split(r"&&|\|\||;|\s\|\s", line.split("  #")[0]):
        part = part.replace("[", " ").replace("]", " ").strip()
        part = re.sub(r"^(\w+=\S*\s+)+", "", part)
        part = re.sub(r"^taskset -c \S+\s+", "", part)
        if PROGRAM.search(part) and not part.startswith(("pip ", "git ")):
            commands.append(part)
    return commands


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCUMENTS:
        for line in _code_lines(path.read_text()):
            found.extend((path.name, command) for command in _commands(line))
    return found


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _flags(words: list[str]) -> list[str]:
    return [word.split("=")[0] for word in words if word.startswith("--") and len(word) > 2]


@cache
def _options(subcommand: str) -> frozenset:
    parser = build_parser(subcommand)
    action = next(action for action in parser._actions if action.dest == "command")
    return frozenset(action.choices[subcommand]._option_string_actions)


@cache
def _benchmark_options(script: str) -> frozenset:
    source = (REPOSITORY / script).read_text()
    return frozenset(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source) + ["--help"])


def _problems(command: str) -> list[str]:
    words = _words(command)
    if "python" in words and any(word.startswith("benchmarks/") for word in words):
        script = next(word for word in words if word.startswith("benchmarks/"))
        if not (REPOSITORY / script).is_file():
            return [f"{script} does not exist"]
        known = _benchmark_options(script)
        return [f"{script} has no {flag}" for flag in _flags(words) if flag not in known]
    start = next(index for index, word in enumerate(words) if word in ("auto-research", "auto_research")) + 1
    rest = words[start:]
    subcommand = next((word for word in rest if not word.startswith("-")), None)
    if subcommand is None or subcommand not in SUBCOMMANDS:
        return [] if subcommand is None or not rest or rest[0].startswith("-") else [f"no subcommand {subcommand!r}"]
    known = _options(subcommand)
    return [f"{subcommand} has no {flag}" for flag in _flags(rest[rest.index(subcommand) + 1:]) if flag not in known]


def test_the_documents_show_commands():
    found = documented_commands()
    assert len(found) >= 60, found  # the check would pass vacuously if the extraction broke
    assert ("README.md", "auto-research post-train --algorithm rloo --dataset arithmetic-generate") in found


@pytest.mark.parametrize(("document", "command"), documented_commands(),
                         ids=[f"{document}:{command[:60]}" for document, command in documented_commands()])
def test_each_documented_commands_flags_exist(document, command):
    assert _problems(command) == []


def test_a_drifted_flag_is_caught():
    assert _problems("auto-research post-train --dataset x.jsonl --no-such-flag 3") == ["post-train has no "
                                                                                          "--no-such-flag"]
    assert _problems("auto-research rollout-serve --rollout-memory 0.1") == []
    assert _problems("python benchmarks/async.py --no-such-flag") == ["benchmarks/async.py has no --no-such-flag"]


@pytest.mark.parametrize("command", sorted(RUN_AS_WRITTEN))
def test_the_quick_commands_run_as_written(command, tmp_path):
    assert any(found == command for _, found in documented_commands())
    result = run_cli(*shlex.split(command)[1:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
