"""The run's reward: a weighted sum of its components, checked value by value.

Every reward is called on a whole batch as ``reward(prompts, completions, examples)`` and returns one
float, or None, per completion. None means "cannot score this one": the sample is left out of its
group's baseline. A sample that any component cannot score is left out.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

from auto_research.data.types import Example
from auto_research.errors import RewardError, one_line
from auto_research.rewards.reward_model import RewardModel
from auto_research.rewards.verifiers import BUILT_IN


def with_row_fields(function: Callable) -> Callable:
    """User callables receive the dataset rows as dicts (with ``prompt`` and ``answer`` added)."""

    def reward(prompts, completions, examples):
        rows = [{**example.fields, "prompt": example.prompt, "answer": example.answer} for example in examples]
        return function(prompts, completions, rows)

    return reward


@dataclass
class CombinedReward:
    """Weighted sum of reward components; None when any component gives None.

    A component that raises, or returns anything but a list (or tuple, NumPy
    array, tensor) of one value per completion, is a RewardError naming it.
    """

    components: list[tuple[str, Callable, float]]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[Example]) -> list[float | None]:
        total: list[float | None] = [0.0] * len(completions)
        for name, function, weight in self.components:
            try:
                values = function(list(prompts), list(completions), list(examples))
            except Exception as error:
                raise RewardError(f"reward {name!r} raised {one_line(error)} on a batch of {len(completions)} "
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
