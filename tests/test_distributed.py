"""torchrun on the CPU (gloo): 2 processes end where 1 process ends, with DDP and with FSDP2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import largest_difference, rms_difference, run_cli

REWARDS = '''
import os

def checksum(prompts, completions, rows):
    # Differs between almost any two completions: every group carries a learning signal.
    return [float(sum(map(ord, c)) % 5) for c in completions]

def slow_checksum(prompts, completions, rows):
    import time
    time.sleep(0.4)
    return checksum(prompts, completions, rows)

def fails_on_rank_one(prompts, completions, rows):
    if os.environ.get("RANK") == "1":
        raise ValueError("rank one's reward is broken")
    return checksum(prompts, completions, rows)

class Halves:
    """conftest.py's Sums game (GAME) with another end: about half of all replies (an even checksum) end it, so
    trajectories end after different numbers of turns, on each rank."""
    def __init__(self, row):
        pass
    def reset(self):
        return None
    def step(self, text):
        if sum(map(ord, text)) % 2 == 0:
            return None, 1.0, True
        return "no", 0.0, False

def make_env(row):
    return Halves(row)

def one_draw(rows, context):
    """One completion a row from the run's sampler, every token the model's; nothing at all on rank 1."""
    if os.environ.get("RANK") == "1":
        return []
    prompts = [context.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    ids, logprobs = context.generate(prompts, list(context.seeds))
    return [{"prompt_ids": p, "completion_ids": i, "logprobs": l, "loss_mask": [1] * len(i), "reward": float(len(i))}
            for p, i, l in zip(prompts, ids, logprobs)]
'''


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "dist_rewards.py").write_text(textwrap.dedent(REWARDS))
    return tmp_path


# --warmup-steps 10: a data file's preset warmup until it became none. The bounds on how far one process's
# numbers may be from two processes' (fp32 sums in another order, grown by each update) were set under it.
def _args(model, data, output, *extra, reward="checksum"):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--reward", f"dist_rewards:{reward}",
            "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4",
            "--learning-rate", "1e-2", "--evaluation-examples", "8", "--offline", "--device", "cpu", "--no-progress",
            "--threads", "1", "--micro-batch-size", "4", "--warmup-steps", "10", "--output-dir", str(output), *extra]


def _torchrun(args, cwd, processes=2, **options):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "auto_research", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, **options)


def _final(output: Path, name: str = "model.safetensors") -> dict:
    run = next(output.iterdir())
    return load_file(str(sorted((run / "checkpoints").iterdir())[-1] / name))


def _bounded(got: dict, expected: dict, bound: float, what: str) -> None:
    """N processes against 1: gradients summed in another order, which Adam lifts to up to lr in the odd element
    (which element, and how far, depends on the CPU's kernels); a fault (a rank's gradient left out, other samples,
    a missed step) moves most elements by ~lr a step. So the RMS over every element is bounded, by a tenth of the
    largest learning rate the run stepped with (``bound``; conftest.rms_difference)."""
    difference = rms_difference(got, expected)
    print(f"{what}: weights' RMS difference from one process {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(got, expected):.2e}")
    assert difference <= bound, (what, difference, bound)


def _rows(output: Path) -> list[dict]:
    run = next(output.iterdir())
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# PPO takes 4 Adam updates a step: Adam divides each gradient element by its own running magnitude,
# which lifts rounding in near-zero elements to the step size, so it runs at a smaller learning rate.
@pytest.mark.parametrize("algorithm, extra", [
    ("rloo", ()),
    ("ppo-rlhf", ("--ppo-mini-batches", "2", "--ppo-epochs", "2", "--learning-rate", "1e-3")),
    ("rloo", ("--lora-r", "4")),
    # Packed micro-batches of at most 20 tokens, on prompts of 4 to 8 tokens: ranks pack their own rows, and one
    # that needs fewer micro-batches splits some to run as many as the other (FSDP's forwards are collectives;
    # rank 1 packs 6 and rank 0 4 at the first step). PPO's critic packs too.
    ("rloo", ("--max-tokens-per-micro-batch", "20")),
    ("ppo-rlhf", ("--max-tokens-per-micro-batch", "20", "--ppo-mini-batches", "2", "--ppo-epochs", "2",
                  "--learning-rate", "1e-3")),
])
def test_two_processes_end_with_the_weights_of_one(tiny_model_dir, sums_jsonl, workdir, algorithm, extra):
    if "--max-tokens-per-micro-batch" in extra:
        sums_jsonl = workdir / "varied.jsonl"
        sums_jsonl.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                      for a in (1, 12, 123, 1234, 12345, 7) for b in range(6)))
    lora = "--lora-r" in extra
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    extra = ("--algorithm", algorithm, *extra)
    one = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "one", *extra), cwd=workdir)
    assert one.returncode == 0, one.stderr
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    expected = _final(workdir / "one", weights)
    if lora:  # LoRA's B starts at zero
        moved = max(float(value.abs().max()) for name, value in expected.items() if "lora_B" in name)
    else:
        moved = max(float((expected[name] - start[name]).abs().max()) for name in start)
    assert moved > 5e-3  # the comparison below is between runs that learned, not two copies of the start
    bound = max(row["learning_rate"] for row in _rows(workdir / "one")) / 10
    for mode in ("ddp", "fsdp"):
        output = workdir / mode
        two = _torchrun(_args(tiny_model_dir, sums_jsonl, output, *extra, *(("--fsdp",) if mode == "fsdp" else ())),
                        cwd=workdir)
        assert two.returncode == 0, two.stderr[-3000:]
        got = _final(output, weights)
        assert got.keys() == expected.keys()
        _bounded(got, expected, bound, mode)
        if algorithm == "ppo-rlhf":
            critic, critic_expected = _final(output, "critic/model.safetensors"), _final(workdir / "one", "critic/model.safetensors")
            _bounded(critic, critic_expected, bound, f"{mode} critic")
        # The same samples were drawn: identical rewards, and the logged figures agree.
        for a, b in zip(_rows(workdir / "one"), _rows(output)):
            assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"]
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        # Only rank 0 wrote, and the checkpoint loads as an ordinary model.
        assert "before training" in two.stderr and two.stderr.count("before training") == 1


def test_two_processes_with_an_environment_end_with_the_weights_of_one(tiny_model_dir, sums_jsonl, workdir):
    """Multi-turn trajectories (REWARDS' game, at most 2 turns) under FSDP: each rank runs its own prompts'
    trajectories, which end after different numbers of turns (its forwards, collectives outside the gathered
    sampling, differ in number), and the run ends where one process ends. Sampling calls of 2 trajectories
    (--generation-batch-size 8): the second turn's calls pair whichever trajectories are still live on each rank.
    The episode figures are totals over every rank's trajectories, so they are one process's. (FSDP alone: DDP
    runs the same multi-turn code with fewer collectives, and the test_two_processes_end_with_the_weights_of_one
    runs check DDP itself; a third run would cost 15 s.)"""
    # Room for two turns: 4 tokens, the environment's "\nno\n", 4 more.
    extra = ("--steps", "2", "--environment", "dist_rewards:make_env", "--max-turns", "2",
             "--max-trajectory-tokens", "14", "--generation-batch-size", "8")
    one = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "one", *extra), cwd=workdir)
    assert one.returncode == 0, one.stderr[-3000:]
    start, expected = load_file(str(tiny_model_dir / "model.safetensors")), _final(workdir / "one")
    assert max(float((expected[name] - start[name]).abs().max()) for name in start) > 1e-3  # it learned (warm-up)
    rows = _rows(workdir / "one")
    # Some trajectories ended at their first reply, some went on after the environment answered, some hit 2 turns.
    assert all(1.0 < row["turns_mean"] < 2.0 and 0.0 < row["truncated_fraction"] < 1.0 for row in rows), rows
    two = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "fsdp", *extra, "--fsdp"), cwd=workdir)
    assert two.returncode == 0, two.stderr[-3000:]
    _bounded(_final(workdir / "fsdp"), expected, max(row["learning_rate"] for row in rows) / 10, "fsdp")
    figures = ("turns_mean", "truncated_fraction", "reward_mean", "completion_length")
    for a, b in zip(rows, _rows(workdir / "fsdp"), strict=True):
        assert [a[key] for key in figures] == [b[key] for key in figures]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


KILL_AFTER = ("--steps", "6", "--checkpoint-every", "1", "--eval-every", "3")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The 6-step run under 2 processes, never interrupted: what every resumed run must end equal to."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    (folder / "dist_rewards.py").write_text(textwrap.dedent(REWARDS))
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(6)))
    whole = _torchrun(_args(tiny_model_dir, data, folder / "whole", *KILL_AFTER, reward="slow_checksum"), cwd=folder)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return _final(folder / "whole")


def _launch(tiny_model_dir, sums_jsonl, workdir, output):
    """torchrun in a session of its own; returns it once it has saved its second checkpoint, with the PIDs of
    its two workers (torchrun starts each worker in a session of its own too)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *_args(tiny_model_dir, sums_jsonl, output, *KILL_AFTER, reward="slow_checksum")]
    agent = subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoints = output / "rloo-sums-seed42" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (checkpoints / "step-000002").is_dir() and agent.poll() is None:
        time.sleep(0.05)
    assert (checkpoints / "step-000002").is_dir(), "the run never saved its second checkpoint"
    workers = [int(pid) for task in Path(f"/proc/{agent.pid}/task").iterdir()
               for pid in (task / "children").read_text().split()]
    assert len(workers) == 2, workers
    return agent, workers, checkpoints


