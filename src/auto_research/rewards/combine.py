"""The run's reward: a weighted sum of its components, checked value by value.

Every reward is called on a whole batch as ``reward(prompts, completions, examples)`` and returns one float, or
None ("cannot score this one": left out of its group's baseline), per completion. A value that is not a finite
number within ±``MAX_REWARD``, from any source, is left out too (``checked``), counted and its cause kept.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

from auto_research.example import Example
from auto_research.errors import RewardError, one_line
from auto_research.rewards.loading import POSITIONAL, calling_convention
from auto_research.rewards.reward_model import RewardModel
from auto_research.rewards.verifiers import BUILT_IN
from auto_research.user_code import where_raised


MAX_REWARD = 1e6
"""The largest reward magnitude scored: baselines, stds and the loss square rewards in float32 (at most 3.4e38),
so 1e20 would be inf there. A million keeps every figure finite, far beyond any reward scale in use."""


def reward_problem(value) -> str | None:
    """Why a number cannot be scored ("nan", "inf", "a value beyond ±1,000,000"), or None when it can."""
    number = float(value)
    if not math.isfinite(number):
        return str(number)
    return f"a value beyond ±{MAX_REWARD:,.0f}" if abs(number) > MAX_REWARD else None


class Scored(list):
    """A batch's rewards, one float or None per completion, with ``parts`` ({a component's metric name: its own
    values}) and ``causes`` (why each is unscored when not for a plain None: "reward 'f' returned nan")."""

    def __init__(self, values=(), parts: dict | None = None, causes: list | None = None):
        super().__init__(values)
        self.parts = {} if parts is None else {name: list(part) for name, part in parts.items()}
        self.causes = [None] * len(self) if causes is None else list(causes)

    def rows(self, start: int, stop: int) -> "Scored":
        return Scored(self[start:stop], {name: part[start:stop] for name, part in self.parts.items()},
                      self.causes[start:stop])

    @staticmethod
    def join(pieces: list["Scored"]) -> "Scored":
        names = [name for name in pieces[0].parts if all(name in piece.parts for piece in pieces)] if pieces else []
        return Scored([value for piece in pieces for value in piece],
                      {name: [value for piece in pieces for value in piece.parts[name]] for name in names},
                      [cause for piece in pieces for cause in piece.causes])


def checked(values, source: str = "the reward", parts: dict | None = None, causes: list | None = None) -> Scored:
    """``values`` as ``Scored``: each a float, or None where it was None or invalid (``reward_problem``). An invalid
    value's cause is the one given (or that ``values`` holds), else "``source`` returned nan"."""
    parts = getattr(values, "parts", None) if parts is None else parts
    causes = getattr(values, "causes", None) if causes is None else causes
    causes = [None] * len(values) if causes is None else list(causes)
    problems = [None if value is None else reward_problem(value) for value in values]
    causes = [cause if problem is None else cause or f"{source} returned {problem}"
              for cause, problem in zip(causes, problems)]
    return Scored([None if value is None or problem is not None else float(value)
                   for value, problem in zip(values, problems)], parts, causes)


def invalid_count(scored) -> int:
    """The values of a batch left unscored for being invalid (not for a plain None)."""
    return sum(cause is not None for cause in getattr(scored, "causes", ()))


def metric_names(components: list[tuple[str, Callable]]) -> list[str]:
    """Each component's name in the metrics (``reward/<name>``): a function's ``__name__``, a reward model's last
    path part, ``reward_url``; the second and later components of one name get _2, _3 …"""
    labels = []
    for name, function in components:
        if name.startswith("reward-model:"):
            label = name.removeprefix("reward-model:").rstrip("/").split("/")[-1]
        elif name in BUILT_IN or name.startswith("reward-url:"):
            label = name.split(":")[0].replace("-", "_")
        else:
            label = getattr(function, "__name__", None) or type(function).__name__
            label = name.rsplit(":", 1)[-1] if label == "<lambda>" else label
        labels.append(label)
    return [label if labels[:index].count(label) == 0 else f"{label}_{labels[:index].count(label) + 1}"
            for index, label in enumerate(labels)]


