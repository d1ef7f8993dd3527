"""Bring your own loop (``--rollout-function module:fn``, docs/environments.md): the user's function draws through
``context.generate`` and returns each trajectory's ids, log-probs, loss mask and reward, which become the trainer's
``Rollout`` as an environment's trajectories do. A malformed return, or a raise, is a ``RewardError`` naming the
function, the row and the key, so the run keeps its last good step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

from auto_research.example import Example
from auto_research.engine.rollout import SamplingSettings
from auto_research.envs.rollout import Runner, row_of
from auto_research.envs.trajectory import Generate, Trajectory, turn_seed
from auto_research.errors import RewardError, UserError, one_line
from auto_research.user_code import load_user_object

REQUIRED = ("prompt_ids", "completion_ids", "logprobs", "loss_mask", "reward")
"""The keys every returned dict has; ``truncated``, ``text`` and ``turns`` are optional."""


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout function is handed besides the rows."""

    tokenizer: object
    group_size: int
    """K: rows g·K … g·K + K − 1 are prompt g's (its row repeated)."""
    seeds: tuple[int, ...]
    """One per row: ``turn_seed(prompt's seed, k, 0)`` for trajectory k of its group (a later turn's:
    ``turn_seed(seed, 0, turn)``). Drawing from these alone makes a trajectory independent of batching."""
    settings: SamplingSettings  # the run's: --max-new-tokens bounds each draw
    max_tokens: int
    """The most tokens after the prompt (--max-trajectory-tokens, or its default)."""
    generate: Callable[[list[list[int]], list[int]], tuple[list[list[int]], list[list[float]]]]
    """``generate(prompt_ids, seeds)``: one completion's ids (up to and including EOS) and log-probs per prompt,
    from the run's sampler; greedy (log-probs 0) in the held-out evaluation."""


def load_rollout_function(spec) -> tuple[str, Callable]:
    """``--rollout-function module:fn`` (or ``path/file.py:fn``), or a function from Python: (its name, it)."""
    if isinstance(spec, str):
        return spec, load_user_object(spec, "--rollout-function", "a function: fn(rows, context) -> a list of dicts")
    if not callable(spec):
        raise UserError(f"rollout_function: {type(spec).__name__} is not callable (a function: fn(rows, context) -> "
                        "a list of dicts)")
    return getattr(spec, "__name__", "rollout_function"), spec


