"""Reading rows into dicts, with one-line errors: JSON Lines line by line here (so a bad row is named by its line
number), every other format through Hugging Face ``datasets``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from auto_research.errors import UserError, one_line

DATA_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""The data files a --dataset may name, each suffix → the ``datasets`` builder that reads it (a task reads .jsonl
itself, with ``iter_jsonl``, so that its messages name the line)."""
HUB_DATASET = "hf:"
"""Prefix of a Hugging Face hub dataset's name (``hf:owner/name``: online)."""
IN_MEMORY = "memory:"
"""Prefix of an in-memory dataset's name (the Python API: rows passed as a list of dicts)."""


def data_file_kinds() -> str:
    """``.jsonl, .json, .parquet or .csv``: the data files' suffixes, for messages and help texts."""
    *rest, last = DATA_FILE_KINDS
    return f"{', '.join(rest)} or {last}"


def iter_jsonl(path: str | os.PathLike):
    """(line number, object) for each non-blank line of a JSONL file; a bad line is a UserError naming it."""
    path = Path(path)
    try:
        stream = path.open("rb")
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    with stream:
        for number, raw in enumerate(stream, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column "
                                f"{error.start + 1}); JSONL files must be UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


JSON_TYPES = {dict: "an object", list: "a list", str: "text", bool: "true/false", int: "a number", float: "a number",
              type(None): "null"}


def describe_json(value) -> str:
    """How a JSON value reads to a user: 'a number', 'null', 'a list' …"""
    return JSON_TYPES.get(type(value), type(value).__name__)


def missing_field(path, number: int, row: dict, name: str, hint: str = "") -> UserError:
    """The one line for a row without the field ``name``: the row's fields, and ``hint`` (which flag names it)."""
    return UserError(f"{path}:{number}: row has no field {name!r} (fields: {', '.join(map(str, row)) or 'none'})"
                     + (f"; {hint}" if hint else ""))


def text_field(path, number: int, row: dict, name: str, hint: str = "") -> str:
    """``row[name]`` as text, else a UserError naming the line (``hint``: how to name another field)."""
    if name not in row:
        raise missing_field(path, number, row, name, hint)
    value = row[name]
    if not isinstance(value, str):
        raise UserError(f"{path}:{number}: field {name!r} is {describe_json(value)} ({json.dumps(value)[:40]}), expected text")
    return value


def load_rows(dataset: str, offline: bool) -> list[dict]:
    """Rows of a dataset through Hugging Face ``datasets``: a data file (``DATA_FILE_KINDS``), a folder written by
    ``save_to_disk``, or a hub name when online."""
    path = Path(dataset).expanduser()
    try:
        # Imported here, not at the top: datasets takes about a second to import, and only these formats need it.
        import datasets
    except ImportError:
        raise UserError("reading this dataset needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        elif path.suffix in DATA_FILE_KINDS:
            if not path.is_file():
                raise UserError(f"--dataset {dataset}: no such file")
            if not path.read_bytes().strip():
                return []
            loaded = datasets.load_dataset(DATA_FILE_KINDS[path.suffix], data_files=str(path), split="train")
        elif path.exists():
            raise UserError(f"--dataset {dataset}: give a {data_file_kinds()} file, or a save_to_disk folder")
        else:
            if offline:
                raise UserError(f"--dataset {dataset}: no such file or folder, and hub datasets need a connection (offline)")
            loaded = datasets.load_dataset(dataset, split="train")
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - malformed files surface as many types
        raise UserError(f"--dataset {dataset}: cannot read ({one_line(error)})") from None
    return [dict(row) for row in loaded]


def messages_field(path, number: int, row: dict, name: str) -> tuple[dict, ...] | None:
    """``row[name]`` as a conversation (TRL's conversational format: a list of ``{"role", "content"}`` messages,
    both strings), or None when it is text; anything else is a UserError naming the line."""
    value = row.get(name)
    if not isinstance(value, list):
        return None
    if not value:
        raise UserError(f"{path}:{number}: field {name!r} is an empty list; a conversational prompt is a list of "
                        '{"role": ..., "content": ...} messages')
    for index, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise UserError(f"{path}:{number}: field {name!r} message {index} is {json.dumps(message)[:60]}; a "
                            'conversational prompt is a list of {"role": ..., "content": ...} messages (strings)')
    return tuple({"role": message["role"], "content": message["content"]} for message in value)
