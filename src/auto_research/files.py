"""Atomic file writes: write beside the target, then rename over it, so a run killed half-way never leaves a
half-written file. ``tempfile``'s private modes (0600, 0700) become the user's umask's before the rename."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

from auto_research.errors import UserError


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_shareable(path: str | os.PathLike) -> None:
    """Give a file made by ``tempfile`` (0600) or a folder (0700) the mode a plain ``open``/``mkdir`` would."""
    mode = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, mode & ~_umask())


def make_tree_shareable(folder: str | os.PathLike) -> None:
    """``make_shareable`` for a folder and everything in it (libraries that write files privately included)."""
    for path in [Path(folder), *Path(folder).rglob("*")]:
        make_shareable(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, private: bool = False) -> Path:
    """``private``: the file keeps ``tempfile``'s mode 0600 (a secret), else it gets the umask's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        if not private:
            make_shareable(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def finite_or_null(value: object) -> object:
    """``value`` with every NaN and ±inf float in it (at any depth) replaced by None: JSON has no NaN, and a figure
    that could not be computed must not lose the run's other figures to a ``ValueError``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def json_text(payload: object, indent: int | None = None) -> str:
    """The one JSON encoding of everything a run writes (``finite_or_null``, then strict JSON)."""
    return json.dumps(finite_or_null(payload), indent=indent, allow_nan=False)


def atomic_write_json(path: str | os.PathLike, payload: object) -> Path:
    return atomic_write_text(path, json_text(payload, indent=2) + "\n")


def append_json_lines(path: str | os.PathLike, rows: list) -> None:
    """Rows appended to a JSON-lines file (metrics.jsonl, completions.jsonl), one ``json_text`` a line."""
    with Path(path).open("a") as stream:
        stream.write("".join(json_text(row) + "\n" for row in rows))


def check_writable_directory(path: str | os.PathLike) -> Path:
    """Fail with one line unless ``path`` is, or could be created as, a writable folder: before any work, so a run
    never computes for minutes and then fails to save. Creates nothing."""
    path = Path(path)
    ancestor = path
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    problem = (f"{ancestor} is not a folder" if not ancestor.is_dir() else f"no permission to write in {ancestor}"
               if not os.access(ancestor, os.W_OK | os.X_OK) else None)
    if problem:
        raise UserError(f"cannot write to output directory {str(path)!r}: {problem}")
    return path


def sha256_of(path: Path) -> str:
    """The file's sha256, read a megabyte at a time."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
