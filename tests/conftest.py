"""Shared fixtures: GSM8K from ../shared/data (found from the repository root) and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
SHARED_DATA = REPOSITORY.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder holding gsm8k/{train,test}.jsonl. Missing data fails the test; it never skips."""
    for name in ("train.jsonl", "test.jsonl"):
        if not (SHARED_DATA / "gsm8k" / name).is_file():
            pytest.fail(
                f"GSM8K test data missing: {SHARED_DATA / 'gsm8k' / name} must exist "
                "(the shared folder beside the repository holds the official files)"
            )
    return SHARED_DATA


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m auto_research`` as a user would, in a separate process."""
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "auto_research", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
