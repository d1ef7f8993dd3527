"""Generation-level tasks: prompts, answers for the verifier, and demonstrations.

- ``arithmetic-generate``: procedural two-number addition, embedded (no download).
- ``gsm8k-generate``: GSM8K questions; the verifier checks the final number.
- a local JSONL file: ``--dataset PATH.jsonl --prompt-field F --answer-field G``; .json, .parquet,
  .csv files, ``save_to_disk`` folders and ``hf:owner/name`` hub datasets through Hugging Face datasets.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from auto_research.config.fields import HUB_DATASET, IN_MEMORY
from auto_research.data.gsm8k import ensure_gsm8k, read_gsm8k
from auto_research.data.rows import describe_json, iter_jsonl, load_rows, messages_field, text_field
from auto_research.data.types import Example, Task
from auto_research.errors import UserError
from auto_research.rewards.gold import GOLD_SCORERS, judge_of


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


def preference_task(name: str = "preference-generate") -> Task:
    """preference-generate (gold: 4-character answers) or preference-arithmetic (gold: the arithmetic
    partial credit): arithmetic prompts, a learned reward, and a hidden gold judge (rewards/gold.py)."""
    task = arithmetic_task()
    scorer = GOLD_SCORERS[name]
    what = "a preference for 4-character answers" if name == "preference-generate" else "the arithmetic partial credit"
    return replace(task, name=name, gold=scorer, gold_judge=judge_of(scorer), base="arithmetic-generate",
                   source=task.source + f"; gold: {what}, hidden from the learner")


# --- GSM8K -------------------------------------------------------------------------

CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def gsm8k_task(dataset_dir, offline: bool, maximum_examples: int | None, evaluation_examples: int | None) -> Task:
    directory = ensure_gsm8k(dataset_dir, offline)

    def examples(rows):
        out = []
        for row in rows:
            if row.gold is None:
                continue
            # Written out in full: "%g" would turn 1450000 into "1.45e+06", which reads back as 6.
            gold = str(int(row.gold)) if row.gold.is_integer() else repr(row.gold)
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


DEFAULT_HELD_OUT = 128
"""A JSONL dataset holds out its last min(128, rows // 5) rows unless --evaluation-examples says how many."""


def _answer_text(path, number: int, row: dict, name: str) -> str:
    """An answer may be text or a JSON number (written as Python prints it: 12, 0.5); nothing else."""
    value = row.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if name in row and not isinstance(value, str):
        raise UserError(f"{path}:{number}: field {name!r} is {describe_json(value)}, expected text or a number")
    return text_field(path, number, row, name)


def jsonl_task(path, prompt_field: str, answer_field: str, evaluation_examples: int | None = None,
               solution_field: str | None = None, verifier: str | None = None) -> Task:
    """Rows of a local JSONL file; the last ``evaluation_examples`` rows are held out (see ``rows_task``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    return rows_task(iter_jsonl(path), path, path.stem, str(path.resolve()), prompt_field, answer_field,
                     evaluation_examples, solution_field, verifier)


def rows_task(numbered_rows, where, name: str, source: str, prompt_field: str, answer_field: str,
              evaluation_examples: int | None = None, solution_field: str | None = None,
              verifier: str | None = None) -> Task:
    """(number, dict) rows → a task; the last ``evaluation_examples`` rows are held out.

    Prompts are JSON strings or conversations (lists of {role, content} messages); solutions strings; answers may be strings or numbers.
    Anything else (null, a list, an object) is refused with its row number rather
    than turned into text such as "None". ``where`` names the rows in messages.
    """
    rows = []
    for number, row in numbered_rows:
        if not isinstance(row, dict):
            raise UserError(f"{where}:{number}: expected a dict (a JSON object), got {type(row).__name__}")
        messages = messages_field(where, number, row, prompt_field)
        prompt = messages[-1]["content"] if messages else text_field(where, number, row, prompt_field)
        answer = _answer_text(where, number, row, answer_field)
        solution = text_field(where, number, row, solution_field) if solution_field else None
        rows.append(Example(prompt, answer, solution, row, messages))
    if len(rows) < 2:
        raise UserError(f"{where}: needs at least 2 rows (one to train on, one to evaluate), found {len(rows)}")
    if evaluation_examples is None:
        held = min(DEFAULT_HELD_OUT, max(1, len(rows) // 5))
    elif evaluation_examples >= len(rows):
        raise UserError(f"--evaluation-examples {evaluation_examples}: {where} has {len(rows)} rows, and at least one "
                        "must be left to train on")
    else:
        held = evaluation_examples
    return Task(name, rows[:-held], rows[-held:], rows[:-held], verifier=verifier or "match",
                source=f"{source} ({len(rows) - held} train, {held} held out)")


def load_task(config, rows: list[dict] | None = None) -> Task:
    """The configured generation-level task, with --maximum-examples and --evaluation-examples applied.

    ``rows`` are the dicts of an in-memory dataset (the Python API: ``config.dataset`` is
    ``memory:<name>``). Asking for more prompts than the dataset has is refused, never silently capped.
    """
    if config.dataset == "arithmetic-generate":
        task = arithmetic_task()
    elif config.dataset in ("preference-generate", "preference-arithmetic"):
        task = preference_task(config.dataset)
    elif config.dataset == "gsm8k-generate":
        task = gsm8k_task(config.dataset_dir, config.offline, config.maximum_examples, config.evaluation_examples)
    elif config.dataset.startswith(IN_MEMORY):
        if rows is None:
            raise UserError(f"dataset {config.dataset}: an in-memory dataset needs its rows (pass dataset=[...] to the "
                            "Python API's post_train)")
        task = rows_task(enumerate(rows, start=1), "rows", config.dataset_name, f"{len(rows)} rows in memory",
                         config.prompt_field or "prompt", config.answer_field or "answer", config.evaluation_examples,
                         verifier=config.verifier)
    elif config.dataset.endswith(".jsonl"):
        task = jsonl_task(config.dataset, config.prompt_field or "prompt", config.answer_field or "answer",
                          config.evaluation_examples, verifier=config.verifier)
    else:  # .json, .parquet, .csv, a save_to_disk folder, or hf:owner/name, through Hugging Face datasets
        source = config.dataset[len(HUB_DATASET):] if config.dataset.startswith(HUB_DATASET) else config.dataset
        loaded = load_rows(source, config.offline)
        task = rows_task(enumerate(loaded, start=1), config.dataset, config.dataset_name,
                         f"{source} ({len(loaded)} rows, read with datasets)", config.prompt_field or "prompt",
                         config.answer_field or "answer", config.evaluation_examples, verifier=config.verifier)
    for flag, wanted, available, what in (
        ("--maximum-examples", config.maximum_examples, len(task.train), "training prompts"),
        ("--evaluation-examples", config.evaluation_examples, len(task.evaluation), "held-out prompts"),
    ):
        if wanted is not None and wanted > available:
            raise UserError(f"{flag} {wanted}: {task.name} has {available} {what}")
    train = task.train[: config.maximum_examples]
    if not train:
        raise UserError(f"dataset {config.dataset}: no training prompts")
    return replace(task, train=train, evaluation=task.evaluation[: config.evaluation_examples])
