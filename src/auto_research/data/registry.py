"""One record per built-in task, for both levels: every list of dataset names (help texts, checks, presets,
``load_task``) is made from these, so a new task is one record here and its loader.

No NumPy, no torch: ``--help`` and the settings' checks read the records. A loader (and a gold scorer) is a
function, or ``"module:function"``, imported only when the task is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

LEVELS = ("candidate", "generation")


def resolve(target: Callable | str) -> Callable:
    """A function, or the one ``"module:function"`` names (imported now, not when the record is made)."""
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TaskRecord:
    name: str
    level: str  # one of LEVELS
    loader: Callable | str
    """(record, settings) → the task: a ``data.types.Task`` at the generation level, a ``candidate.trainer.
    CandidateData`` at the candidate level; ``settings``: the run's (its data section at the generation level)."""
    about: str
    """A few words for the help texts and docs."""
    presets: dict[str, Any] = field(default_factory=dict)
    """The generation level's defaults for settings left unset (None): steps, learning rate, sampling …"""
    embedded_model: bool = False
    """Runs without --model: the embedded tiny model, warm-started on the task (generation level)."""
    gold: Callable | str | None = None
    """The hidden gold scorer (prompts, completions, examples) → floats: evaluated, never trained on. A task with one
    is a preference task: RL runs against a reward model learned from pairs the gold labelled."""
    gold_name: str | None = None
    """The preference task's name for ``auto-research rlhf --gold``."""
    gold_about: str = ""
    """What the gold scorer prefers, for the task's source line and --gold's help."""
    tag: str | None = None
    """The candidate level's short name in comparison files (classic-post-training-<tag>-<seeds>.json)."""

    @property
    def preference(self) -> bool:
        return self.gold is not None

    def load(self, settings):
        return resolve(self.loader)(self, settings)

    def gold_scorer(self) -> Callable | None:
        return None if self.gold is None else resolve(self.gold)


TASKS: dict[str, TaskRecord] = {}


def register(record: TaskRecord) -> TaskRecord:
    if record.name in TASKS:
        raise ValueError(f"task {record.name!r} is registered twice")
    if record.level not in LEVELS:
        raise ValueError(f"task {record.name!r}: level {record.level!r} is not one of {', '.join(LEVELS)}")
    if (record.gold is None) != (record.gold_name is None):
        raise ValueError(f"task {record.name!r}: a gold scorer and its --gold name come together")
    TASKS[record.name] = record
    return record


def task_names(level: str | None = None, having: str | None = None) -> tuple[str, ...]:
    """The registered tasks' names, in order: of one level, whose field ``having`` is true when given."""
    return tuple(name for name, record in TASKS.items()
                 if level in (None, record.level) and (having is None or getattr(record, having)))


def about_tasks(level: str) -> str:
    """``a (what a is), b (…)``: a level's tasks, for a help text."""
    return ", ".join(f"{name} ({TASKS[name].about})" for name in task_names(level))


def task_record(name: str, level: str | None = None) -> TaskRecord | None:
    """The record of a built-in task (of ``level``), or None for any other name (a data file, rows in memory)."""
    record = TASKS.get(name)
    return record if record is not None and level in (None, record.level) else None


# A data file holds out its last min(128, rows // 5) rows (at least 1) unless --evaluation-examples is given.
DATA_FILE_PRESETS = dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0, max_new_tokens=128,
                         warmup_steps=0)


def generation_presets() -> dict[str, dict]:
    """Per-dataset defaults for the settings a run leaves unset; ``jsonl``: a data file's or rows in memory."""
    return {**{name: dict(TASKS[name].presets) for name in task_names("generation")}, "jsonl": dict(DATA_FILE_PRESETS)}


def gold_names() -> dict[str, str]:
    """``rlhf --gold`` name → its preference task."""
    return {record.gold_name: name for name, record in TASKS.items() if record.preference}


# --- the records -----------------------------------------------------------------------------------------

register(TaskRecord(
    name="arithmetic-smoke", level="candidate", about="embedded", tag="arithmetic",
    loader="auto_research.candidate.trainer:arithmetic_data"))
register(TaskRecord(
    name="gsm8k-candidate", level="candidate", about="GSM8K files", tag="gsm8k",
    loader="auto_research.candidate.trainer:gsm8k_data"))

# arithmetic-generate's presets were chosen so that its CPU demo learns within minutes (see README, "CPU demo").
ARITHMETIC_PRESETS = dict(steps=600, learning_rate=3e-4, prompts_per_step=32, temperature=1.5, max_new_tokens=6,
                          evaluation_examples=500, warmup_steps=10)
# Against a learned reward model (auto-research rlhf): shorter, with evaluations for the KL curves.
PREFERENCE_PRESETS = {**ARITHMETIC_PRESETS, "steps": 300, "eval_every": 50}

register(TaskRecord(
    name="arithmetic-generate", level="generation", about="two-number addition, embedded", embedded_model=True,
    presets=ARITHMETIC_PRESETS, loader="auto_research.data.tasks:load_arithmetic"))
register(TaskRecord(
    name="gsm8k-generate", level="generation", about="GSM8K questions, the final number checked",
    presets=dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0, max_new_tokens=256,
                 evaluation_examples=128, warmup_steps=10),
    loader="auto_research.data.tasks:load_gsm8k"))
register(TaskRecord(
    name="preference-generate", level="generation", about="arithmetic prompts, a hidden gold preference",
    embedded_model=True, presets=PREFERENCE_PRESETS, loader="auto_research.data.tasks:load_preference",
    gold="auto_research.rewards.gold:gold_scores", gold_name="length",
    gold_about="a preference for 4-character answers"))
register(TaskRecord(
    name="preference-arithmetic", level="generation", about="arithmetic prompts, the arithmetic partial credit as gold",
    embedded_model=True, presets=PREFERENCE_PRESETS, loader="auto_research.data.tasks:load_preference",
    gold="auto_research.rewards.gold:arithmetic_gold", gold_name="arithmetic",
    gold_about="the arithmetic partial credit"))
