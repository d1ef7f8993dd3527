"""GSM8K's official JSONL files at ``<dataset-dir>/gsm8k/{train,test}.jsonl``, read from disk or, when missing
and online, downloaded once, checked against their published sha256 and written atomically.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from auto_research.data.rows import iter_jsonl, text_field
from auto_research.errors import UserError

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"
"""Where the official files are published; ``AUTO_RESEARCH_GSM8K_URL`` overrides it (mirrors, tests)."""

GSM8K_SHA256 = {
    "train.jsonl": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    "test.jsonl": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
}

GOLD_PATTERN = re.compile(r"####\s*(-?[\d,]+(?:\.\d+)?)")


def gsm8k_dir(dataset_dir: str | os.PathLike) -> Path:
    return Path(dataset_dir) / "gsm8k"


def parse_gold(answer: str) -> float | None:
    """The number after ``####`` in a GSM8K answer, commas removed; None when absent."""
    match = GOLD_PATTERN.search(answer)
    return None if match is None else float(match.group(1).replace(",", ""))


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    gold: float | None
    line: int


def read_gsm8k(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """The first ``limit`` problems of a GSM8K JSONL file, in file order. A row whose answer has no ``####``
    number keeps its place with ``gold=None`` (the candidate protocol skips it but counts it)."""
    if limit is not None and limit <= 0:
        return []
    problems = []
    for number, row in itertools.islice(iter_jsonl(path), limit):
        question, answer = (text_field(path, number, row, key) for key in ("question", "answer"))
        problems.append(Problem(question, answer, parse_gold(answer), number))
    if not any(problem.gold is not None for problem in problems):
        what = "has no rows" if not problems else f"has no row with a '#### <number>' final answer among its first {len(problems)}"
        raise UserError(f"{path} {what}: GSM8K answers end with '#### <number>'")
    return problems


def ensure_gsm8k(dataset_dir: str | os.PathLike, offline: bool, base_url: str | None = None) -> Path:
    """Return ``<dataset_dir>/gsm8k``, downloading missing files unless offline."""
    directory = gsm8k_dir(dataset_dir)
    missing = [name for name in GSM8K_SHA256 if not (directory / name).is_file()]
    if missing and offline:
        raise UserError(f"GSM8K not found: {directory / missing[0]} does not exist (offline). Run "
                        f"'auto-research data gsm8k --dataset-dir {dataset_dir}' once online, or point "
                        "--dataset-dir or AUTO_RESEARCH_DATA at a folder holding gsm8k/train.jsonl and "
                        "gsm8k/test.jsonl")
    for name in missing:
        download_gsm8k_file(name, directory, base_url)
    return directory


def download_gsm8k_file(name: str, directory: Path, base_url: str | None = None) -> Path:
    """Download one official file to a temporary file beside the target; only a complete file whose sha256
    matches is renamed into place, so nothing partial is kept."""
    # Only here: the network modules load ssl, and tqdm is not free either; reading the files needs neither.
    import http.client
    import urllib.error
    import urllib.request

    from tqdm import tqdm

    base_url = (base_url or os.environ.get("AUTO_RESEARCH_GSM8K_URL") or GSM8K_URL).rstrip("/")
    url = f"{base_url}/{name}"
    target = directory / name
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create {directory}: {error.strerror or error}") from None
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".part")
    digest = hashlib.sha256()
    received = 0
    try:
        with os.fdopen(handle, "wb") as sink, urllib.request.urlopen(url, timeout=60) as response:
            expected_length = response.headers.get("Content-Length")
            total = int(expected_length) if expected_length and expected_length.isdigit() else None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"GSM8K {name}", leave=False) as bar:
                while chunk := response.read(1 << 16):
                    sink.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            if total is not None and received != total:
                raise UserError(f"download of {url} broke off after {received} of {total} bytes; nothing was kept, "
                                "try again")
        if digest.hexdigest() != GSM8K_SHA256[name]:
            raise UserError(f"download of {url} has sha256 {digest.hexdigest()}, expected {GSM8K_SHA256[name]}; "
                            "nothing was kept")
        os.replace(temporary, target)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        Path(temporary).unlink(missing_ok=True)
        reason = getattr(error, "reason", None) or error
        raise UserError(f"download of {url} failed after {received} bytes ({reason}); nothing was kept. "
                        "Try again, or use --offline with --dataset-dir pointing at a copy") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
