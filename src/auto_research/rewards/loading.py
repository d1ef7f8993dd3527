"""Finding the run's reward functions, once: built-ins by name, ``module:function`` callables, functions
passed in from Python. Light (no torch), so that a mistyped reward fails before any model loads."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from auto_research.errors import UserError, one_line
from auto_research.rewards.verifiers import BUILT_IN


def load_callable(spec: str, flag: str = "--reward") -> Callable:
    """``module:function`` → the function; a one-line UserError when it cannot be found.

    The working directory is on the import path, as it is for ``python -c``:
    ``--reward my_rewards:score`` finds ``./my_rewards.py``. Any error while
    importing the module (a syntax error, an import inside it that fails, an
    exception at import time) is reported in one line.
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        expected = f"a built-in ({', '.join(BUILT_IN)}) or module:function" if flag == "--reward" else "module:function"
        raise UserError(f"{flag} {spec!r}: expected {expected}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as error:
        where = f"{error.filename}:{error.lineno}" if error.filename else module_name
        raise UserError(f"{flag} {spec!r}: syntax error in {where} ({error.msg})") from None
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise UserError(f"{flag} {spec!r}: cannot import module {module_name!r} (no {module_name.replace('.', '/')}.py "
                            "in the working directory or on PYTHONPATH)") from None
        raise UserError(f"{flag} {spec!r}: importing {module_name!r} failed ({one_line(error)})") from None
    except Exception as error:
        raise UserError(f"{flag} {spec!r}: importing {module_name!r} failed ({one_line(error)})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"{flag} {spec!r}: module {module_name!r} has no function {function_name!r}")
    return function


def resolve_rewards(specs: list[str], weights: list[float] | None, reward_model: str | None,
                    functions: list[tuple[str, Callable]] = ()) -> list[tuple[str, Callable, bool]]:
    """The run's named reward components, found before any model is loaded: ``(name, function,
    is_user_function)``, user callables imported here once and kept. The reward model comes after them
    and is only named here; with no reward at all, the task's verifier serves (``combine.build_reward``).
    The weights must count the components exactly."""
    resolved = [(name, BUILT_IN[name], False) if name in BUILT_IN else (name, load_callable(name), True)
                for name in specs]
    for name, function in functions:
        if not callable(function):
            raise UserError(f"reward {name!r} is {type(function).__name__}, not a function")
        resolved.append((name, function, True))
    names = [name for name, _, _ in resolved] + ([f"reward-model:{reward_model}"] if reward_model else [])
    if weights is not None and len(weights) != max(1, len(names)):
        raise UserError(f"--reward-weights has {len(weights)} values for {max(1, len(names))} rewards "
                        f"({', '.join(names or ['the dataset verifier'])})")
    return resolved
