"""The types a task is made of: leaf module, imported by data, rewards and training alike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    prompt: str
    """The text the model is asked to continue (before any chat template)."""
    answer: str | None
    """What the verifier compares a completion against; None in rows without answers (reward-only data)."""
    solution: str | None = None
    """A reference completion, for supervised fine-tuning (a ``messages`` row's final assistant turn)."""
    fields: dict = field(default_factory=dict)
    """The dataset row as read, for user reward functions."""
    messages: tuple | None = None
    """A conversational prompt (TRL's format): the ``{role, content}`` messages, rendered with the model's chat
    template; ``prompt`` is then the last message's content, for logs."""


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
