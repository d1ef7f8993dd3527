"""Generation-level tasks (prompts, answers for the verifier, demonstrations): the built-in ones, loaded by their
records' loaders (data/registry.py), and the user's rows (a data file, a hub dataset, rows in memory).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from auto_research.data.gsm8k import ensure_gsm8k, read_gsm8k
from auto_research.data.registry import TaskRecord, task_record
from auto_research.data.rows import (HUB_DATASET, IN_MEMORY, describe_json, iter_jsonl, load_rows, messages_field,
                                     missing_field, text_field)
from auto_research.data.types import Example, Task
from auto_research.errors import UserError
from auto_research.rewards.gold import judge_of
from auto_research.rewards.verifiers import BUILT_IN, SCORES_ALONE


# --- arithmetic-generate ---------------------------------------------------------

ARITHMETIC_SPLIT_SEED = 0
ARITHMETIC_EVALUATION = 500
ARITHMETIC_DEMONSTRATIONS = 350


def arithmetic_answer(a: int, b: int) -> str:
    """The sum written least-significant digit first, as column addition produces it: a left-to-right model then
    writes each digit from two input digits and a carry, which a tiny model can learn."""
    return str(a + b)[::-1]


def arithmetic_task() -> Task:
    """All 10,000 sums a + b with 0 ≤ a, b ≤ 99, split once by a fixed seed: 500 held out, 350 the only
    demonstrations a warm start may see, the other 9,150 RL's prompts."""
    pairs = np.array([(a, b) for a in range(100) for b in range(100)])
    np.random.default_rng(ARITHMETIC_SPLIT_SEED).shuffle(pairs)
    examples = [Example(f"{a}+{b}=", arithmetic_answer(a, b), arithmetic_answer(a, b), {"a": int(a), "b": int(b)})
                for a, b in pairs.tolist()]
    held_out = examples[:ARITHMETIC_EVALUATION]
    demonstrations = examples[ARITHMETIC_EVALUATION : ARITHMETIC_EVALUATION + ARITHMETIC_DEMONSTRATIONS]
    train = examples[ARITHMETIC_EVALUATION + ARITHMETIC_DEMONSTRATIONS :]
    return Task("arithmetic-generate", train, held_out, demonstrations, verifier="arithmetic",
                source=f"embedded arithmetic (split seed {ARITHMETIC_SPLIT_SEED}): {len(train)} RL prompts, "
                       f"{len(demonstrations)} demonstrations, {len(held_out)} held out")


def preference_task(name: str = "preference-generate") -> Task:
    """A preference task: arithmetic prompts, a learned reward, and a hidden gold judge (its record's gold scorer).
    It starts from arithmetic-generate's warm-started model (``base``)."""
    record = task_record(name, "generation")
    task = arithmetic_task()
    scorer = record.gold_scorer()
    return replace(task, name=name, gold=scorer, gold_judge=judge_of(scorer), base=task.name,
                   source=task.source + f"; gold: {record.gold_about}, hidden from the learner")


# --- GSM8K -------------------------------------------------------------------------

CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")


def gsm8k_task(dataset_dir, offline: bool, maximum_examples: int | None, evaluation_examples: int | None) -> Task:
    directory = ensure_gsm8k(dataset_dir, offline)

    def example(row) -> Example:
        # Written out in full: "%g" would turn 1450000 into "1.45e+06", which reads back as 6.
        gold = str(int(row.gold)) if row.gold.is_integer() else repr(row.gold)
        # The official solutions end with "#### <number>"; calculator annotations are dropped.
        solution = " " + CALCULATOR_ANNOTATION.sub("", row.answer).strip()
        return Example(f"Question: {row.question.strip()}\nAnswer:", gold, solution,
                       {"question": row.question, "answer": row.answer})

    train = [example(row) for row in read_gsm8k(directory / "train.jsonl", maximum_examples) if row.gold is not None]
    evaluation = [example(row) for row in read_gsm8k(directory / "test.jsonl", evaluation_examples)
                  if row.gold is not None]
    return Task("gsm8k-generate", train, evaluation, train, verifier="gsm8k",
                source=f"GSM8K {directory.resolve()} (train first {len(train)}, test first {len(evaluation)})")


# --- a user's JSONL ---------------------------------------------------------------------


DEFAULT_HELD_OUT = 128
"""A JSONL dataset holds out its last min(128, rows // 5) rows (at least 1) unless --evaluation-examples says how many."""

PROMPT_FIELDS = ("prompt", "messages")
"""Where a row's prompt is found when --prompt-field names none, the first that the first row has: TRL's prompt
column (text, or a conversation), else a ``messages`` conversation (``conversation_prompt``)."""
ANSWER_FIELD = "answer"
NO_ANSWERS = "none"
"""--answer-field none: the rows have no answers (reward-only data); the user's rewards score completions alone."""
NO_ANSWERS_WHY = f"the first row has no {ANSWER_FIELD!r} field, or --answer-field {NO_ANSWERS}"