def with_row_fields(function: Callable) -> Callable:
    """A user callable in the convention its signature says (``loading.calling_convention``): ours gets the rows as
    dicts; TRL's, keywords, each column a list (conversational rows' prompts and completions as message lists, as
    TRL passes them). An ``async def`` reward returns its coroutine, awaited by ``CombinedReward``."""
    convention = calling_convention(getattr(function, "__name__", "reward"), function)
    accepted = _keywords(function)

    def reward(prompts, completions, examples, completion_ids=None):
        rows = [{**example.fields, "prompt": example.prompt, "answer": example.answer} for example in examples]
        if convention == POSITIONAL:
            return function(prompts, completions, rows)
        conversational = all(example.messages for example in examples) and bool(examples)
        arguments = {"prompts": [list(example.messages) for example in examples] if conversational else list(prompts),
                     "completions": [[{"role": "assistant", "content": text}] for text in completions]
                     if conversational else list(completions),
                     "completion_ids": completion_ids}
        for key in {key for row in rows for key in row} - {"prompt"} - set(arguments):
            arguments[key] = [row.get(key) for row in rows]
        if accepted is not None:
            arguments = {key: value for key, value in arguments.items() if key in accepted}
        return function(**arguments)

    reward.takes_completion_ids = True
    return reward


def _keywords(function: Callable) -> set[str] | None:
    """The keyword names a function takes, or None when it takes any (``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    takes_any = any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters)
    return None if takes_any else {parameter.name for parameter in parameters}


@dataclass
class CombinedReward:
    """Weighted sum of reward components; None when any component gives None or an invalid value. A component
    that raises, or returns anything but one number or None per completion, is a RewardError naming it."""

    components: list[tuple[str, Callable, float]]
    names: list[str] | None = None
    """Each component's name in the metrics (``metric_names``); None: the components' own names."""
    takes_completion_ids = True

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[Example],
                 completion_ids: list[list[int]] | None = None) -> Scored:
        total: list[float | None] = [0.0] * len(completions)
        causes: list[str | None] = [None] * len(completions)
        parts = {}
        outcomes = self._outcomes(prompts, completions, examples, completion_ids)
        names = self.names or [name for name, _, _ in self.components]
        for (name, _, weight), label, values in zip(self.components, names, outcomes):
            part = checked(self._values(name, values, prompts, completions), f"reward {name!r}")
            causes = [earlier or cause for earlier, cause in zip(causes, part.causes)]
            total = [None if sum_ is None or value is None else sum_ + weight * value for sum_, value in zip(total, part)]
            parts[label] = list(part)
        return checked(total, "the weighted sum of the rewards", parts, causes)

    def _outcomes(self, prompts, completions, examples, completion_ids) -> list:
        """Each component's return (or the exception it raised), async components awaited together."""
        outcomes, pending = {}, {}
        for index, (_, function, _) in enumerate(self.components):
            extra = (completion_ids,) if getattr(function, "takes_completion_ids", False) else ()
            try:
                value = function(list(prompts), list(completions), list(examples), *extra)
            except Exception as error:
                value = error
            (pending if inspect.isawaitable(value) else outcomes)[index] = value
        if pending:  # async components awaited together, so they run concurrently; their exceptions returned
            async def gather():
                return await asyncio.gather(*pending.values(), return_exceptions=True)

            outcomes.update(zip(pending, asyncio.run(gather())))
        return [outcomes[index] for index in range(len(self.components))]

    @staticmethod
    def _values(name: str, values, prompts, completions) -> list:
        """A component's return as a list of one number or None per completion, or a RewardError naming it."""
        if isinstance(values, Exception):
            raise RewardError(f"reward {name!r} raised {one_line(values)}{where_raised(values)} on a batch of "
                              f"{len(completions)} completions (first prompt {prompts[0]!r}; --verbose shows the "
                              "traceback)") from None
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
            values = values.tolist()  # NumPy arrays and tensors
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"reward {name!r} returned {type(values).__name__}, not a list of one float "
                              f"(or None) per completion")
        if len(values) != len(completions):
            raise RewardError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
        for index, value in enumerate(values):
            if value is not None and not isinstance(value, numbers.Real):
                raise RewardError(f"reward {name!r} returned {value!r} for prompt {prompts[index]!r} "
                                  f"(completion {completions[index]!r}); rewards must be numbers or None")
        return list(values)

    @property
    def reward_model(self) -> RewardModel | None:
        return next((function for _, function, _ in self.components if isinstance(function, RewardModel)), None)


def build_reward(resolved: list[tuple[str, Callable, bool]], weights: list[float] | None, reward_model: str | None,
                 verifier: str, device=None, offline: bool = False) -> CombinedReward:
    """The reward from ``loading.resolve_rewards``'s components, then the reward model (loaded here); the
    task's verifier when there is neither."""
    if not resolved and not reward_model:
        resolved = [(verifier, BUILT_IN[verifier], False)]
    functions = [(name, with_row_fields(function) if user else function) for name, function, user in resolved]
    if reward_model:
        functions.append((f"reward-model:{reward_model}", RewardModel(reward_model, device, offline)))
    weights = [1.0] * len(functions) if weights is None else weights
    names = metric_names([(name, function) for name, function, _ in resolved] + functions[len(resolved):])
    return CombinedReward([(name, function, weight) for (name, function), weight in zip(functions, weights)], names)
