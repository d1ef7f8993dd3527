"""Hung environments (issue 52, item 3): the calls of different trajectories run at once, up to --env-concurrency,
so a step or the held-out evaluation waits one --env-timeout for a hung environment, not one per row; a wave of
calls that all ran past their limit stops the run in one line; the abandoned threads are counted and capped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from auto_research.data.types import Example
from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.tiny import build_tokenizer
from auto_research.envs import EnvironmentFactory
from auto_research.envs import deadline
from auto_research.envs.rollout import EpisodeRunner
from auto_research.errors import RewardError


@pytest.fixture
def release():
    """An event every hung call waits on; set at the end, so that the abandoned threads end with the test."""
    event = threading.Event()
    yield event
    event.set()


class Game:
    """Each call (making, reset, step) takes ``seconds``, or waits on ``release`` where ``hang`` says; counts the
    calls running at once."""

    running = peak = 0
    lock = threading.Lock()

    def __init__(self, row, hang=None, release=None, seconds=0.0):
        self.hang, self.release, self.seconds, self.row = hang, release, seconds, row
        self._call("make")

    def _call(self, where):
        with Game.lock:
            Game.running += 1
            Game.peak = max(Game.peak, Game.running)
        try:
            if where == self.hang:
                self.release.wait(60)
            time.sleep(self.seconds)
        finally:
            with Game.lock:
                Game.running -= 1

    def reset(self):
        self._call("reset")
        return None

    def step(self, text):
        self._call("step")
        return None, float(self.row["answer"]), True


def _runner(factory, concurrency):
    tokenizer = build_tokenizer()
    reply = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(prompt_ids, seeds, settings):
        return [list(reply) for _ in prompt_ids], [[-0.5] * len(reply) for _ in prompt_ids]

    return EpisodeRunner(generate, tokenizer, factory, {}, SamplingSettings(8), 3, 100, (tokenizer.eos_token_id,),
                         tokenizer.pad_token_id, concurrency=concurrency)  # --env-concurrency


EXAMPLES = [Example(f"{i}+1=", str(i + 1)) for i in range(4)]


def test_the_calls_of_a_phase_run_at_once_up_to_the_bound_and_give_what_one_at_a_time_gives():
    """16 trajectories whose every call takes 0.2 s, 4 at a time: at most (and at some moment) 4 calls run, the
    step() phase takes about 4 × 0.2 s, not 16 × 0.2 s, and the trajectories are those of one call at a time."""
    factory = EnvironmentFactory(lambda row: Game(row, seconds=0.2), "game", timeout=10.0)
    Game.peak = 0
    started = time.monotonic()
    together = _runner(factory, 4).trajectories(EXAMPLES, 4, [1, 2, 3, 4])
    seconds = time.monotonic() - started
    assert Game.peak == 4
    assert seconds < 3 * 4 * 0.2 + 1.0 < 3 * 16 * 0.2  # three phases (make, reset, step), each 4 waves
    Game.peak = 0
    alone = _runner(EnvironmentFactory(lambda row: Game(row), "game", timeout=10.0), 1).trajectories(
        EXAMPLES, 4, [1, 2, 3, 4])
    assert Game.peak == 1
    assert [(t.ids, t.loss_mask, t.reward, t.turns, t.failed) for t in together] == [
        (t.ids, t.loss_mask, t.reward, t.turns, t.failed) for t in alone]


@pytest.mark.parametrize("where, what", [("make", "make_env(row)"), ("reset", "reset()"), ("step", "step()")])
def test_a_phase_whose_every_call_hangs_stops_at_one_limit_whatever_the_rows(release, where, what):
    """64 trajectories whose every make_env, reset() or step() hangs, --env-timeout 0.5 s, 8 at a time: the
    first wave's 8 calls all time out and none answers, so the phase stops there, in one line naming the call
    and the limit (one limit, not 64 / 8 of them); the 8 threads are counted among those left running."""
    factory = EnvironmentFactory(lambda row: Game(row, where, release), "game", timeout=0.5)
    before = deadline.abandoned()
    started = time.monotonic()
    with pytest.raises(RewardError) as raised:
        _runner(factory, 8).trajectories(EXAMPLES * 4, 4, list(range(16)))
    assert time.monotonic() - started < 2 * 0.5 + 0.5
    assert isinstance(raised.value, deadline.Hung)
    assert re.fullmatch(rf"{re.escape(what)} hangs: the 8 calls made at once \(of 64\) all ran past --env-timeout "
                        r"0\.5 s and none answered, so the run stops rather than wait a limit for each of the rest; "
                        r"\d+ threads are left running", str(raised.value)), str(raised.value)
    assert before + 8 >= deadline.abandoned() >= 8  # counted; the other 56 calls were never made
    assert int(str(raised.value).split("; ")[-1].split()[0]) >= 8


def test_a_wave_with_a_call_that_answers_goes_on_the_hung_ones_failing_their_samples(release):
    """One trajectory of each group hangs in step(): those samples time out (unscored), the others answer."""
    class Some(Game):
        def step(self, text):
            if self.row["answer"] == "1":
                self.release.wait(60)
            return None, 1.0, True

    factory = EnvironmentFactory(lambda row: Some(row, release=release), "some", timeout=0.5)
    trajectories = _runner(factory, 8).trajectories(EXAMPLES, 2, [1, 2, 3, 4])
    assert [t.timed_out for t in trajectories] == ["environment"] * 2 + [None] * 6
    assert [t.reward for t in trajectories] == [None] * 2 + [1.0] * 6


HANGING = '''
import itertools, pathlib, time

HERE = pathlib.Path(__file__).parent
_steps = itertools.count()
ANSWERED = {answered}


class Game:
    def reset(self):
        return None
    def step(self, text):
        if next(_steps) >= ANSWERED:  # every later call hangs
            if not (HERE / "hung").exists():
                (HERE / "hung").write_text(repr(time.time()))
            time.sleep(600)
        return None, float(len(text) % 3), True


def make_env(row):
    return Game()
'''


def _hanging_run(tmp_path, tiny_model_dir, sums_jsonl, answered: int):
    """A run whose environment answers ``answered`` step() calls, then hangs in every one; (when its error line
    came, when the first call hung, its exit status, stderr)."""
    (tmp_path / "hanging.py").write_text(HANGING.format(answered=answered))
    args = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "3",
            "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "3", "--max-turns", "2",
            "--evaluation-examples", "8", "--eval-every", "0", "--offline", "--device", "cpu", "--threads", "1",
            "--environment", f"{tmp_path}/hanging.py:make_env", "--env-timeout", "2", "--checkpoint-every", "1",
            "--output-dir", str(tmp_path / "out")]
    process = subprocess.Popen([sys.executable, "-m", "auto_research", *args], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines, stopped = [], None
    try:
        for line in process.stderr:  # the error line's time: the process's own exit (its GC) is not the stop
            lines.append(line)
            if line.startswith("auto-research: error:") and stopped is None:
                stopped = time.time()
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    hung = float((tmp_path / "hung").read_text()) if (tmp_path / "hung").exists() else None
    return stopped, hung, process.returncode, "".join(lines)


def test_a_held_out_evaluation_whose_environment_hangs_stops_the_run_within_two_limits(tiny_model_dir, sums_jsonl,
                                                                                       tmp_path):
    """Every step() hangs from the first: the evaluation before training (8 rows, one call each) stops the run in
    one line within two --env-timeout of the first hung call (it waited 2 s per row, one row after another, then
    16 per step), and said what it was doing first."""
    stopped, hung, code, stderr = _hanging_run(tmp_path, tiny_model_dir, sums_jsonl, 0)
    assert code == 2, stderr[-3000:]
    assert hung is not None and stopped is not None and stopped - hung < 2 * 2 + 1, (stopped, hung)
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"auto-research: error: step\(\) hangs: the 8 calls made at once \(of 8\) all ran past "
                        r"--env-timeout 2 s and none answered, so the run stops rather than wait a limit for each "
                        r"of the rest; \d+ threads are left running \(evaluation before training\)", last), last
    assert "Traceback" not in stderr
    assert "evaluating the starting policy on 8 held-out prompts (greedy), before training" in stderr


def test_a_step_whose_environment_hangs_stops_the_run_within_two_limits_keeping_the_last_checkpoint(
        tiny_model_dir, sums_jsonl, tmp_path):
    """The evaluation (8 calls) and step 1 (16) answered, then every step() hangs: step 2 stops the run in one line
    within two --env-timeout of its first hung call, and step 1's checkpoint is kept."""
    stopped, hung, code, stderr = _hanging_run(tmp_path, tiny_model_dir, sums_jsonl, 8 + 16)
    assert code == 2, stderr[-3000:]
    assert hung is not None and stopped is not None and stopped - hung < 2 * 2 + 1, (stopped, hung)
    last = stderr.strip().splitlines()[-1]
    checkpoint = tmp_path / "out" / "rloo-sums-seed42" / "checkpoints" / "step-000001"
    assert last.startswith("auto-research: error: step() hangs: the 16 calls made at once (of 16) all ran past "
                           "--env-timeout 2 s and none answered"), last
    assert last.endswith(f"; saved the last good step (1) in {checkpoint}"), last
    assert (checkpoint / "trainer_state.json").is_file()
    rows = [json.loads(line) for line in (checkpoint.parent.parent / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]


def test_env_concurrency_is_checked(capsys):
    from auto_research.cli import main

    assert main(["post-train", "--dataset", "rows.jsonl", "--env-concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "auto-research: error: --env-concurrency must be >= 1 (1: one call at a time), got 0")