def _alive(pid: int) -> bool:
    """A process that runs (or is stopped); a zombie nobody has reaped yet counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _resume_equals_the_uninterrupted_run(tiny_model_dir, sums_jsonl, workdir, output, checkpoints, expected):
    done = max(int(path.name[5:]) for path in checkpoints.iterdir() if path.name.startswith("step-"))
    assert 2 <= done < 6
    resumed = _torchrun(_args(tiny_model_dir, sums_jsonl, output, *KILL_AFTER, "--resume", reward="slow_checksum"),
                        cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = _final(output)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert [row["step"] for row in _rows(output)] == [1, 2, 3, 4, 5, 6]


def test_resume_after_every_process_died_at_once_is_exact(tiny_model_dir, sums_jsonl, workdir, uninterrupted):
    output = workdir / "killed"
    agent, workers, checkpoints = _launch(tiny_model_dir, sums_jsonl, workdir, output)
    # As a lost machine: the agent's session and each worker's session, all at once.
    for session in (agent.pid, *workers):
        os.killpg(session, signal.SIGKILL)
    agent.wait()
    deadline = time.time() + 30
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers)
    _resume_equals_the_uninterrupted_run(tiny_model_dir, sums_jsonl, workdir, output, checkpoints, uninterrupted)
    # Another number of processes cannot continue it exactly: refused in one line, before any work.
    other = run_cli(*_args(tiny_model_dir, sums_jsonl, output, *KILL_AFTER, "--resume", reward="slow_checksum"),
                    cwd=workdir)
    assert other.returncode == 2
    assert "ran on 2 process(es), this command on 1" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


def test_ranks_stop_with_their_launcher_and_hold_the_run_folder_until_then(tiny_model_dir, sums_jsonl, workdir,
                                                                           uninterrupted):
    output = workdir / "orphaned"
    agent, workers, checkpoints = _launch(tiny_model_dir, sums_jsonl, workdir, output)
    # Frozen first, so that they are sure to outlive the launcher: the orphans a SIGKILLed agent leaves behind.
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    # While an orphan holds the run folder, a resume (or an overwrite) is refused in one line, naming it.
    for flag in ("--resume", "--overwrite"):
        refused = run_cli(*_args(tiny_model_dir, sums_jsonl, output, *KILL_AFTER, flag, reward="slow_checksum"),
                          cwd=workdir)
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "is in use by another run" in lines[0], lines
        assert any(f"PID {pid}," in lines[0] for pid in workers), lines
    assert (checkpoints / "step-000002").is_dir()  # --overwrite deleted nothing
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    # Each notices that its launcher is gone and stops, well within 60 s.
    deadline = time.time() + 60
    while any(_alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "an orphaned rank outlived its launcher by 60 s"
    _resume_equals_the_uninterrupted_run(tiny_model_dir, sums_jsonl, workdir, output, checkpoints, uninterrupted)


def test_a_reward_failing_on_one_rank_stops_every_rank_with_one_line(tiny_model_dir, sums_jsonl, workdir):
    # A rank left waiting for the failed one would hang until the collective timeout; _torchrun's timeout catches it.
    result = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "out", reward="fails_on_rank_one"), cwd=workdir)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("auto-research:")]
    assert len(ours) == 1 and "rank one's reward is broken" in ours[0], result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr  # every rank exits 2 (torchrun's own summary)
    assert "exitcode  : 1" not in result.stderr
    assert not (workdir / "out").exists()


def test_a_rollout_function_s_bad_return_on_one_rank_stops_every_rank_with_one_line(tiny_model_dir, sums_jsonl,
                                                                                     workdir):
    """Rank 1's rollout function returns no rows at the first step: rank 0, which drew its own, is told at the
    collective that agrees the scores, and both exit 2 (not 1, as a rank stopped by a broken collective would)."""
    result = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "out", "--rollout-function",
                             "dist_rewards:one_draw"), cwd=workdir)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("auto-research:")]
    assert len(ours) == 1 and "--rollout-function" in ours[0] and "returned" in ours[0], result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr and "exitcode  : 1" not in result.stderr, result.stderr[-3000:]


def test_settings_that_depend_on_the_number_of_processes(tiny_model_dir, sums_jsonl, workdir):
    alone = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "out", "--fsdp"), cwd=workdir)
    assert alone.returncode == 2
    assert "--fsdp shards the models over several processes: launch with torchrun" in alone.stderr
    uneven = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "out", "--prompts-per-step", "3"), cwd=workdir)
    lines = [line for line in uneven.stderr.splitlines() if line.startswith("auto-research:")]
    assert lines and all("--prompts-per-step 3 must be a multiple of the number of processes (2)" in line
                         for line in lines)
    assert not (workdir / "out").exists()
