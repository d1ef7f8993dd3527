"""Atomic file writes: write beside the target, then rename over it.

A run killed half-way never leaves a half-written metrics.json or report behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from auto_research.errors import UserError


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, payload: object) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=2, allow_nan=False) + "\n")


def check_writable_directory(path: str | os.PathLike) -> Path:
    """Fail with one line unless ``path`` is, or could be created as, a writable folder.

    Creates nothing, so a run rejected for another reason leaves no trace; called
    before any work so that a run never computes for minutes and then fails to
    save its results.
    """
    path = Path(path)
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    problem = None
    if not ancestor.is_dir():
        problem = f"{ancestor} is not a folder"
    elif not os.access(ancestor, os.W_OK | os.X_OK):
        problem = f"no permission to write in {ancestor}"
    if problem:
        raise UserError(f"cannot write to output directory {str(path)!r}: {problem}")
    return path
