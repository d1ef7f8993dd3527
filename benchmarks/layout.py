"""Issue 54's newcomer counts, measured on the source as it is (no torch, about a second):

    python benchmarks/layout.py

- flat reads: ``<x>config.<flat setting>`` (a name of a field in one of ``GenerationConfig``'s sections, read
  through anything named ``config``) in a module outside the boundary (config/, cli/, recipes/, api.py) and
  outside ``OTHER_CONFIGS``;
- whole-config takers: functions outside the boundary with a parameter annotated ``GenerationConfig``, or named
  ``config`` in a generation-level room (the candidate level's ``config`` is another class);
- the run config's reach: modules outside the boundary that name ``GenerationConfig`` or make a flat read;
- mutable bags: non-frozen dataclasses of 10 fields or more outside the boundary (the ones to read: a bag of
  parts, such as ``Components``, against a thread's own state);
- capability probes: ``getattr``/``hasattr`` calls in train/ (engines are probed in engine/ only);
- size: source lines, files over 450 lines, functions over 60.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "auto_research"
BOUNDARY = ("config", "cli", "recipes", "api.py")
OTHER_CONFIGS = ("candidate", "engine/rollout/serve.py")
"""Where ``config`` is another class: the candidate level's ``CandidateConfig``, rollout-serve's ``ServeConfig``."""
GENERATION_ROOMS = ("train", "envs", "data", "rewards", "algorithms", "report")
"""Where a parameter named ``config`` is the run's (in engine/ it is a model's)."""


def flat_names() -> set[str]:
    sys.path.insert(0, str(PACKAGE.parent))
    from auto_research.config.generation import OWNER, SECTIONS  # noqa: PLC0415

    return set(OWNER) - set(SECTIONS)


def _room(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0]


def _names_config(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id.endswith("config")) or (
        isinstance(node, ast.Attribute) and node.attr.endswith("config"))


def flat_reads_in(tree: ast.AST, flat: set[str]) -> list[int]:
    """The lines of ``tree`` that read a setting by its flat name (``config.temperature``, ``c.config.beta``)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in flat and _names_config(node.value)]


def below_the_boundary(path: Path) -> bool:
    """A module where settings are read by section (outside config/, cli/, recipes/, api.py and ``OTHER_CONFIGS``)."""
    return _room(path) not in BOUNDARY and not str(path.relative_to(PACKAGE)).startswith(OTHER_CONFIGS)


def flat_reads() -> list[str]:
    """Every flat read below the boundary, as ``module:line``."""
    flat = flat_names()
    return [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py")) if below_the_boundary(path)
            for line in flat_reads_in(ast.parse(path.read_text()), flat)]


def _decorated_frozen(node: ast.ClassDef) -> bool | None:
    """True/False for a dataclass (frozen or not), None for another class."""
    for decorator in node.decorator_list:
        name = decorator.func if isinstance(decorator, ast.Call) else decorator
        if getattr(name, "id", getattr(name, "attr", None)) == "dataclass":
            return isinstance(decorator, ast.Call) and any(
                k.arg == "frozen" and getattr(k.value, "value", False) for k in decorator.keywords)
    return None


def counts() -> dict:
    flat = flat_names()
    reads, takers, reach, bags, probes = Counter(), [], set(), [], Counter()
    lines, long_files, long_functions = 0, [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        lines += text.count("\n")
        name = str(path.relative_to(PACKAGE))
        if text.count("\n") > 450:
            long_files.append(name)
        tree = ast.parse(text)
        inside = not below_the_boundary(path)
        if not inside and flat_reads_in(tree, flat):
            reads[name] = len(flat_reads_in(tree, flat))
            reach.add(name)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    long_functions.append(f"{name}:{node.name}")
                if not inside:
                    for arg in node.args.args + node.args.kwonlyargs:
                        annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                        if "GenerationConfig" in annotation or (
                                arg.arg == "config" and _room(path) in GENERATION_ROOMS and not annotation):
                            takers.append(f"{name}:{node.name}")
                            break
            elif isinstance(node, ast.Name) and node.id == "GenerationConfig" and not inside:
                reach.add(name)
            elif isinstance(node, ast.ClassDef) and not inside and _decorated_frozen(node) is False:
                fields = [item for item in node.body if isinstance(item, ast.AnnAssign)]
                if len(fields) >= 10:
                    bags.append(f"{name}:{node.name} ({len(fields)} fields)")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and _room(path) == "train"):
                probes[name] += 1
    return {"flat reads below the boundary": sum(reads.values()), "by module": dict(reads.most_common()),
            "whole-config takers": takers, "the run config's reach (modules)": sorted(reach),
            "mutable bags": bags, "getattr/hasattr in train/": dict(probes), "source lines": lines,
            "files over 450 lines": long_files, "functions over 60 lines": long_functions}


def main() -> None:
    found = counts()
    for key, value in found.items():
        if isinstance(value, (list, dict)):
            print(f"{key}: {len(value)}")
            items = value.items() if isinstance(value, dict) else ((item, None) for item in value)
            for item, count in items:
                print(f"    {item}" + (f"  {count}" if count is not None else ""))
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
