"""Finding the run's reward functions, once: built-ins by name, user functions, functions passed in from Python.
Light (no torch), so that a mistyped reward fails before any model loads."""

from __future__ import annotations

import inspect
from typing import Callable

from auto_research.errors import UserError
from auto_research.rewards.verifiers import BUILT_IN
from auto_research.user_code import FORMS, load_user_object


FROM_PYTHON = "from-python:"
"""A run's config.yaml names a reward given from Python that cannot be imported by name as ``from-python:NAME``
(``config.files.write_resolved_config``): a rerun from that file is refused until the function is passed again."""


def load_reward(spec: str) -> Callable:
    """A ``--reward`` that is not a built-in: the user's function, or one line."""
    return load_user_object(spec, "--reward", "a reward: fn(prompts, completions, rows) or TRL's keywords",
                            f"a built-in ({', '.join(BUILT_IN)}), {FORMS}")


def resolve_rewards(specs: list[str], weights: list[float] | None, reward_model: str | None,
                    functions: list[tuple[str, Callable]] = (), reward_url: str | None = None
                    ) -> list[tuple[str, Callable, bool]]:
    """The run's named reward components, ``(name, function, is_user_function)``, found before any model is
    loaded. The reward model comes after them and is only named here; the weights must count them all."""
    passed = {name for name, _ in functions}
    for spec in specs:
        if spec.startswith(FROM_PYTHON) and spec[len(FROM_PYTHON):] not in passed:
            raise UserError(f"--reward {spec}: this reward was a function given from Python (post_train(reward=...)) "
                            "that cannot be imported by name: pass it again (post_train(reward=...)), or put it in a "
                            "module and give --reward module:function")
    resolved = [(name, BUILT_IN[name], False) if name in BUILT_IN else (name, load_reward(name), True)
                for name in specs if not name.startswith(FROM_PYTHON)]  # a Python reward passed again serves
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
    """How a user reward is called, from its signature: ``trl`` (keywords, each column a list) when it takes
    ``**kwargs`` or keyword-only parameters, or names ``completions`` anywhere but second of three; ``positional``
    (``reward(prompts, completions, rows)``) for three positional parameters; any other shape, and three whose
    third is ``completion_ids`` (either could be meant), a one-line UserError."""
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


PASSED = ("prompts", "completions", "completion_ids")
"""What a reward called TRL's way always receives, beside the data's columns (``combine.with_row_fields``)."""


def check_columns(rewards: list[tuple[str, Callable, bool]], columns: set[str], dataset: str) -> None:
    """A TRL-style reward whose parameter without a default names no column of the data (``columns``, ``answer``
    included) would fail at its first call, after the model loaded: one line now instead."""
    for name, function, user in rewards:
        if not user or calling_convention(name, function) != TRL:
            continue
        try:
            parameters = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            continue
        missing = [parameter.name for parameter in parameters if parameter.default is parameter.empty
                   and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
                   and parameter.name not in PASSED and parameter.name not in columns]
        if missing:
            raise UserError(f"reward {name!r} takes {missing[0]!r}, a column {dataset} lacks (its columns: "
                            f"{', '.join(sorted(columns)) or 'none'}): give rows with that column, or the parameter a "
                            f"default ({missing[0]}=None)")