def _answer_text(path, number: int, row: dict, name: str, hint: str) -> str:
    """An answer may be text or a JSON number (written as Python prints it: 12, 0.5); nothing else."""
    value = row.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if name in row and not isinstance(value, str):
        raise UserError(f"{path}:{number}: field {name!r} is {describe_json(value)}, expected text or a number")
    return text_field(path, number, row, name, hint)


def conversation_prompt(path, number: int, messages: tuple[dict, ...]) -> tuple[tuple[dict, ...], str | None]:
    """A ``messages`` conversation's prompt and reply: the messages up to its last user turn, and the assistant
    turn that follows it (None when there is none), a demonstration for ``sft``. As in TRL, the model writes the
    turn after the last user message; what the data holds from there on is the reference reply, not prompt."""
    last_user = max((index for index, message in enumerate(messages) if message["role"] == "user"), default=None)
    if last_user is None:
        raise UserError(f"{path}:{number}: field 'messages' has no user message; its prompt is the conversation up "
                        "to the last user turn")
    after = messages[last_user + 1:]
    reply = after[0]["content"] if after and after[0]["role"] == "assistant" else None
    return messages[:last_user + 1], reply


class _Fields(NamedTuple):
    """A dataset's prompt and answer fields (answer None: no answers), and the hint each one's missing-field line
    gives."""
    prompt: str
    answer: str | None
    prompt_hint: str
    answer_hint: str


def _fields(where, number: int, row: dict, prompt_field: str | None, answer_field: str | None) -> _Fields:
    """The fields, named by the flags or found in the first row."""
    found = prompt_field or next((name for name in PROMPT_FIELDS if name in row), None)
    prompt_hint = ("the prompt is found in 'prompt' or 'messages', or name it with --prompt-field" if prompt_field
                   is None else "--prompt-field names the prompt's field")
    if found is None:
        raise missing_field(where, number, row, PROMPT_FIELDS[0], prompt_hint)
    if answer_field == NO_ANSWERS or (answer_field is None and ANSWER_FIELD not in row):
        return _Fields(found, None, prompt_hint, "")
    answer_hint = ("the first row has an answer, so every row needs one (--answer-field none: rows without "
                   "answers)" if answer_field is None else
                   "--answer-field names the answer's field (none: rows without answers)")
    return _Fields(found, answer_field or ANSWER_FIELD, prompt_hint, answer_hint)


def _example(where, number: int, row: dict, fields: _Fields, solution_field: str | None) -> Example:
    if fields.prompt not in row:
        raise missing_field(where, number, row, fields.prompt, fields.prompt_hint)
    messages = messages_field(where, number, row, fields.prompt)
    solution = text_field(where, number, row, solution_field) if solution_field else None
    if messages and fields.prompt == "messages":
        messages, reply = conversation_prompt(where, number, messages)
        solution = solution or reply
    prompt = messages[-1]["content"] if messages else text_field(where, number, row, fields.prompt)
    answer = _answer_text(where, number, row, fields.answer, fields.answer_hint) if fields.answer else None
    return Example(prompt, answer, solution, row, messages)


