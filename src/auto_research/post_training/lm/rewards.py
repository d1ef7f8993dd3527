"""Rewards: built-in verifiers, a format reward, user callables and reward models.

Every reward is called on a whole batch as ``reward(prompts, completions,
examples)`` and returns one float, or None, per completion. None means "cannot
score this one": the sample is left out of its group's baseline. Several
rewards combine as a weighted sum (``--reward-weights``); a sample that any
component cannot score is left out.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from auto_research.errors import UserError, one_line
from auto_research.post_training.lm.tasks import Example

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The number after the last ``####`` if any, else the last number in the text."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = NUMBER.findall(tail)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _same_number(completion: str, answer: str) -> bool:
    value, gold = final_number(completion), final_number(answer)
    return value is not None and gold is not None and math.isclose(value, gold, rel_tol=0, abs_tol=1e-6)


def _normalise(text: str) -> str:
    return " ".join(text.strip().split()).lower()


def is_correct(verifier: str, completion: str, example: Example) -> bool:
    """Exact-match correctness, the accuracy every level reports."""
    if verifier == "arithmetic":
        return completion.strip() == example.answer
    if verifier == "gsm8k":
        return _same_number(completion, example.answer)
    if verifier == "match":
        if final_number(example.answer) is not None and NUMBER.fullmatch(example.answer.strip()):
            return _same_number(completion, example.answer)
        return _normalise(completion) == _normalise(example.answer)
    raise ValueError(f"unknown verifier {verifier!r}")


def arithmetic_reward(prompts, completions, examples) -> list[float]:
    """½ · exact match + ½ · fraction of digit positions that are right (partial credit).

    Exact match alone gives a group no signal whenever all K samples are wrong;
    per-digit credit lets a sample with the right units digit beat one without.
    """
    rewards = []
    for completion, example in zip(completions, examples):
        text, gold = completion.strip(), example.answer
        matching = sum(1 for x, y in zip(text, gold) if x == y)
        rewards.append(0.5 * float(text == gold) + 0.5 * matching / max(len(text), len(gold), 1))
    return rewards


def _verifier_reward(verifier: str):
    def reward(prompts, completions, examples) -> list[float]:
        return [float(is_correct(verifier, completion, example)) for completion, example in zip(completions, examples)]

    reward.__name__ = f"{verifier}_verifier"
    return reward


def format_reward(prompts, completions, examples) -> list[float]:
    """1 when the completion states a final number (GSM8K style ``#### n`` earns it too), else 0."""
    return [float(final_number(completion) is not None) for completion in completions]


BUILT_IN: dict[str, Callable] = {
    "arithmetic": arithmetic_reward,
    "gsm8k": _verifier_reward("gsm8k"),
    "match": _verifier_reward("match"),
    "format": format_reward,
}


def _with_row_fields(function: Callable) -> Callable:
    """User callables receive the dataset rows as dicts (with ``prompt`` and ``answer`` added)."""

    def reward(prompts, completions, examples):
        rows = [{**example.fields, "prompt": example.prompt, "answer": example.answer} for example in examples]
        return function(prompts, completions, rows)

    return reward


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


class RewardModel:
    """A sequence-classification model scoring ``prompt + completion`` text.

    It keeps its own tokenizer: the text is decoded from the policy's tokens and
    re-encoded, so policy and reward model need not share a vocabulary. The
    score is the head's single logit (a head of another width is refused), by the
    same function reward-model training used (``reward_model.score_texts``).
    """

    def __init__(self, path: str, device, offline: bool, batch_size: int = 16):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from auto_research.post_training.lm.models import check_model_source

        check_model_source(path, offline, "--reward-model")
        local = Path(path).expanduser().exists()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline or local)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=offline or local)
        except Exception as error:  # a damaged file surfaces as many exception types
            raise UserError(f"--reward-model {path}: cannot load ({one_line(error)})") from None
        labels = self.model.config.num_labels
        if labels != 1:
            raise UserError(f"--reward-model {path}: its head gives {labels} scores per text, a reward model gives one "
                            "(train one with auto-research reward-model)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = self.model.to(device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.batch_size = batch_size
        self._torch = torch
        self.__name__ = f"reward-model:{path}"

    def __call__(self, prompts, completions, examples) -> list[float]:
        from auto_research.post_training.lm.reward_model import score_texts

        texts = [p + c for p, c in zip(prompts, completions)]
        return score_texts(self.model, self.tokenizer, texts, self.device, self.batch_size).tolist()


class RewardError(Exception):
    """A reward returned something that is not a number (NaN, inf, a string)."""


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


def check_rewards(specs: list[str], weights: list[float] | None, reward_model: str | None,
                  functions: list[tuple[str, Callable]] = ()) -> None:
    """Import every user callable and count the weights, before any model is loaded."""
    for spec in specs:
        if spec not in BUILT_IN:
            load_callable(spec)
    for name, function in functions:
        if not callable(function):
            raise UserError(f"reward {name!r} is {type(function).__name__}, not a function")
    names = list(specs) + [name for name, _ in functions] + ([f"reward-model:{reward_model}"] if reward_model else [])
    count = len(names) or 1
    if weights is not None and len(weights) != count:
        names = names or ["the dataset's verifier"]
        raise UserError(f"--reward-weights has {len(weights)} values for {count} rewards ({', '.join(names)})")


def build_reward(specs: list[str], weights: list[float] | None, reward_model: str | None, verifier: str, device=None,
                 offline: bool = False, extra: list[tuple[str, Callable]] = ()) -> CombinedReward:
    """The run's reward: named built-ins and callables, functions passed in (the Python API), then the
    reward model; the verifier when there is none of these."""
    names = list(specs) or ([] if reward_model or extra else [verifier])
    functions = [(name, BUILT_IN[name] if name in BUILT_IN else _with_row_fields(load_callable(name))) for name in names]
    functions += [(name, _with_row_fields(function)) for name, function in extra]
    if reward_model:
        functions.append((f"reward-model:{reward_model}", RewardModel(reward_model, device, offline)))
    if weights is None:
        weights = [1.0] * len(functions)
    if len(weights) != len(functions):
        raise UserError(
            f"--reward-weights has {len(weights)} values for {len(functions)} rewards ({', '.join(n for n, _ in functions)})"
        )
    return CombinedReward([(name, function, weight) for (name, function), weight in zip(functions, weights)])
