"""Rollouts in flight (--max-staleness K): the fixed schedule, its staleness figures, exact repeats and resumes,
2 processes equal to 1, the decoupled objective against a hand-computed example, and the one-line refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_after_checkpoint, largest_difference, rms_difference, run_cli

TIMES = ("step_seconds", "tokens_per_second", "weight_sync_seconds")
REWARDS = """
def checksum(prompts, completions, rows):
    # Differs between almost any two completions: every group carries a learning signal.
    return [float(sum(map(ord, c)) % 5) for c in completions]
"""


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "async_rewards.py").write_text(REWARDS)
    return tmp_path


# --warmup-steps 10: a data file's preset warmup until it became none. The bounds on how far one process's
# numbers may be from two processes' (fp32 sums in another order, grown by each update) were set under it.
def _args(model, data, output, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "6", "--prompts-per-step", "4",
            "--group-size", "4", "--max-new-tokens", "4", "--learning-rate", "1e-2", "--evaluation-examples", "8",
            "--eval-every", "3", "--temperature", "1.0", "--offline", "--device", "cpu", "--no-progress",
            "--threads", "1", "--reward", "async_rewards:checksum", "--warmup-steps", "10", "--output-dir", str(output),
            *extra]


def _run_dir(output: Path) -> Path:
    return next(output.iterdir())


def _rows(output: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    rows = [json.loads(line) for line in (_run_dir(output) / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in row.items() if not key.startswith("time_") and key not in TIMES}
            for row in rows]


def _final(output: Path) -> dict:
    return load_file(str(sorted((_run_dir(output) / "checkpoints").iterdir())[-1] / "model.safetensors"))


def test_bad_staleness_is_one_line_and_exit_2_before_any_work(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    from auto_research.cli import main

    def error(*extra) -> str:
        assert main(_args(tiny_model_dir, sums_jsonl, tmp_path, *extra)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("auto-research: error: "), lines
        return lines[0][len("auto-research: error: "):]

    assert error("--max-staleness", "-1") == "--max-staleness must be >= 0 (0: sample, then train), got -1"
    assert error("--max-staleness", "1", "--sampler", "vllm") == (
        "--max-staleness 1: the vllm sampler cannot run apart from the trainer; samplers that can: builtin, "
        "vllm-server, builtin-server, builtin-process (or --max-staleness 0)")
    # The engine-neutral flags reach the same settings as the vLLM-named ones.
    assert error("--max-staleness", "2", "--sampler", "vllm", "--rollout-mode", "server", "--rollout-server",
                 "127.0.0.1:9", "--algorithm", "remax") == (
        "--max-staleness 2 with remax and a rollout server is not built (its greedy baseline would sample from the "
        "weights being trained)")
    assert error("--max-staleness", "6") == ("--max-staleness 6 must be below --steps 6 (step s trains on a batch "
                                             "drawn by the weights of step s − 1 − K)")
    assert error("--max-staleness", "1", "--fsdp").startswith("--max-staleness 1 with --fsdp is not built")
    assert not tmp_path.joinpath("rloo-sums-seed42").exists()


def test_in_flight_runs_follow_the_schedule_repeat_exactly_and_resume_exactly(tiny_model_dir, sums_jsonl, workdir):
    tmp_path, env = workdir, {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))}
    common = ("--max-staleness", "2", "--checkpoint-every", "2", "--rollout-correction", "none")
    whole = run_cli(*_args(tiny_model_dir, sums_jsonl, tmp_path / "whole", *common), env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert whole.stdout.count("--rollout-correction none") + whole.stderr.count("--rollout-correction none") == 1
    rows = _rows(tmp_path / "whole")
    # Step s trains on a batch drawn by version max(0, s − 3) while the policy is version s − 1.
    assert [row["staleness_max"] for row in rows] == [0, 1, 2, 2, 2, 2]
    assert [row["staleness_mean"] for row in rows] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    full = [json.loads(line) for line in (_run_dir(tmp_path / "whole") / "metrics.jsonl").read_text().splitlines()]
    for row in full:
        assert row["time_waiting_for_rollouts"] >= 0 and row["time_sampler_idle"] >= 0
        assert math.isfinite(row["rollout_logprob_diff_mean"]) and row["rollout_weight_mean"] > 0
    # The first step's batch was drawn by the weights it trains: π = μ exactly; later ones by older weights.
    assert full[0]["rollout_logprob_diff_max"] == 0.0 and full[-1]["rollout_logprob_diff_max"] > 1e-4
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    expected = _final(tmp_path / "whole")
    assert max(float((expected[name] - start[name]).abs().max()) for name in start) > 5e-3  # it learned

    again = run_cli(*_args(tiny_model_dir, sums_jsonl, tmp_path / "again", *common), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _rows(tmp_path / "again") == rows
    got = _final(tmp_path / "again")
    assert all(torch.equal(got[name], expected[name]) for name in expected)

    killed = tmp_path / "killed"
    args = _args(tiny_model_dir, sums_jsonl, killed, *common)
    kill_after_checkpoint(args, {**os.environ, **env}, killed / "rloo-sums-seed42" / "checkpoints" / "step-000002")
    saved = json.loads((killed / "rloo-sums-seed42" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert [batch["step"] for batch in saved["in_flight"][0]] == [3, 4]  # the batches drawn ahead, saved
    resumed = run_cli(*args, "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = _final(killed)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert _rows(killed) == rows


def test_two_processes_in_flight_end_with_the_weights_of_one(tiny_model_dir, sums_jsonl, workdir):
    tmp_path = workdir
    common = ("--max-staleness", "1", "--micro-batch-size", "4", "--steps", "4")
    one = run_cli(*_args(tiny_model_dir, sums_jsonl, tmp_path / "one", *common), cwd=workdir,
                  env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0, one.stderr[-3000:]
    assert [row["staleness_max"] for row in _rows(tmp_path / "one")] == [0, 1, 1, 1]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *_args(tiny_model_dir, sums_jsonl, tmp_path / "two", *common)]
    two = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = _final(tmp_path / "one"), _final(tmp_path / "two")
    # Gradients summed in another order, which Adam lifts to up to lr in the odd element; a fault moves most
    # elements by ~lr a step: RMS <= the largest lr stepped with / 10 (conftest.rms_difference).
    difference, bound = rms_difference(got, expected), max(row["learning_rate"] for row in _rows(tmp_path / "one")) / 10
    print(f"weights' RMS difference from one process {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(got, expected):.2e}")
    assert difference <= bound, (difference, bound)
    for a, b in zip(_rows(tmp_path / "one"), _rows(tmp_path / "two")):
        assert a["reward_mean"] == b["reward_mean"] and a["staleness_max"] == b["staleness_max"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_the_decoupled_objective_against_a_hand_computed_example():
    """PPO's clipped ratio against the proximal policy π_prox (the weights at the start of the update), each token
    weighted by min(π_prox/μ, C): the loss path of update_actor (the registered loss × the correction's weights)."""
    from auto_research.algorithms.correction import importance_weights
    from auto_research.algorithms.losses import POLICY_LOSSES, LossInputs

    behaviour = torch.tensor([[0.5, 0.4, 0.1]]).log()    # μ: the stale weights that sampled
    proximal = torch.tensor([[0.6, 0.2, 0.5]]).log()     # π_prox
    current = torch.tensor([[0.9, 0.2, 0.45]]).log().requires_grad_(True)  # π_θ during the update
    advantages, mask = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    weights = importance_weights(proximal - behaviour, mask, "token-tis", cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.2, 0.5, 2.0])  # 0.6/0.5, 0.2/0.4, 0.5/0.1 truncated at 2
    terms = POLICY_LOSSES["clipped-token"](LossInputs(current, proximal, advantages, mask, 0.2)) * weights
    # Token 1: ratio 0.9/0.6 = 1.5, clipped to 1.2 (A > 0): −1.2 × 1.2. Token 2: ratio 1, A = −1: +1 × 0.5.
    # Token 3: ratio 0.9 (inside 1 ± 0.2): −0.9 × 2. Against μ the first ratio would be 1.8, not 1.5.
    assert terms[0].tolist() == pytest.approx([-1.44, 0.5, -1.8])
    terms.sum().backward()
    # ∂/∂log π_θ of −w·ρ·A: 0 where clipped, −w·ρ·A inside the clip range.
    assert current.grad[0].tolist() == pytest.approx([0.0, 0.5, -1.8])


