"""Dynamic sampling (--dynamic-sampling, train/dynamic.py): groups whose K scores are all equal never reach the
loss while refills last, each slot's refills are bounded and its own, and a run with it on repeats and resumes
exactly (in flight too)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from auto_research.engine.rollout import Rollout
from auto_research.train.dynamic import fill, has_signal, refill_index
from auto_research.train.rollouts import RolloutSource, produce, rollout_figures
from conftest import kill_after_checkpoint, largest_difference, rms_difference, run_cli


def test_a_group_has_signal_when_two_scored_values_differ():
    assert has_signal([1.0, 0.0, 1.0]) and has_signal([None, 0.0, 1.0])
    assert not has_signal([1.0, 1.0, 1.0]) and not has_signal([None, 1.0, None]) and not has_signal([None, None])


def test_each_slot_is_refilled_until_it_has_signal_or_its_refills_run_out():
    """Slots 0, 1, 2: slot 0 has signal at once; slot 2 finds it at refill 1, slot 1 at refill 2."""
    answers = {1: {1: [1, 1], 2: [0, 1]}, 2: {1: [0, 1]}}
    asked = []

    def sample_round(number, tries):
        asked.append((number, tries))
        return [answers[number][slot] for slot, _ in tries]

    filled = fill([0, 1, 2], [[1, 0], [1, 1], [0, 0]], sample_round, 4, lambda slot, number: 100 * slot + number)
    assert asked == [(1, [(1, 101), (2, 201)]), (2, [(1, 102)])]
    assert filled.chosen == [(0, 0), (2, 0), (1, 1)]  # (round, position in that round's batch)
    # sampled: 3 + 2 + 1 groups; without signal: 2 at first, then slot 1's first refill.
    assert (filled.groups_sampled, filled.no_signal_sampled, filled.refills, filled.trained_no_signal) == (6, 3, 3, 0)
    short = fill([0, 1, 2], [[1, 0], [1, 1], [0, 0]], sample_round, 1, lambda slot, number: 100 * slot + number)
    assert short.chosen == [(0, 0), (0, 1), (1, 1)] and short.trained_no_signal == 1  # slot 1 keeps its first group
    assert fill([0], [[1, 1]], sample_round, 0, None).chosen == [(0, 0)]  # no refills: the batch as drawn


def test_refill_prompts_depend_on_the_slot_not_on_the_process():
    assert refill_index(42, 3, 5, 1, 1000) == refill_index(42, 3, 5, 1, 1000)
    assert len({refill_index(42, 3, slot, 1, 10**6) for slot in range(8)}) == 8


class EchoSampler:
    """K completions per prompt: the prompt's own text, K times (so rewards can depend on the prompt)."""

    def sample(self, prompts, group_size, seeds):
        rows = len(prompts) * group_size
        ids = torch.tensor([[ord(p[0])] for p in prompts for _ in range(group_size)])
        return Rollout(torch.cat([ids, ids], dim=1), torch.ones(rows, 1, dtype=torch.long),
                       torch.ones(rows, 1, dtype=torch.long), [p for p in prompts for _ in range(group_size)],
                       group_size, torch.full((rows, 1), -0.5))


