"""Environments: a rollout that talks to the world for several turns, trained on the model's own tokens only.

Our protocol (the names are the ones users' code is written against)::

    def make_env(row):            # called once per trajectory with the dataset row (a dict)
        return GuessTheNumber(row["secret"])

    class GuessTheNumber:
        def reset(self) -> str | None:           # the first user message, or None for the row's prompt
        def step(self, text: str) -> tuple[str | None, float | None, bool]:
            ...                                   # (observation sent back, reward, done)

TRL's shape runs unchanged (TRL 1.16 ``GRPOTrainer(environment_factory=...)``): the factory takes no argument,
the object's public methods are its tools, ``reset(**row)`` returns None or text appended to the last user
message, and an optional ``get_reward()`` scores the finished rollout. Which shape an object has is read from
the object itself (a ``step`` method makes it ours), as TRL-style reward functions are told apart today.

``Episode`` wraps either shape behind one interface for the rollout loop (``envs.trajectory``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from auto_research.errors import UserError


def load_object(spec: str, flag: str):
    """``module:name`` (a module on the path, or a ``path/to/file.py``) → the object; one line otherwise."""
    module_name, _, name = str(spec).partition(":")
    if not module_name or not name:
        raise UserError(f"{flag} {spec!r}: expected module:name, e.g. my_envs:make_env")
    try:
        if module_name.endswith(".py"):
            from importlib.util import module_from_spec, spec_from_file_location  # noqa: PLC0415

            found = spec_from_file_location(module_name.rsplit("/", 1)[-1][:-3], module_name)
            if found is None:
                raise ModuleNotFoundError(module_name)
            module = module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except (ImportError, FileNotFoundError) as error:
        raise UserError(f"{flag} {spec!r}: cannot import {module_name} ({error})") from None
    if not hasattr(module, name):
        raise UserError(f"{flag} {spec!r}: {module_name} has no {name!r}")
    return getattr(module, name)


def _takes_no_argument(factory) -> bool:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in parameters)


def public_methods(environment) -> dict[str, Callable]:
    """A TRL-shaped environment's tools: its public methods other than reset and get_reward."""
    return {name: member for name, member in inspect.getmembers(environment, inspect.ismethod)
            if not name.startswith("_") and name not in ("reset", "get_reward")}


@dataclass
class EnvironmentFactory:
    """``--environment module:factory``, checked once on a sample row before any work."""

    factory: Callable
    spec: str = "environment"
    trl: bool = False
    """TRL's shape: made with no argument, tools are its public methods, ``reset(**row)`` appends."""

    @classmethod
    def load(cls, spec: str, sample_row: dict | None = None) -> "EnvironmentFactory":
        factory = load_object(spec, "--environment")
        if not callable(factory):
            raise UserError(f"--environment {spec!r} is not callable (a factory: make_env(row) -> environment)")
        made = cls(factory, spec)
        made.trl = _takes_no_argument(factory)
        made.episode(sample_row or {})  # the shape is checked now, not at the first step
        return made

    def episode(self, row: dict, tools: dict[str, Callable] | None = None) -> "Episode":
        environment = self.factory() if self.trl else self.factory(row)
        step, reset = getattr(environment, "step", None), getattr(environment, "reset", None)
        if callable(step):
            if not callable(reset):
                raise UserError(f"--environment {self.spec}: the object it returns has step but no reset method "
                                "(an environment has reset() and step(text))")
            return Episode(environment, row, dict(tools or {}), trl=False)
        methods = public_methods(environment)
        if not self.trl or not methods:
            raise UserError(f"--environment {self.spec}: the object it returns has no reset/step methods "
                            f"(an environment has reset() and step(text); got {type(environment).__name__})")
        return Episode(environment, row, {**methods, **(tools or {})}, trl=True)


@dataclass
class Episode:
    """One trajectory's environment behind one interface, whatever its shape."""

    environment: object | None
    row: dict
    tools: dict[str, Callable] = field(default_factory=dict)
    trl: bool = False
    rewards: list[float] = field(default_factory=list)

    def first_message(self, prompt: str) -> str:
        """The first user message: ours replaces the prompt when reset() returns text; TRL's appends to it."""
        if self.environment is None:
            return prompt
        if self.trl:
            reset = getattr(self.environment, "reset", None)
            extra = reset(**self.row) if callable(reset) else None
            return prompt if extra is None else f"{prompt}{extra}"
        first = self.environment.reset()
        return prompt if first is None else str(first)

    @property
    def steps(self) -> bool:
        """Whether a reply without a tool call goes to the environment's step (ours) or ends the episode."""
        return self.environment is not None and not self.trl

    def step(self, text: str) -> tuple[str | None, bool]:
        """The environment's answer to a reply: (observation, done); its reward is kept."""
        answer = self.environment.step(text)
        if not (isinstance(answer, tuple) and len(answer) == 3):
            raise TypeError(f"step() must return (observation, reward, done), got {answer!r}"[:200])
        observation, reward, done = answer
        if reward is not None:
            self.rewards.append(float(reward))
        return (None if observation is None else str(observation)), bool(done)

    def final_reward(self) -> float | None:
        """The environment's rewards summed (ours), or ``get_reward()`` (TRL's); None when there are none."""
        if self.trl:
            get_reward = getattr(self.environment, "get_reward", None)
            return None if get_reward is None else float(get_reward())
        return sum(self.rewards) if self.rewards else None