def test_a_stale_batch_gets_the_trainers_log_probs_and_the_correction(tiny_model_dir):
    """Rows drawn by older weights: π_old comes from the trainer's forward, never from the rollout, and each
    completion is weighted by min(π_old(y)/μ(y), C) (RLOO: sequence-tis)."""
    from dataclasses import replace

    from auto_research.config.generation import GenerationConfig
    from auto_research.engine.logprobs import token_logprobs
    from auto_research.engine.models import load_policy
    from auto_research.engine.rollout.builtin import sample
    from auto_research.engine.samplers import sampler_record
    from auto_research.train.components import Models, RunContext
    from auto_research.algorithms.registry import get_algorithm
    from auto_research.engine.distributed import World
    from auto_research.train.experience import Scores, build_experience

    policy, tokenizer = load_policy(str(tiny_model_dir), "cpu", torch.float32, True)
    old = [parameter.detach().clone() for parameter in policy.parameters()]
    rollout = sample(policy, tokenizer, ["1+2=", "3+1="], 4, 4, seeds=[1, 2])
    with torch.no_grad():  # the policy moves on after the batch was drawn
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    config = GenerationConfig(group_size=4, prompts_per_step=2, max_staleness=1, temperature=1.0, max_new_tokens=4,
                              beta=0.0).filled()
    run = RunContext(config, World(), "cpu", torch.float32, get_algorithm("rloo"), None, tokenizer, "tiny",
                     sampler_record(config.rollout))
    models = Models(policy, policy, None, None)
    scores = Scores(torch.ones(8), torch.ones(8, dtype=torch.bool))
    stale = replace(rollout, policy_versions=torch.zeros(8, dtype=torch.long))
    experience = build_experience(run, models, stale, scores, version=1)
    mask = rollout.completion_mask.float()
    with torch.no_grad():
        expected = token_logprobs(policy, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    assert torch.allclose(experience.old_logprobs, expected, atol=1e-6)
    assert not torch.allclose(experience.old_logprobs, rollout.sampler_logprobs, atol=1e-3)
    ratio = ((expected - rollout.sampler_logprobs) * mask).sum(1).double().exp().clamp(max=2.0)
    assert torch.allclose(experience.rollout_weights, (ratio.unsqueeze(1) * mask).float(), atol=1e-5)
    # The same rows drawn by the current weights (version 1): the rollout's own log-probs serve.
    with torch.no_grad():
        for parameter, value in zip(policy.parameters(), old):
            parameter.copy_(value)
    current = build_experience(run, models, replace(rollout, policy_versions=torch.ones(8, dtype=torch.long)), scores, version=1)
    assert torch.equal(current.old_logprobs, rollout.sampler_logprobs)
    assert torch.equal(current.rollout_weights, mask)


def test_the_producer_draws_each_step_with_its_scheduled_weights_and_hands_on_its_failure():
    """InFlight alone, with a sampler that reads which weights it holds: step s is drawn by version
    max(0, s − 1 − K) however the threads are timed, never more than K + 1 steps ahead; an error in the rollout
    thread is raised where the trainer waits."""
    import time

    import numpy as np

    from auto_research.engine.rollout import Rollout
    from auto_research.train.in_flight import InFlight
    from auto_research.train.rollouts import RolloutSource
    from auto_research.train.sides import Schedule

    policy, copy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    drawn_with, published = {}, [0]

    class Sampler:
        def sample(self, prompts, group_size, seeds):
            step = len(drawn_with) + 1
            if step == 6:
                raise RuntimeError("the engine broke")
            drawn_with[step] = (int(copy.weight.item()), published[0])
            rows = len(prompts) * group_size
            return Rollout(torch.zeros(rows, 2, dtype=torch.long), torch.ones(rows, 1, dtype=torch.long),
                           torch.ones(rows, 1, dtype=torch.long), [""] * rows, group_size)

    source = RolloutSource(["a", "b", "c"], [None] * 3, 0, 2, 2, lambda picks: picks, Sampler(),
                           lambda prompts, completions, examples, tokens: [1.0] * len(completions))
    with torch.no_grad():
        policy.weight.fill_(0)
    K = 2
    rollouts = InFlight(source, np.random.default_rng(0), Schedule(K, 7, 0), policy, model=copy)
    for step in range(1, 6):
        time.sleep(0.05 if step % 2 else 0.0)  # the trainer's speed varies; the schedule does not
        drawn = rollouts.take(step)
        assert drawn.rollout.policy_versions.tolist() == [max(0, step - 1 - K)] * 4
        with torch.no_grad():
            policy.weight.fill_(step)
        published[0] = step
        rollouts.publish(step, policy)
    # The weights each batch was drawn with, and how many versions the trainer had published by then.
    assert {step: version for step, (version, _) in drawn_with.items()} == {1: 0, 2: 0, 3: 0, 4: 1, 5: 2}
    assert all(step - 1 - K <= published_then <= step - 1 for step, (_, published_then) in drawn_with.items())
    with pytest.raises(RuntimeError, match="the engine broke"):
        rollouts.take(6)
    rollouts.close()


def test_the_side_is_picked_from_the_table_built_once_and_draws_from_its_first_take(tiny_model_dir, sums_jsonl,
                                                                                 workdir, monkeypatch):
    """``open_run`` builds the run's rollout side once, from ``schedule.SIDES`` (every layout there has a builder):
    K = 0 is ``Synchronous``, K = 1 with the builtin sampler ``InFlight``, whose thread starts at its first step
    (``Trainer.sample`` may draw before it, not after); the step is handed the side, and never builds one."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.schedule import SIDES, Layout
    from auto_research.train.trainer import Trainer

    assert Layout(False, False, False, False) in SIDES and len(SIDES) == 6
    monkeypatch.syspath_prepend(str(workdir))
    settings = dict(model=str(tiny_model_dir), dataset=str(sums_jsonl), steps=3, prompts_per_step=4, group_size=4,
                    max_new_tokens=3, evaluation_examples=4, eval_every=0, progress=False, offline=True, device="cpu",
                    reward=["async_rewards:checksum"])
    for staleness, kind in ((0, "Synchronous"), (1, "InFlight")):
        config = GenerationConfig(**settings, max_staleness=staleness,
                                  output_dir=workdir / str(staleness)).filled().validate()
        trainer = Trainer.build(config, log=lambda text: None)
        try:
            side = trainer.side
            assert type(side).__name__ == kind and not side.started
            trainer.sample(1)  # before the first step: the side has not drawn yet
            trainer.step(1)
            assert trainer.side is side and side.started == bool(staleness)
            if staleness:
                with pytest.raises(Exception, match="Trainer.sample draws as a synchronous step does"):
                    trainer.sample(2)
        finally:
            trainer.close()