def jsonl_task(path, prompt_field: str | None, answer_field: str | None, evaluation_examples: int | None = None,
               solution_field: str | None = None, verifier: str | None = None) -> Task:
    """Rows of a local JSONL file; the last ``evaluation_examples`` rows are held out (see ``rows_task``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    return rows_task(iter_jsonl(path), path, path.stem, str(path.resolve()), prompt_field, answer_field,
                     evaluation_examples, solution_field, verifier)


def rows_task(numbered_rows, where, name: str, source: str, prompt_field: str | None, answer_field: str | None,
              evaluation_examples: int | None = None, solution_field: str | None = None,
              verifier: str | None = None) -> Task:
    """(number, dict) rows → a task; the last ``evaluation_examples`` rows are held out. A value of the wrong
    type (null, a list) is refused with its row number rather than turned into text such as "None". Rows without
    answers (``answer_field`` "none", or no ``answer`` in the first row) make a task whose ``verifier`` is None."""
    rows, fields = [], None
    for number, row in numbered_rows:
        if not isinstance(row, dict):
            raise UserError(f"{where}:{number}: expected a dict (a JSON object), got {type(row).__name__}")
        fields = fields or _fields(where, number, row, prompt_field, answer_field)
        rows.append(_example(where, number, row, fields, solution_field))
    if len(rows) < 2:
        raise UserError(f"{where}: needs at least 2 rows (one to train on, one to evaluate), found {len(rows)}")
    if evaluation_examples is not None and evaluation_examples >= len(rows):
        raise UserError(f"--evaluation-examples {evaluation_examples}: {where} has {len(rows)} rows, and at least one "
                        "must be left to train on")
    held = min(DEFAULT_HELD_OUT, max(1, len(rows) // 5)) if evaluation_examples is None else evaluation_examples
    answered = fields.answer is not None
    if verifier is not None and not answered:
        raise UserError(f"--verifier {verifier} judges answers, and the rows of {where} have none ({NO_ANSWERS_WHY})")
    return Task(name, rows[:-held], rows[-held:], rows[:-held], verifier=(verifier or "match") if answered else None,
                source=f"{source} ({len(rows) - held} train, {held} held out"
                       + ("" if answered else "; no answers: rewards score completions alone") + ")")


def check_answers(task: Task, rewards: list, reward_model: str | None, scored_elsewhere: bool,
                  task_reward: bool = True) -> None:
    """Rows without answers run when nothing needs an answer (``scored_elsewhere``: an environment or rollout
    function; ``task_reward`` False: opd); a built-in verifier reward, named or the default, is refused."""
    if task.verifier is not None:
        return
    needing = [name for name, _, user in rewards if not user and name in BUILT_IN and name not in SCORES_ALONE]
    if needing:
        raise UserError(f"--reward {needing[0]} compares completions with the rows' answers, and {task.name} has "
                        f"none ({NO_ANSWERS_WHY}); give --answer-field, or rewards that score completions alone")
    if not rewards and not reward_model and not scored_elsewhere and task_reward:
        raise UserError(f"{task.name} has no answers ({NO_ANSWERS_WHY}), so the default reward, its verifier, "
                        "has nothing to compare with: give --reward module:function, --reward-model or --reward-url "
                        "(or --answer-field, or --algorithm opd --teacher-model)")


TEACHER_COLUMN = "teacher"
"""With several --teacher-model NAME=SOURCE entries, each training row names the teacher that scores it here."""


def row_teacher(example, names) -> str:
    """The teacher that scores ``example``'s completions: the only one, else its ``teacher`` column's."""
    return next(iter(names)) if len(names) == 1 else str(example.fields.get(TEACHER_COLUMN))


def check_teacher_column(task: Task, teachers: dict) -> None:
    """Several teachers: every training row's ``teacher`` column names one of them, else one line naming the row."""
    if len(teachers) < 2:
        return
    for index, example in enumerate(task.train):
        if row_teacher(example, teachers) not in teachers:
            given = example.fields.get(TEACHER_COLUMN)
            raise UserError(f"{task.name}: training row {index + 1} "
                            + (f"has no '{TEACHER_COLUMN}' column" if given is None else f"names teacher {given!r}")
                            + f", and several --teacher-model entries need one of {', '.join(teachers)} in it")


# --- the records' loaders: (record, settings) → Task -------------------------------------------------------


def load_arithmetic(record: TaskRecord, settings) -> Task:
    return arithmetic_task()


def load_preference(record: TaskRecord, settings) -> Task:
    return preference_task(record.name)


def load_gsm8k(record: TaskRecord, settings) -> Task:
    return gsm8k_task(settings.dataset_dir, settings.offline, settings.maximum_examples, settings.evaluation_examples)


def load_task(data, rows: list[dict] | None = None) -> Task:
    """The run's generation-level task (``data``: its ``DataSection``), with --maximum-examples and
    --evaluation-examples applied: more than the dataset has is refused, never capped. ``rows``: an in-memory
    dataset's dicts (``memory:<name>``)."""
    record, dataset = task_record(data.dataset, "generation"), data.dataset
    fields = (data.prompt_field, data.answer_field, data.evaluation_examples)
    if record is not None:
        task = record.load(data)
    elif dataset.startswith(IN_MEMORY):
        if rows is None:
            raise UserError(f"dataset {dataset}: an in-memory dataset needs its rows (pass dataset=[...] to the "
                            "Python API's post_train)")
        task = rows_task(enumerate(rows, start=1), "rows", data.name, f"{len(rows)} rows in memory", *fields,
                         verifier=data.verifier)
    elif dataset.endswith(".jsonl"):
        task = jsonl_task(dataset, *fields, verifier=data.verifier)
    else:  # .json, .parquet, .csv, a save_to_disk folder, or hf:owner/name, through Hugging Face datasets
        source = dataset[len(HUB_DATASET):] if dataset.startswith(HUB_DATASET) else dataset
        loaded = load_rows(source, data.offline)
        task = rows_task(enumerate(loaded, start=1), dataset, data.name,
                         f"{source} ({len(loaded)} rows, read with datasets)", *fields, verifier=data.verifier)
    for flag, wanted, available, what in (
        ("--maximum-examples", data.maximum_examples, len(task.train), "training prompts"),
        ("--evaluation-examples", data.evaluation_examples, len(task.evaluation), "held-out prompts"),
    ):
        if wanted is not None and wanted > available:
            raise UserError(f"{flag} {wanted}: {task.name} has {available} {what}")
    train = task.train[: data.maximum_examples]
    if not train:
        raise UserError(f"dataset {dataset}: no training prompts")
    return replace(task, train=train, evaluation=task.evaluation[: data.evaluation_examples])