def test_groups_without_signal_never_reach_the_batch_and_the_rows_stay_aligned():
    """Prompts starting with 'x' always score 1 (no signal); the others score 0, 1, 0, 1. The step's batch keeps
    its size, every group in it has signal, and each row's prompt, completion and reward agree."""
    prompts = [f"{'x' if i % 2 else 'y'}{i}" for i in range(40)]

    def reward(prompts, completions, examples, tokens):
        return [1.0 if c.startswith("x") else float(k % 2) for k, c in enumerate(completions)]

    source = RolloutSource(prompts, list(range(40)), 7, 6, 4, lambda items: items, EchoSampler(), reward,
                           max_refills=8)
    drawn = produce(source, np.random.default_rng(0), 1, 0)
    K = 4
    groups = [drawn.rewards[i: i + K] for i in range(0, len(drawn.rewards), K)]
    assert len(groups) == 6 and all(has_signal(group) for group in groups)
    assert all(p.startswith("y") for p in drawn.batch.prompts)
    assert drawn.rollout.completions == [p for p in drawn.batch.prompts for _ in range(K)]
    assert drawn.batch.examples == [int(p[1:]) for p in drawn.batch.prompts]
    assert drawn.rollout.policy_versions.tolist() == [0] * 24
    counts = drawn.counts
    assert counts["trained_no_signal"] == 0 and counts["groups_sampled"] == 6 + counts["refills"]
    # A slot without signal tries refills until one has it: each failed try was one more group without signal,
    # and each slot's first group was one too, so as many groups went without signal as refills were sampled.
    first_without = sum(prompts[i].startswith("x") for i in _first_picks())
    assert first_without > 0 and counts["no_signal_sampled"] == counts["refills"] >= first_without

    class World:
        def gather(self, tensor):
            return tensor

        def total(self, tensor):
            return tensor

    figures = rollout_figures(World(), drawn, 1, dynamic=True)
    assert figures["trained_no_signal_fraction"] == 0.0 and figures["prompts_sampled"] == 6 + counts["refills"]
    assert figures["no_signal_fraction"] == counts["no_signal_sampled"] / counts["groups_sampled"]
    # Without refills the batch is the one drawn, groups without signal included, and they are counted.
    plain = produce(RolloutSource(prompts, list(range(40)), 7, 6, 4, lambda items: items, EchoSampler(), reward,
                                  max_refills=0), np.random.default_rng(0), 1, 0)
    assert [prompts[i] for i in _first_picks()] == plain.batch.prompts
    assert plain.counts["trained_no_signal"] == sum(p.startswith("x") for p in plain.batch.prompts) > 0


def _first_picks():
    return [int(i) for i in np.random.default_rng(0).choice(40, size=6, replace=False)]


REWARDS = """
def even_sums_are_easy(prompts, completions, rows):
    # A prompt whose answer is even scores 1 whatever the completion: its group has no signal.
    return [1.0 if int(row["answer"]) % 2 == 0 else float(sum(map(ord, c)) % 3) for c, row in zip(completions, rows)]
"""
TIMES = ("step_seconds", "tokens_per_second")


def _args(model, data, output, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "6", "--prompts-per-step", "4",
            "--group-size", "4", "--max-new-tokens", "4", "--learning-rate", "1e-2", "--evaluation-examples", "8",
            "--eval-every", "0", "--temperature", "1.0", "--offline", "--device", "cpu", "--no-progress",
            "--threads", "1", "--reward", "ds_rewards:even_sums_are_easy", "--output-dir", str(output),
            "--dynamic-sampling", "--max-refills", "3", "--checkpoint-every", "2", *extra]


