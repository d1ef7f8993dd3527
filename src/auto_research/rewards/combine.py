"""The run's reward: a weighted sum of its components, checked value by value.

Every reward is called on a whole batch as ``reward(prompts, completions, examples)`` and returns one
float, or None, per completion. None means "cannot score this one": the sample is left out of its
group's baseline. A sample that any component cannot score is left out.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

from auto_research.data.types import Example
from auto_research.errors import RewardError, one_line
from auto_research.rewards.loading import POSITIONAL, calling_convention
from auto_research.rewards.reward_model import RewardModel
from auto_research.rewards.verifiers import BUILT_IN


def with_row_fields(function: Callable) -> Callable:
    """A user callable in the convention its signature says (``loading.calling_convention``): ours receives the
    dataset rows as dicts (with ``prompt`` and ``answer`` added); TRL's, keywords: ``prompts``, ``completions``,
    ``completion_ids`` and each column of the rows as a list (for conversational rows, prompts and completions
    as message lists, as TRL passes them). An ``async def`` reward returns its coroutine, awaited with the
    others' by ``CombinedReward``."""
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
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return {parameter.name for parameter in parameters}


def _settle(pending: dict[int, object]) -> dict[int, object]:
    """Await every component's coroutine together (async rewards run concurrently); exceptions are returned."""
    async def gather():
        return await asyncio.gather(*pending.values(), return_exceptions=True)

    return dict(zip(pending, asyncio.run(gather())))


@dataclass
class CombinedReward:
    """Weighted sum of reward components; None when any component gives None.

    A component that raises, or returns anything but a list (or tuple, NumPy
    array, tensor) of one value per completion, is a RewardError naming it.
    """

    components: list[tuple[str, Callable, float]]
    takes_completion_ids = True

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[Example],
                 completion_ids: list[list[int]] | None = None) -> list[float | None]:
        total: list[float | None] = [0.0] * len(completions)
        outcomes, pending = {}, {}
        for index, (name, function, _) in enumerate(self.components):
            try:
                if getattr(function, "takes_completion_ids", False):
                    value = function(list(prompts), list(completions), list(examples), completion_ids)
                else:
                    value = function(list(prompts), list(completions), list(examples))
            except Exception as error:
                value = error
            (pending if inspect.isawaitable(value) else outcomes)[index] = value
        if pending:
            outcomes.update(_settle(pending))
        for index, (name, function, weight) in enumerate(self.components):
            values = outcomes[index]
            if isinstance(values, Exception):
                raise RewardError(f"reward {name!r} raised {one_line(values)} on a batch of {len(completions)} "
                                  f"completions (first prompt {prompts[0]!r})") from None
            if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
                values = values.tolist()  # NumPy arrays and tensors
            if not isinstance(values, (list, tuple)):
                raise RewardError(f"reward {name!r} returned {type(values).__name__}, not a list of one float "
                                  f"(or None) per completion")
            if len(values) != len(completions):
                raise RewardError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
            for index, value in enumerate(values):
                if value is None or total[index] is None:
                    total[index] = None
                    continue
                if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                    raise RewardError(
                        f"reward {name!r} returned {value!r} for prompt {prompts[index]!r} "
                        f"(completion {completions[index]!r}); rewards must be finite numbers or None"
                    )
                total[index] += weight * float(value)
        return total

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
    return CombinedReward([(name, function, weight) for (name, function), weight in zip(functions, weights)])
