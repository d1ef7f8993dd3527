"""Adding an engine (docs/architecture.md, "Adding an engine"): an engine written in this file only, "echo-builtin"
(the builtin sampler, its pool and its served engine, each counting its calls), registered through
``AUTO_RESEARCH_ENGINES`` like any user's, trains colocated, in flight (--max-staleness 1, with and without
--in-flight-updates) and behind ``auto-research rollout-serve --engine echo-builtin``. No source file of the package
names it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from auto_research.engine import samplers
from auto_research.engine.rollout import eos_ids
from auto_research.engine.rollout.builtin import BuiltinEngine, BuiltinSampler
from auto_research.engine.rollout.partial import Pool, Rounds
from auto_research.engine.samplers import SamplerRecord, on_the_policy, server_record
from auto_research.user_code import REGISTRATIONS

NAME = "echo-builtin"
SPEC = f"{Path(__file__).stem}:register_echo"
"""What AUTO_RESEARCH_ENGINES names: this module (on the import path: pytest's, or PYTHONPATH) and its function."""
COUNTS_FILE = "ECHO_ENGINE_COUNTS"
"""Where a process running the engine (the rollout server) writes its counts after each call."""
CALLS: Counter = Counter()


def count(what: str) -> None:
    CALLS[what] += 1
    if os.environ.get(COUNTS_FILE):
        Path(os.environ[COUNTS_FILE]).write_text(json.dumps(CALLS))


# --- the engine: its module ------------------------------------------------------------------------------------


class EchoSampler(BuiltinSampler):
    """The engine in the trainer's process: the builtin sampler, counted."""

    def sample(self, prompts, group_size, seeds):
        count("sample")
        return super().sample(prompts, group_size, seeds)


class EchoPool(Pool):
    """Its continuous batch, for --in-flight-updates: the builtin one, each decode step counted."""

    def tick(self):
        count("tick")
        return super().tick()


def echo_pool(model, tokenizer, group_size, settings) -> EchoPool:
    return EchoPool(model, tokenizer, group_size, settings.max_new_tokens, settings.temperature, settings.top_k,
                    settings.top_p, eos_ids(tokenizer, model), tokenizer.pad_token_id or 0)


class EchoEngine(BuiltinEngine):
    """The engine behind a rollout server: its draws and its partial rollouts' rounds (over its own pool), counted."""

    def generate(self, *args, **named):
        count("generate")
        return super().generate(*args, **named)

    def rounds(self, group_size, settings) -> Rounds:
        count("rounds")
        return Rounds(echo_pool(self.model, self.tokenizer, group_size, settings))


def serve_echo(config, device, log):
    from auto_research.engine.rollout.serve import serve_builtin

    return serve_builtin(config, device, log, EchoEngine)


# --- its records, and the function AUTO_RESEARCH_ENGINES names ---------------------------------------------------

RECORDS = (SamplerRecord(NAME, "colocate", on_the_policy(EchoSampler), is_the_trainer=True, over_model=EchoSampler,
                         pool=echo_pool),
           server_record(NAME, serve_echo, chunked=True))


def register_echo() -> None:
    for record in RECORDS:
        samplers.register(record, "the builtin sampler, counted (tests/test_new_engine.py)")


# --- the tests ---------------------------------------------------------------------------------------------------

COMMON = ["post-train", "--dataset", "arithmetic-generate", "--steps", "2", "--prompts-per-step", "4",
          "--group-size", "4", "--max-new-tokens", "8", "--eval-every", "0", "--evaluation-examples", "4",
          "--no-progress", "--threads", "1", "--offline"]
TIMES = ("step_seconds", "tokens_per_second", "weight_sync_seconds", "weight_sync_bytes")


@pytest.fixture
def echo(monkeypatch):
    """AUTO_RESEARCH_ENGINES set for this test's commands; the registries as they were afterwards (the other files
    of this worker see the builtin engines only)."""
    monkeypatch.setenv(REGISTRATIONS, SPEC)
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    monkeypatch.delenv(COUNTS_FILE, raising=False)
    before = dict(samplers.SAMPLERS), dict(samplers.ENGINES)
    CALLS.clear()
    yield
    for registry, held in zip((samplers.SAMPLERS, samplers.ENGINES), before):
        registry.clear()
        registry.update(held)


def run(output: Path, *extra: str) -> list[dict]:
    """A two-step run's rows, without the times."""
    from auto_research.cli import main

    assert main([*COMMON, "--output-dir", str(output), *extra]) == 0
    lines = (next(output.iterdir()) / "metrics.jsonl").read_text().splitlines()
    return [{key: value for key, value in json.loads(line).items() if key not in TIMES and not key.startswith("time_")}
            for line in lines]


def test_a_registered_engine_trains_colocated_and_draws_what_the_builtin_draws(echo, tmp_path):
    rows = run(tmp_path / "echo", "--sampler", NAME)
    assert [row["step"] for row in rows] == [1, 2] and all(row["completions"] == 16 for row in rows)
    assert CALLS["sample"] == 2  # one batch a step, drawn by the engine
    assert f"sampler: {NAME}" in (next((tmp_path / "echo").iterdir()) / "config.yaml").read_text()
    assert rows == run(tmp_path / "builtin")  # the builtin sampler under another name: the same rows


@pytest.mark.parametrize("updates", [False, True], ids=["max-staleness-1", "in-flight-updates"])
def test_a_registered_engine_draws_in_flight(echo, tmp_path, updates):
    """--max-staleness 1: the engine over the side's copy of the policy (``over_model``); with --in-flight-updates,
    its pool decodes the continuous batch (``pool``). The same rows as the builtin engine's either way."""
    extra = ["--max-staleness", "1", *(["--in-flight-updates"] if updates else [])]
    rows = run(tmp_path / "echo", "--sampler", NAME, *extra)
    assert [row["staleness_max"] for row in rows] == [0, 1]
    assert CALLS["tick" if updates else "sample"] > 0 and CALLS["sample" if updates else "tick"] == 0
    assert rows == run(tmp_path / "builtin", *extra)


def test_a_registered_engine_is_served_by_rollout_serve_and_trains_a_run_through_it(echo, tmp_path):
    """``rollout-serve --engine echo-builtin`` in a process of its own (the module found through PYTHONPATH), then a
    run against it, and one with --max-staleness 1 --in-flight-updates, whose rounds run on the engine's pool."""
    counts = tmp_path / "counts.json"
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), COUNTS_FILE: str(counts), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "auto_research", "rollout-serve", "--engine", NAME, "--port", "0",
                               "--threads", "1", "--device", "cpu"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        said, found = [], None
        while found is None and (line := server.stdout.readline()):
            said.append(line)
            found = re.search(r"serving \S+ on http://(127\.0\.0\.1:\d+)", line)
        assert found, "".join(said)
        threading.Thread(target=server.stdout.read, daemon=True).start()  # its later lines never fill the pipe
        server_flags = ["--sampler", NAME, "--rollout-mode", "server", "--rollout-server", found.group(1)]
        rows = run(tmp_path / "served", *server_flags)
        assert [row["step"] for row in rows] == [1, 2]
        drawn = json.loads(counts.read_text())
        assert drawn["generate"] >= 2 and "tick" not in drawn
        rows = run(tmp_path / "partial", *server_flags, "--max-staleness", "1", "--in-flight-updates")
        assert [row["staleness_max"] for row in rows] == [0, 1]
        drawn = json.loads(counts.read_text())
        assert drawn["rounds"] == 1 and drawn["tick"] > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert CALLS == Counter()  # the trainer's process drew nothing itself: every draw was the server's


def test_an_unknown_engine_is_refused_in_one_line(echo, capsys, monkeypatch):
    from auto_research.cli import main

    def error(*args) -> str:
        assert main(list(args)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("auto-research: error: "), lines
        return lines[0][len("auto-research: error: "):]

    assert error(*COMMON, "--sampler", "nope") == f"--sampler 'nope': choose one of builtin, vllm, {NAME}"
    assert error("rollout-serve", "--engine", "nope") == f"--engine must be vllm or builtin or {NAME}, got 'nope'"
    monkeypatch.setenv(REGISTRATIONS, "no_such_engines:register")
    assert error("rollout-serve", "--engine", NAME).startswith(
        f"{REGISTRATIONS} 'no_such_engines:register': cannot import module 'no_such_engines'")
