"""Generation-level datasets: prompts, answers for the verifier, and demonstrations.

- ``arithmetic-generate``: procedural two-number addition, embedded (no download).
- ``gsm8k-generate``: GSM8K questions; the verifier checks the final number.
- a local JSONL file: ``--dataset PATH.jsonl --prompt-field F --answer-field G``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auto_research.errors import UserError


@dataclass(frozen=True)
class Example:
    prompt: str
    """The text the model is asked to continue (before any chat template)."""
    answer: str
    """What the verifier compares a completion against."""
    solution: str | None = None
    """A reference completion, for supervised fine-tuning."""
    fields: dict = field(default_factory=dict)
    """The dataset row as read, for user reward functions."""


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Example]
    """Prompts for RL (fresh: never among the demonstrations for arithmetic-generate)."""
    evaluation: list[Example]
    """Held-out prompts for greedy evaluation."""
    demonstrations: list[Example]
    """Prompt + solution pairs for supervised fine-tuning."""
    verifier: str
    """Name of the built-in reward that checks answers (see rewards.py)."""
    source: str


# --- arithmetic-generate ---------------------------------------------------------

ARITHMETIC_SPLIT_SEED = 0
ARITHMETIC_EVALUATION = 500
ARITHMETIC_DEMONSTRATIONS = 350


def arithmetic_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def arithmetic_answer(a: int, b: int) -> str:
    """The sum written least-significant digit first, as column addition produces it.

    Reversed digits let a left-to-right model write each digit from two input
    digits and a carry, which a tiny model can learn; exact match is on this text.
    """
    return str(a + b)[::-1]


def arithmetic_task() -> Task:
    """All 10,000 sums a + b with 0 ≤ a, b ≤ 99, split once by a fixed seed.

    500 are held out for evaluation, 350 are the only demonstrations a warm
    start may see, and RL draws its prompts from the other 9,150.
    """
    pairs = np.array([(a, b) for a in range(100) for b in range(100)])
    np.random.default_rng(ARITHMETIC_SPLIT_SEED).shuffle(pairs)
    examples = [
        Example(arithmetic_prompt(a, b), arithmetic_answer(a, b), arithmetic_answer(a, b), {"a": int(a), "b": int(b)})
        for a, b in pairs.tolist()
    ]
    held_out = examples[:ARITHMETIC_EVALUATION]
    demonstrations = examples[ARITHMETIC_EVALUATION : ARITHMETIC_EVALUATION + ARITHMETIC_DEMONSTRATIONS]
    train = examples[ARITHMETIC_EVALUATION + ARITHMETIC_DEMONSTRATIONS :]
    return Task(
        "arithmetic-generate",
        train,
        held_out,
        demonstrations,
        verifier="arithmetic",
        source=f"embedded arithmetic (split seed {ARITHMETIC_SPLIT_SEED}): {len(train)} RL prompts, "
        f"{len(demonstrations)} demonstrations, {len(held_out)} held out",
    )


# --- GSM8K -------------------------------------------------------------------------

CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def gsm8k_task(dataset_dir, offline: bool, maximum_examples: int, evaluation_examples: int) -> Task:
    from auto_research.post_training.datasets import ensure_gsm8k, read_gsm8k

    directory = ensure_gsm8k(dataset_dir, offline)

    def examples(rows):
        out = []
        for row in rows:
            if row.gold is None:
                continue
            gold = f"{row.gold:g}"
            # The official solutions end with "#### <number>"; calculator annotations are dropped.
            solution = " " + CALCULATOR_ANNOTATION.sub("", row.answer).strip()
            out.append(Example(gsm8k_prompt(row.question), gold, solution, {"question": row.question, "answer": row.answer}))
        return out

    train = examples(read_gsm8k(directory / "train.jsonl", maximum_examples))
    evaluation = examples(read_gsm8k(directory / "test.jsonl", evaluation_examples))
    return Task(
        "gsm8k-generate",
        train,
        evaluation,
        train,
        verifier="gsm8k",
        source=f"GSM8K {directory.resolve()} (train first {len(train)}, test first {len(evaluation)})",
    )


# --- a user's JSONL ---------------------------------------------------------------------


def jsonl_task(path, prompt_field: str, answer_field: str, evaluation_examples: int, solution_field: str | None = None) -> Task:
    """Rows of a local JSONL file; the last ``evaluation_examples`` rows are held out."""
    from auto_research.post_training.datasets import iter_jsonl

    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    rows = []
    for number, row in iter_jsonl(path):
        for name in (prompt_field, answer_field) + ((solution_field,) if solution_field else ()):
            if name not in row:
                raise UserError(f"{path}:{number}: row has no field {name!r} (fields: {', '.join(row) or 'none'})")
        solution = str(row[solution_field]) if solution_field else None
        rows.append(Example(str(row[prompt_field]), str(row[answer_field]), solution, row))
    if len(rows) < 2:
        raise UserError(f"{path}: needs at least 2 rows (one to train on, one to evaluate), found {len(rows)}")
    held = min(evaluation_examples, max(1, len(rows) // 5))
    return Task(path.stem, rows[:-held], rows[-held:], rows[:-held], verifier="match", source=f"{path.resolve()} ({len(rows) - held} train, {held} held out)")
