"""The types a task is made of: ``Task``, and its rows, ``Example`` (defined in ``auto_research.example``, below
the rewards that score it, and re-exported here)."""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.example import Example

__all__ = ["Example", "Task"]


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Example]
    """Prompts for RL (fresh: never among the demonstrations for arithmetic-generate)."""
    evaluation: list[Example]
    """Held-out prompts for greedy evaluation."""
    demonstrations: list[Example]
    """Prompt + solution pairs for supervised fine-tuning."""
    verifier: str | None
    """Name of the built-in reward that checks answers (rewards/verifiers.py); None when the rows have no answers:
    then held-out accuracy is not measured (null) and the held-out mean reward is the evaluation's figure."""
    source: str
    gold: object = None
    """A hidden gold scorer (prompts, completions, examples) → floats, evaluated but never trained on."""
    gold_judge: object = None
    """Pairwise gold judge (prompt, response A, response B, example) → P(A is better)."""
    base: str | None = None
    """The embedded task whose warm-started model this task starts from (default: its own name)."""
