"""Built-in verifiers: exact-match correctness (the accuracy every level reports) and the rewards built on it."""

from __future__ import annotations

import math
import re
from typing import Callable

from auto_research.example import Example

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The number after the last ``####`` if any, else the last number in the text."""
    tail = text.rsplit("####", 1)[-1] if "####" in text else text
    found = NUMBER.findall(tail)  # each match, its commas dropped, reads as a float
    return float(found[-1].replace(",", "")) if found else None


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
    if verifier == "exact":
        return _normalise(completion).removesuffix(".").strip() == _normalise(example.answer)
    raise ValueError(f"unknown verifier {verifier!r}")


VERIFIERS = ("match", "exact")
"""The verifiers a data file may ask for (--verifier): match (the final number when the answer is one, else the
normalised text; the default) or exact (the whole completion is the answer, whitespace, case and a final period
aside: a reply that wraps the right number in words is wrong)."""


def arithmetic_reward(prompts, completions, examples) -> list[float]:
    """½ · exact match + ½ · fraction of digit positions that are right: exact match alone gives a group no signal
    whenever all K samples are wrong; per-digit credit lets a right units digit beat a wrong one."""
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
    "exact": _verifier_reward("exact"),
    "format": format_reward,
}
SCORES_ALONE = frozenset({"format"})
"""The built-in rewards that read no answer: the only ones rows without answers can be scored with."""