@dataclass(frozen=True)
class FunctionRunner(Runner):
    """The run's rollouts from a rollout function, as ``EpisodeRunner``'s from an environment."""

    generate: Generate  # the run's sampler's generate_ids
    tokenizer: object
    function: Callable
    name: str
    settings: SamplingSettings
    max_tokens: int
    vocabulary: int
    """Token ids must lie in 0 … vocabulary − 1 (the model's embedding rows)."""
    context_length: int | None = None
    """The model's context: a prompt and completion together may not exceed it (None: unbounded)."""
    pad: int = 0
    scores_replies: bool = False
    """Whether the reward functions (given explicitly) score each row's text, added to the function's reward."""

    def trajectories(self, examples: list[Example], group_size: int, seeds: list[int]) -> list[Trajectory]:
        """The function called once on every trajectory's row, its return checked row by row."""
        rows = [row_of(example) for example in examples for _ in range(group_size)]
        own = tuple(turn_seed(seed, k, 0) for seed in seeds for k in range(group_size))
        generate, settings = self.generate, self.settings
        context = RolloutContext(self.tokenizer, group_size, own, settings, self.max_tokens,
                                 lambda prompt_ids, draw_seeds: generate(prompt_ids, draw_seeds, settings))
        try:
            returned = self.function(rows, context)
        except UserError:  # the sampler's own (a rollout server gone): already one line
            raise
        except Exception as error:  # noqa: BLE001 - the user's code: one line naming it, never swallowed
            raise RewardError(f"--rollout-function {self.name} raised {one_line(error)}") from error
        if not isinstance(returned, (list, tuple)) or len(returned) != len(rows):
            got = f"{len(returned)} items" if isinstance(returned, (list, tuple)) else type(returned).__name__
            raise RewardError(f"--rollout-function {self.name} returned {got} for {len(rows)} rows (one dict per "
                              "row, in the rows' order)")
        return [self.trajectory(index, item) for index, item in enumerate(returned)]

    def trajectory(self, index: int, item) -> Trajectory:
        """Row ``index``'s dict as a checked ``Trajectory`` (log-probs off the loss mask set to 0)."""
        where = f"--rollout-function {self.name}: row {index}"
        if not isinstance(item, dict):
            raise RewardError(f"{where} is {type(item).__name__}, not a dict")
        missing = [key for key in REQUIRED if key not in item]
        if missing:
            raise RewardError(f"{where} has no {missing[0]!r} (each row has {', '.join(REQUIRED)})")
        prompt, ids = self._ids(where, item, "prompt_ids"), self._ids(where, item, "completion_ids")
        if not prompt:
            raise RewardError(f"{where}: 'prompt_ids' is empty")
        mask, logprobs = _values(where, item, "loss_mask", len(ids)), _values(where, item, "logprobs", len(ids))
        for position, value in enumerate(mask):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value not in (0, 1):
                raise RewardError(f"{where}: 'loss_mask' holds {value!r} at position {position} (1 on the model's "
                                  "own tokens, 0 on the others)")
        mask = [int(value) for value in mask]
        logprobs = [_finite(where, "logprobs", value, position) if owned else 0.0
                    for position, (value, owned) in enumerate(zip(logprobs, mask))]
        _check_probabilities(where, ids, logprobs)
        reward = None if item["reward"] is None else _finite(where, "reward", item["reward"])
        if len(ids) > self.max_tokens:
            raise RewardError(f"{where}: 'completion_ids' holds {len(ids)} tokens, more than context.max_tokens "
                              f"{self.max_tokens} (--max-trajectory-tokens)")
        if self.context_length is not None and len(prompt) + len(ids) > self.context_length:
            raise RewardError(f"{where}: 'prompt_ids' and 'completion_ids' hold {len(prompt) + len(ids)} tokens, "
                              f"more than the model's context of {self.context_length}")
        text = item.get("text")
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        elif not isinstance(text, str):
            raise RewardError(f"{where}: 'text' is {type(text).__name__}, not a string")
        turns = item.get("turns", 1)
        if isinstance(turns, bool) or not isinstance(turns, numbers.Integral) or turns < 0:
            raise RewardError(f"{where}: 'turns' is {turns!r}, not a count")
        return Trajectory(prompt, ids, mask, logprobs, [{"role": "assistant", "content": text}], reward, int(turns),
                          truncated=bool(item.get("truncated", False)), live=False, text=text)

    def _ids(self, where: str, item: dict, key: str) -> list[int]:
        ids = _values(where, item, key)
        for position, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < self.vocabulary:
                raise RewardError(f"{where}: {key!r} holds {token!r} at position {position}, not a token id of the "
                                  f"model (0 … {self.vocabulary - 1})")
        return [int(token) for token in ids]


def _values(where: str, item: dict, key: str, length: int | None = None) -> list:
    """``item[key]`` as a list (a tensor's or an array's values too), of ``length`` values when given."""
    value = item[key]
    value = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(value, (list, tuple)):
        raise RewardError(f"{where}: {key!r} is {type(value).__name__}, not a list")
    if length is not None and len(value) != length:
        raise RewardError(f"{where}: {key!r} has {len(value)} values for {length} 'completion_ids'")
    return list(value)


def _finite(where: str, key: str, value, position: int | None = None) -> float:
    at = "" if position is None else f" at position {position}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, (str, bool)) or not math.isfinite(number):
        raise RewardError(f"{where}: {key!r} is {value!r}{at}, not a finite number")
    return number


LOGPROB_ROUNDING = 1e-4
"""How far above 0 a log-probability may lie by rounding (an engine's float16/bfloat16 log-softmax)."""


def _check_probabilities(where: str, ids: list[int], logprobs: list[float]) -> None:
    """A log-probability above 0 (beyond rounding) would weight the sample's correction by exp(log π − log μ) ≈ 0,
    so the run would learn nothing, silently: refused, naming the token."""
    for position, value in enumerate(logprobs):
        if value > LOGPROB_ROUNDING:
            raise RewardError(f"{where}: 'logprobs' is {value:g} at position {position} (token {ids[position]}), "
                              "above 0: a log-probability is at most 0 (give the sampler's log-probs of the tokens "
                              "it drew, as context.generate returns them)")


def function_runner(prepared, tokenizer, policy, sampler, settings: SamplingSettings, trajectory_tokens: int,
                    scores_replies: bool) -> FunctionRunner:
    """The run's ``FunctionRunner`` over ``sampler.generate_ids``; ``scores_replies``: the user gave rewards, which
    then score each row's text too."""
    from auto_research.engine.models import context_length  # noqa: PLC0415
    from auto_research.engine.rollout import eos_ids  # noqa: PLC0415

    name, function = prepared.rollout_function
    embeddings = policy.get_input_embeddings()
    vocabulary = getattr(embeddings, "num_embeddings", None) or len(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer, policy)[0]
    return FunctionRunner(sampler.generate_ids, tokenizer, function, name, settings, trajectory_tokens,
                          vocabulary, context_length(policy), pad, scores_replies)
