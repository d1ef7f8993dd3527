"""Environments: a rollout that talks to the world for several turns, trained on the model's own tokens only.

Ours (``make_env(row)`` → an object with ``reset()`` and ``step(text)`` → (observation, reward, done)) and TRL's
shape (a factory without arguments, public methods as tools, ``reset(**row)``, ``get_reward()``) are described in
docs/environments.md; a ``step`` method makes an object ours. ``Episode`` wraps either behind one interface.
"""

from __future__ import annotations

import inspect
import math
import reprlib
import weakref
from dataclasses import dataclass, field
from typing import Callable

from auto_research.envs.deadline import EnvironmentTimeout, Worker, bounded
from auto_research.errors import UserError, one_line
from auto_research.user_code import load_user_object


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
    timeout: float = 0.0  # --env-timeout, for making an environment and each call into it (0: no limit)

    @classmethod
    def load(cls, spec, sample_row: dict | None = None, timeout: float = 0.0) -> "EnvironmentFactory":
        """``spec`` (``module:factory``, ``path/file.py:factory``, or a factory from Python), checked now on
        ``sample_row``."""
        if isinstance(spec, str):
            factory = load_user_object(spec, "--environment", "a factory: make_env(row) -> environment")
        else:
            factory, spec = spec, getattr(spec, "__name__", "environment")
        made = cls(factory, spec, _takes_no_argument(factory), timeout)
        made.checked_episode(sample_row or {})
        return made

    def checked_episode(self, row: dict, tools: dict[str, Callable] | None = None) -> "Episode":
        """``episode`` on a row before any work: a factory that raises (or hangs) is one line."""
        try:
            return self.episode(row, tools)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - the user's factory: one line, not a traceback
            raise UserError(f"--environment {self.spec}: making the environment for the first training row "
                            f"raised {one_line(error)}") from None

    def episode(self, row: dict, tools: dict[str, Callable] | None = None, tool_timeout: float = 0.0) -> "Episode":
        make = self.factory if self.trl else (lambda: self.factory(row))
        worker = Worker() if self.timeout or tool_timeout else None  # the trajectory's thread, made here
        environment = bounded(make, self.timeout, EnvironmentTimeout, "make_env(row)", worker)
        ours = callable(getattr(environment, "step", None))  # a step method makes it ours, else TRL's shape
        if ours and not callable(getattr(environment, "reset", None)):
            raise UserError(f"--environment {self.spec}: the object it returns has step but no reset method "
                            "(an environment has reset() and step(text))")
        methods = {} if ours else public_methods(environment)
        if not ours and not (self.trl and methods):
            raise UserError(f"--environment {self.spec}: the object it returns has no reset/step methods "
                            f"(an environment has reset() and step(text); got {type(environment).__name__})")
        return Episode(environment, row, {**methods, **(tools or {})}, not ours, timeout=self.timeout,
                       tool_timeout=tool_timeout, worker=worker)


def reward_value(value, where: str) -> float:
    """An environment's reward as a float: a finite number, or a ``ValueError`` naming what it returned."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, (str, bytes)) or not math.isfinite(number):
        raise ValueError(f"{where} is {reprlib.repr(value)}, not a finite number (or None)")
    return number


@dataclass
class Episode:
    """One trajectory's environment behind one interface, whatever its shape; its calls bounded by ``timeout``, a
    tool's by ``tool_timeout``."""

    environment: object | None
    row: dict
    tools: dict[str, Callable] = field(default_factory=dict)
    trl: bool = False
    rewards: list[float] = field(default_factory=list)
    timeout: float = 0.0
    tool_timeout: float = 0.0
    worker: Worker | None = None
    """The trajectory's thread, where every bounded call of it runs (its environment's, its tools')."""

    def __post_init__(self):
        if self.worker is not None:  # the thread ends with the trajectory
            weakref.finalize(self, self.worker.close)

    @property
    def threaded(self) -> bool:
        """Whether its calls run on other threads (under a limit), so several episodes' calls may run at once."""
        return self.worker is not None or bool(self.tool_timeout)

    def _call(self, call: Callable, what: str):
        return bounded(call, self.timeout, EnvironmentTimeout, what, self.worker)

    def first_message(self, prompt: str) -> str:
        """The first user message: ours replaces the prompt when reset() returns text; TRL's appends to it."""
        if self.environment is None:
            return prompt
        if self.trl:
            reset = getattr(self.environment, "reset", None)
            extra = self._call(lambda: reset(**self.row), "reset(**row)") if callable(reset) else None
            return prompt if extra is None else f"{prompt}{extra}"
        first = self._call(self.environment.reset, "reset()")
        return prompt if first is None else str(first)

    @property
    def steps(self) -> bool:
        """Whether a reply without a tool call goes to the environment's step (ours) or ends the episode."""
        return self.environment is not None and not self.trl

    def step(self, text: str) -> tuple[str | None, bool]:
        """The environment's answer to a reply: (observation, done); its reward is kept."""
        answer = self._call(lambda: self.environment.step(text), "step()")
        if not (isinstance(answer, tuple) and len(answer) == 3):
            raise TypeError(f"step() must return (observation, reward, done), got {reprlib.repr(answer)}")
        observation, reward, done = answer
        if reward is not None:
            self.rewards.append(reward_value(reward, "step()'s reward"))
        return (None if observation is None else str(observation)), bool(done)

    def final_reward(self) -> float | None:
        """The environment's rewards summed (ours), or ``get_reward()`` (TRL's); None when there are none."""
        if self.trl:
            get_reward = getattr(self.environment, "get_reward", None)
            if get_reward is None:
                return None
            value = self._call(get_reward, "get_reward()")
            return None if value is None else reward_value(value, "get_reward()'s value")
        return reward_value(sum(self.rewards), "the sum of step()'s rewards") if self.rewards else None