def _rows(output):
    run = next(output.iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time_") and k not in TIMES} for row in rows]


def test_a_run_with_dynamic_sampling_in_flight_repeats_and_resumes_exactly(tiny_model_dir, sums_jsonl, tmp_path):
    (tmp_path / "ds_rewards.py").write_text(REWARDS)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                              os.environ.get("PYTHONPATH")]))}
    whole = run_cli(*_args(tiny_model_dir, sums_jsonl, tmp_path / "whole", "--max-staleness", "1"), env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]
    rows = _rows(tmp_path / "whole")
    assert len(rows) == 6
    assert all(row["refills"] <= 3 * 4 and row["prompts_sampled"] == 4 + row["refills"] for row in rows)
    assert any(row["refills"] > 0 for row in rows) and all(row["no_signal_fraction"] > 0 for row in rows
                                                          if row["refills"])
    assert all(row["trained_no_signal_fraction"] <= row["no_signal_fraction"] for row in rows)
    run = tmp_path / "cut" / "rloo-sums-seed42"
    kill_after_checkpoint(_args(tiny_model_dir, sums_jsonl, tmp_path / "cut", "--max-staleness", "1"),
                          {**os.environ, **env}, run / "checkpoints" / "step-000002")
    resumed = run_cli(*_args(tiny_model_dir, sums_jsonl, tmp_path / "cut", "--max-staleness", "1"), "--resume",
                      env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _rows(tmp_path / "cut") == rows
    final = load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    expected = load_file(str(tmp_path / "whole" / "rloo-sums-seed42" / "checkpoints" / "step-000006" /
                             "model.safetensors"))
    assert all(torch.equal(final[key], expected[key]) for key in expected)


def test_dynamic_sampling_refusals_are_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    from auto_research.cli import main

    def error(*extra) -> str:
        assert main(_args(tiny_model_dir, sums_jsonl, tmp_path, *extra)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    for value in ("-1", "65", "1000000"):
        assert error("--max-refills", value) == (f"--max-refills must be in 0..64 (each refill is a sampling round "
                                                 f"of the step), got {value}")
    assert error("--algorithm", "remax") == ("--dynamic-sampling with remax is not built (a refilled prompt would need "
                                             "its greedy baseline too)")


def test_two_processes_refill_the_same_slots_as_one(tiny_model_dir, sums_jsonl, tmp_path):
    """Each slot refills itself from its own seeds: 2 processes under DDP draw, refill and train on what 1 does."""
    import subprocess
    import sys

    (tmp_path / "ds_rewards.py").write_text(REWARDS)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    args = _args(tiny_model_dir, sums_jsonl, tmp_path / "one", "--steps", "3", "--micro-batch-size", "4")
    one = run_cli(*args, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two_args = [a if a != str(tmp_path / "one") else str(tmp_path / "two") for a in args]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "auto_research", *two_args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert sum(row["refills"] for row in rows_one) > 0
    for a, b in zip(rows_one, rows_two):
        assert (a["refills"], a["prompts_sampled"], a["no_signal_fraction"], a["reward_mean"]) == (
            b["refills"], b["prompts_sampled"], b["no_signal_fraction"], b["reward_mean"])
    final = {name: load_file(str(tmp_path / name / "rloo-sums-seed42" / "checkpoints" / "step-000003" /
                                 "model.safetensors")) for name in ("one", "two")}
    # Gradients summed in another order, which Adam lifts to up to lr in the odd element (an Intel Xeon ended one
    # 1.22e-5 apart); a fault (a slot refilled from other seeds, a rank's groups lost) moves most elements by ~lr
    # a step: RMS <= the largest lr stepped with / 10 (conftest.rms_difference).
    difference, bound = rms_difference(final["two"], final["one"]), max(row["learning_rate"] for row in rows_one) / 10
    print(f"weights' RMS difference from one process {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(final['two'], final['one']):.2e}")
    assert difference <= bound, (difference, bound)


def test_a_constant_reward_ends_each_step_after_its_bounded_refills_with_one_warning(tiny_model_dir, sums_jsonl,
                                                                                     tmp_path, monkeypatch, capsys):
    """No group ever has signal: each of the 2 slots takes its 8 refills (16 > 4 per slot), the step trains on its
    first groups, and the run warns once, not every step."""
    from auto_research.cli import main

    (tmp_path / "constant_reward.py").write_text("def one(prompts, completions, rows):\n"
                                                 "    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2",
                 "--prompts-per-step", "2", "--max-new-tokens", "2", "--evaluation-examples", "4", "--eval-every", "0",
                 "--offline", "--device", "cpu", "--no-progress", "--reward", "constant_reward:one",
                 "--dynamic-sampling", "--max-refills", "8", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "out" / "rloo-sums-seed42" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [(row["refills"], row["prompts_sampled"], row["no_signal_groups"], row["trained_no_signal_fraction"])
            for row in rows] == [(16, 18, 18, 1.0)] * 2
    assert err.count("warning: step 1 refilled 16 groups for 2 prompt slots, and 18 of the 18 groups sampled had no "
                     "signal (all K rewards equal): is the reward constant on most prompts? (--max-refills bounds it; "
                     "warned once per run)") == 1
    assert "step 2 refilled" not in err
