"""Finding the run's reward functions, once: built-ins by name, ``module:function`` callables, functions
passed in from Python. Light (no torch), so that a mistyped reward fails before any model loads."""

from __future__ import annotations

import importlib
import inspect
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
                    functions: list[tuple[str, Callable]] = (), reward_url: str | None = None
                    ) -> list[tuple[str, Callable, bool]]:
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
    for name, function, user in resolved:
        if user:
            calling_convention(name, function)
    if reward_url is not None:
        from auto_research.rewards.remote import RemoteReward  # noqa: PLC0415

        resolved.append((f"reward-url:{reward_url}", RemoteReward(reward_url), False))
    names = [name for name, _, _ in resolved] + ([f"reward-model:{reward_model}"] if reward_model else [])
    if weights is not None and len(weights) != max(1, len(names)):
        raise UserError(f"--reward-weights has {len(weights)} values for {max(1, len(names))} rewards "
                        f"({', '.join(names or ['the dataset verifier'])})")
    return resolved


POSITIONAL, TRL = "positional", "trl"


def calling_convention(name: str, function: Callable) -> str:
    """How a user reward is called, from its signature (a one-line UserError when neither fits):

    - ``trl``: TRL's keywords, ``reward(prompts=…, completions=…, completion_ids=…, **columns)``, each dataset
      column a list; chosen when the function takes ``**kwargs`` or keyword-only parameters, or names a
      parameter ``completions`` anywhere but second of three (``def reward(completions, answer, **kwargs)``);
    - ``positional``: ours, ``reward(prompts, completions, rows)``, three positional parameters (any names,
      the second not ``completions`` only if none is), rows as dicts.

    Three positional parameters whose third is ``completion_ids`` could be either: refused, as is any other
    shape (``*args`` alone, one or two parameters without ``completions``)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return POSITIONAL  # a builtin or C callable: called as it always was
    kinds = {parameter.kind for parameter in parameters}
    names = [parameter.name for parameter in parameters]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_KEYWORD in kinds or inspect.Parameter.KEYWORD_ONLY in kinds:
        return TRL
    if len(positional) == 3 and len(parameters) == 3:
        if names[2] == "completion_ids":
            raise UserError(f"reward {name!r}: ({', '.join(names)}) could be ours (prompts, completions, rows) or "
                            "TRL's keywords; add **kwargs to be called TRL's way, or rename the third parameter")
        if "completions" not in names or names[1] == "completions":
            return POSITIONAL
    if "completions" in names:
        return TRL
    raise UserError(f"reward {name!r} takes ({', '.join(names)}): neither our form (prompts, completions, rows) nor "
                    "TRL's (completions by keyword, e.g. def reward(completions, **kwargs))")
