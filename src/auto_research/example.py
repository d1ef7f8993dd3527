"""One row of a task as every layer sees it: what data/ makes and rewards/ scores. A leaf below both (data/ builds
tasks from rewards' verifiers, so it cannot live in data/); ``data.types`` re-exports it beside ``Task``."""

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
