"""The generation-level step: the paper's gradient by hand, KL, None and NaN rewards, learning, resume."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from auto_research.cli import main
from auto_research.config.generation import GenerationConfig
from auto_research.engine.logprobs import token_logprobs
from auto_research.algorithms import estimators as core
from auto_research.algorithms import losses
from auto_research.train.trainer import Trainer
from conftest import largest_difference, rms_difference, run_cli


def test_loss_gradient_is_the_papers_estimator_for_two_prompts(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    K = 3
    completions = [["7", "8", "17"], ["5", "50", "05"]]
    prompts = ["3+4=", "2+3="]
    rows = []
    for prompt, group in zip(prompts, completions):
        for text in group:
            rows.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                         tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    width = max(len(c) for _, c in rows)
    pad = tokenizer.pad_token_id
    sequences = torch.tensor([[pad] * (4 - len(p)) + p + c + [pad] * (width - len(c)) for p, c in rows])
    prompt_mask = torch.tensor([[0] * (4 - len(p)) + [1] * len(p) for p, _ in rows])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for _, c in rows])
    rewards = np.array([[1.0, 0.0, 0.5], [0.2, 0.2, 0.8]])
    # Leave-one-out by hand: group 1: 1 − .25, 0 − .75, .5 − .5; group 2: .2 − .5, .2 − .5, .8 − .2.
    by_hand = [0.75, -0.75, 0.0, -0.3, -0.3, 0.6]
    token_rewards = losses.last_token(mask.float()) * torch.tensor(rewards, dtype=torch.float32).reshape(-1, 1)
    inputs = core.AdvantageInputs(token_rewards, mask.float(), K, torch.ones(6, dtype=torch.bool))
    advantages, _ = core.ADVANTAGE_ESTIMATORS["rloo"](inputs)
    # Every token of a completion carries its completion's advantage.
    assert torch.allclose(advantages, torch.tensor(by_hand).reshape(-1, 1) * mask, atol=1e-6)

    logprobs = token_logprobs(model, sequences, prompt_mask, mask)
    terms = losses.POLICY_LOSSES["vanilla"](losses.LossInputs(logprobs, logprobs.detach(), advantages, mask.float()))
    loss = losses.aggregate(terms, mask.float(), "sequence", sequences=6, tokens=float(mask.sum()), groups=2)
    ours = torch.autograd.grad(loss, list(model.parameters()))

    # The paper: ∇J = 1/(2K) Σ_i A_i ∇ Σ_t log π(y_i,t); the loss is its negative.
    sums = token_logprobs(model, sequences, prompt_mask, mask).sum(dim=1)
    paper = -sum(a * s for a, s in zip(by_hand, sums)) / (2 * K)
    expected = torch.autograd.grad(paper, list(model.parameters()))
    for got, want in zip(ours, expected):
        assert torch.allclose(got, want, atol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in ours)


def _config(model_dir, dataset, output, **overrides):
    settings = dict(model=str(model_dir), dataset=str(dataset), output_dir=output, steps=4, prompts_per_step=4,
                    group_size=4, max_new_tokens=3, learning_rate=1e-3, evaluation_examples=8, eval_every=2,
                    checkpoint_every=2, progress=False, offline=True, seed=3, device="cpu")
    settings.update(overrides)
    return GenerationConfig(**settings).filled().validate()


def test_kl_is_exactly_zero_before_the_first_update(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    config = _config(tiny_model_dir, sums_jsonl, tmp_path, beta=0.1, reward=[f"{reward_module}:checksum"])
    trainer = Trainer.build(config, log=lambda text: None)
    assert trainer.evaluate()["kl_from_reference"] == 0.0
    row = trainer.step(1)
    # The sampled log-ratio of the first step: policy and reference are identical. On-policy, the policy's
    # log-probs are the sampler's own (computed as it drew, over the KV cache) and the reference's come from a
    # whole forward: equal to float32 rounding, not bit for bit.
    assert abs(row["kl"]) < 1e-5
    # Two updates per batch need the policy's own forward, the same computation as the reference's: exactly 0.
    with_forward = Trainer.build(replace(config, output_dir=tmp_path / "forward", updates_per_batch=2),
                                 log=lambda text: None)
    assert with_forward.step(1)["kl"] == 0.0
    assert trainer.evaluate()["kl_from_reference"] > 0.0


REWARDS = '''
import math
import time

def slow_match(prompts, completions, rows):
    # Slow enough that a signal sent by the test lands mid-run; the numbers are the verifier's.
    time.sleep(0.3)
    return [float(c.strip() == row["answer"]) for c, row in zip(completions, rows)]

def sometimes_none(prompts, completions, rows):
    # The first prompt's group keeps one scorable sample: no signal from it.
    return [None if (i < 4 and i != 0) or i % 4 == 3 else float(len(c)) for i, c in enumerate(completions)]

def nan_on_third_call(prompts, completions, rows):
    nan_on_third_call.calls = getattr(nan_on_third_call, "calls", 0) + 1
    return [math.nan if nan_on_third_call.calls == 3 else 1.0 for _ in completions]

def length(prompts, completions, rows):
    return [float(len(c)) for c in completions]

def checksum(prompts, completions, rows):
    # Differs between almost any two completions, so every group has a learning signal.
    return [float(sum(map(ord, c)) % 5) for c in completions]

def count_sevens(prompts, completions, rows):
    return [c.count("7") / 3 for c in completions]
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    return "my_rewards"


def test_none_rewards_leave_samples_out_and_count_silent_groups(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    trainer = Trainer.build(_config(tiny_model_dir, sums_jsonl, tmp_path, reward=[f"{reward_module}:sometimes_none"]),
                            log=lambda text: None)
    row = trainer.step(1)
    # Group 1: three None; groups 2-4: one None each → 6 unscored of 16.
    assert row["unscored_samples"] == 6
    assert row["no_signal_fraction"] >= 0.25


def test_nan_reward_saves_last_good_step_and_exits_2(tiny_model_dir, sums_jsonl, tmp_path, reward_module, capsys):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "5",
                 "--prompts-per-step", "2", "--max-new-tokens", "3", "--evaluation-examples", "4",
                 "--reward", f"{reward_module}:nan_on_third_call", "--checkpoint-every", "100", "--eval-every", "0", "--offline",
                 "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    # The baseline evaluation is call 1, step 1 is call 2, step 2 returns NaN for every sample: none is scored.
    assert error.startswith("auto-research: error: no sample of step 2 could be scored: reward "
                            "'my_rewards:nan_on_third_call' returned nan for all 8 completions; saved the last good "
                            "step (1)")
    checkpoint = tmp_path / "out" / "rloo-sums-seed42" / "checkpoints" / "step-000001"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 1


def test_reward_rises_on_a_trivially_learnable_target(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    config = _config(tiny_model_dir, sums_jsonl, tmp_path, reward=[f"{reward_module}:count_sevens"], steps=40,
                     prompts_per_step=8, learning_rate=1e-2, temperature=1.0, beta=0.0, eval_every=0,
                     checkpoint_every=0, warmup_steps=0)
    trainer = Trainer.build(config, log=lambda text: None)
    rewards = [trainer.step(step)["reward_mean"] for step in range(1, 41)]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.3, (first, last)


def _weights(run_dir):
    return load_file(str(sorted((run_dir / "checkpoints").iterdir())[-1] / "model.safetensors"))


RUN = ["post-train", "--dataset", "DATA", "--model", "MODEL", "--steps", "6", "--prompts-per-step", "4",
       "--max-new-tokens", "3", "--evaluation-examples", "4", "--eval-every", "3", "--checkpoint-every", "1",
       "--learning-rate", "1e-3", "--offline", "--device", "cpu", "--no-progress", "--seed", "5"]


def _run_args(tiny_model_dir, sums_jsonl, output):
    args = [str(sums_jsonl) if a == "DATA" else str(tiny_model_dir) if a == "MODEL" else a for a in RUN]
    return args + ["--output-dir", str(output), "--reward", "my_rewards:slow_match"]


def _env(reward_module_dir):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_module_dir), os.environ.get("PYTHONPATH", "")])}


def test_killed_and_resumed_run_ends_with_identical_weights(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    env = _env(tmp_path)
    whole = run_cli(*_run_args(tiny_model_dir, sums_jsonl, tmp_path / "whole"), env=env)
    assert whole.returncode == 0, whole.stderr
    # The same run, killed with SIGKILL after its second checkpoint (the slow reward makes that mid-run).
    args = [sys.executable, "-m", "auto_research", *_run_args(tiny_model_dir, sums_jsonl, tmp_path / "killed")]
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = tmp_path / "killed" / "rloo-sums-seed5"
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "checkpoints" / "step-000002").is_dir():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    steps_done = max(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert 2 <= steps_done < 6
    resumed = run_cli(*_run_args(tiny_model_dir, sums_jsonl, tmp_path / "killed"), "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    expected, got = _weights(tmp_path / "whole" / "rloo-sums-seed5"), _weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    final = json.loads((run_dir / "metrics.json").read_text())
    assert final["final"] == json.loads((tmp_path / "whole" / "rloo-sums-seed5" / "metrics.json").read_text())["final"]


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    args = [sys.executable, "-m", "auto_research", *_run_args(tiny_model_dir, sums_jsonl, tmp_path),
            "--checkpoint-every", "100"]
    process = subprocess.Popen(args, env=_env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "rloo-sums-seed5"
    deadline = time.time() + 120
    while time.time() < deadline and not (run_dir / "metrics.jsonl").is_file():
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "checkpoint saved" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    saved = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert len(saved) == 1


BAD = [
    (["--model", "/no/such/model"], "--model /no/such/model: no such model folder"),
    (["--group-size", "1"], "leave-one-out is undefined for K = 1"),
    (["--beta", "-0.1"], "--beta must be a finite number >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--max-new-tokens", "40"], "exceed the model's context of 32 tokens"),
    (["--reward", "no_such_module:score"], "cannot import module 'no_such_module'"),
    (["--reward", "json:no_such_function"], "--reward 'json:no_such_function': json has no 'no_such_function'"),
    (["--reward-model", "/no/such/reward-model"], "--reward-model /no/such/reward-model: no such model folder"),
    (["--resume"], "--resume: no valid checkpoint in"),
    (["--kl-estimator", "k9"], "--kl-estimator 'k9': choose one of k1, k2, k3"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer, got 0"),
    (["--algorithm", "ppo-rlhf", "--gae-lambda", "1.5"], "--gae-lambda must be in [0, 1], got 1.5"),
    (["--algorithm", "ppo-rlhf", "--ppo-epochs", "0"], "--ppo-epochs must be a positive integer, got 0"),
    (["--algorithm", "ppo-rlhf", "--vf-coef", "-1"], "--vf-coef must be a finite number >= 0, got -1.0"),
    (["--algorithm", "ppo-rlhf", "--critic-model", "/no/such/critic"], "--critic-model /no/such/critic: no such model folder"),
    (["--critic-model", "/no/such/critic"], "--critic-model applies to ppo-rlhf only"),
    (["--algorithm", "grpo", "--kl-estimator", "k1"], "the expected gradient of a k1 loss term is zero"),
    (["--ppo-mini-batches", "3", "--prompts-per-step", "4"], "--ppo-mini-batches 3 must divide --prompts-per-step 4"),
    (["--algorithm", "grpo", "--kl-in", "reward"], "grpo's advantage does not use the shaped reward"),
    (["--reward-weights", "1,2"], "--reward-weights has 2 values for 1 rewards"),
    (["--temperature", "0"], "--temperature 0 is greedy decoding: a prompt's K completions would be identical"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_generation_bad_input_one_line_exit_2_before_training(tiny_model_dir, sums_jsonl, tmp_path, capsys, flags, message):
    base = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--offline", "--device", "cpu",
            "--no-progress", "--output-dir", str(tmp_path / "out")]
    if "--model" in flags:
        base = [a for i, a in enumerate(base) if a != "--model" and (i == 0 or base[i - 1] != "--model")]
    code = main(base + flags)
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("auto-research: error: ") and message in lines[-1], lines
    assert not (tmp_path / "out").exists()


def test_dataset_row_missing_a_field_names_file_and_line(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(path), "--offline", "--device", "cpu",
                 "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert f"{path}:2: row has no field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path, reward_module, **overrides):
    config = _config(tiny_model_dir, sums_jsonl, tmp_path, reward=[f"{reward_module}:checksum"], beta=0.1, **overrides)
    trainer = Trainer.build(config, log=lambda text: None)
    row = trainer.step(1)
    return {name: value.detach().clone() for name, value in trainer.components.policy.named_parameters()}, row


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce"])
@pytest.mark.parametrize("micro_batch_size", [4, 8, 2])
def test_micro_batches_accumulate_to_the_whole_batch_gradient(tiny_model_dir, sums_jsonl, tmp_path, reward_module,
                                                              micro_batch_size, algorithm):
    # 4 prompts × K = 4: micro-batches of 1 or 2 whole groups, or half-groups (with the extra scoring pass).
    # reinforce's moving-average baseline must not move between micro-batches.
    whole, whole_row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "a", reward_module, algorithm=algorithm)
    split, split_row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "b", reward_module,
                                         micro_batch_size=micro_batch_size, algorithm=algorithm)
    assert whole_row["advantage_abs_max"] > 0
    # The KL in the shaped reward comes from the sampler's log-probs (on-policy), and sampling runs in chunks of
    # the micro-batch: float32 rounding differs at ~1e-9 between chunk sizes. A baseline that moved between
    # micro-batches would shift the advantages by ~0.1 of their mean.
    assert split_row["advantage_std"] == pytest.approx(whole_row["advantage_std"], abs=1e-7)
    assert split_row["advantage_mean"] == pytest.approx(whole_row["advantage_mean"], abs=1e-7)
    # Summation order differs between accumulated micro-batches and one pass; Adam's first step divides each
    # gradient element by its own magnitude, so rounding moves an element whose gradient is within rounding of zero
    # by up to 2 lr (which one is the CPU's luck), the others by ~1e-6 lr. A micro-batch lost or counted twice turns
    # most elements' steps: RMS <= lr / 10 (conftest.rms_difference). A uniform scale, which Adam's step hides,
    # shows in the gradient's norm: fp32 rounding moves it by ~1e-6 relative, a wrong weight by far more.
    assert split_row["grad_norm"] == pytest.approx(whole_row["grad_norm"], rel=1e-4)
    difference, bound = rms_difference(split, whole), whole_row["learning_rate"] / 10
    print(f"weights' RMS difference {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(split, whole):.2e}; grad norms {split_row['grad_norm']:.8g}, "
          f"{whole_row['grad_norm']:.8g}")
    assert difference <= bound, (difference, bound)


@pytest.mark.parametrize("overrides", [
    dict(algorithm="grpo"),
    dict(algorithm="remax"),
    dict(algorithm="raft"),
    dict(algorithm="reinforce"),
    dict(algorithm="vanilla-pg"),
    dict(kl_estimator="k3", kl_in="loss"),
    dict(loss_aggregation="token-mean"),
    dict(updates_per_batch=3),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_generation_option_takes_a_finite_step_that_changes_the_policy(tiny_model_dir, sums_jsonl, tmp_path, reward_module, overrides):
    before = {name: value.detach().clone() for name, value in
              AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    after, row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path, reward_module, **overrides)
    assert all(math.isfinite(row[key]) for key in ("loss", "kl", "entropy", "grad_norm", "reward_mean"))
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_learning_rate_schedule_by_hand():
    from auto_research.train.update import learning_rate_at

    config = GenerationConfig(learning_rate=1.0, warmup_steps=4, steps=14, lr_schedule="cosine").filled()
    assert [learning_rate_at(config.optimisation, update, 14) for update in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # Cosine from 1 at the end of warmup to 0 at the last update: half-way (update 9) it is 0.5.
    assert learning_rate_at(config.optimisation, 9, 14) == pytest.approx(0.5)
    assert learning_rate_at(config.optimisation, 14, 14) == pytest.approx(0.0)
    constant = GenerationConfig(learning_rate=0.1, warmup_steps=0, steps=5).filled()
    assert {learning_rate_at(constant.optimisation, update, 5) for update in range(5)} == {0.1}


def test_gradient_checkpointing_changes_memory_not_the_step(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    plain, _ = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "a", reward_module)
    checkpointed, _ = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "b", reward_module, gradient_checkpointing=True)
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6), name
    # What the backward keeps, in eval mode (how the policy trains, dropout off): transformers' own gradient
    # checkpointing acts only in training mode, so it kept everything; recomputed layers keep their inputs only.
    from auto_research.train.components import checkpoint_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(4, 200, (4, 24))
    before = _saved_numel(model, ids)
    assert checkpoint_layers(model) == model.config.num_hidden_layers
    assert _saved_numel(model, ids) < 0.6 * before
    with torch.no_grad():  # no gradient: the layers run as they are
        assert torch.equal(model(input_ids=ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model_dir)
                           .eval()(input_ids=ids).logits)


def test_ppo_recomputes_its_critic_too(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    """--gradient-checkpointing covers every model that trains: PPO's critic ends where it ends without it."""
    from auto_research.engine.distributed import decoder_layers

    config = _config(tiny_model_dir, sums_jsonl, tmp_path / "a", reward=[f"{reward_module}:checksum"],
                     algorithm="ppo-rlhf", gradient_checkpointing=True)
    trainer = Trainer.build(config, log=lambda text: None)
    assert {getattr(layer, "recomputed_in_backward", None) for layer in decoder_layers(trainer.components.critic)} \
        == {"layer"}
    trainer.step(1)
    plain = Trainer.build(_config(tiny_model_dir, sums_jsonl, tmp_path / "b", reward=[f"{reward_module}:checksum"],
                                  algorithm="ppo-rlhf"), log=lambda text: None)
    plain.step(1)
    for (name, got), (_, want) in zip(trainer.components.critic.named_parameters(),
                                      plain.components.critic.named_parameters()):
        assert torch.allclose(got, want, atol=1e-6), name


def _saved_numel(model, ids) -> int:
    """Elements of the tensors autograd saves for the backward of one forward of ``model``."""
    total = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel()) or t, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    return sum(total)


def test_resume_with_other_settings_names_them(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    base = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2",
            "--prompts-per-step", "2", "--max-new-tokens", "3", "--offline", "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path)]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base + ["--resume", "--beta", "0.2"]) == 2
    assert "started with different settings: beta (was 0.05, now 0.2)" in capsys.readouterr().err


def test_recomputed_mlps_change_memory_not_the_step(tiny_model_dir, sums_jsonl, tmp_path, reward_module):
    from auto_research.train.components import checkpoint_mlps

    plain, _ = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "a", reward_module)
    recomputed, _ = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "b", reward_module, checkpoint_mlp=True)
    for name in plain:
        assert torch.allclose(plain[name], recomputed[name], atol=1e-6), name
    # What the backward keeps: fewer saved activations with the MLPs recomputed.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(4, 200, (4, 24))
    before = _saved_numel(model, ids)
    assert checkpoint_mlps(model) == 1
    assert _saved_numel(model, ids) < 0.8 * before


def test_tied_embedding_gradient_is_one_dense_tensor_and_the_same_bit_for_bit(tiny_model_dir, sums_jsonl, tmp_path,
                                                                             reward_module):
    """The tied (V, H) weight's two gradients (the output layer's, the lookup's) come as one dense tensor: the
    backward makes no second (V, H) tensor, nor their sum, and the gradient is torch's own, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from auto_research.engine.embedding import tied_rows_gradient
    from auto_research.engine.tiny import build_model, build_tokenizer

    ids = torch.randint(4, 200, (4, 24), generator=torch.Generator().manual_seed(0))
    ids[:, :2] = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id  # padding: no gradient, as in torch's
    prompt_mask = torch.zeros(4, 10, dtype=torch.long).index_fill_(1, torch.arange(2, 10), 1)
    completion_mask = torch.ones(4, 14, dtype=torch.long)

    class NewTensorsOfShape(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.made = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                     if isinstance(a, torch.Tensor) and a.layout == torch.strided}
            self.made += sum(1 for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.shape == self.shape
                             and t.layout == torch.strided and t.untyped_storage().data_ptr() not in given)
            return out

    def gradient(one_tensor: bool):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        weight = model.get_input_embeddings().weight
        assert model.get_input_embeddings().padding_idx is not None and weight is model.lm_head.weight
        assert tied_rows_gradient(model) if one_tensor else True
        loss = token_logprobs(model, ids, prompt_mask, completion_mask).sum()
        with NewTensorsOfShape(weight.shape) as counted:
            loss.backward()
        return weight.grad, counted.made

    dense, made = gradient(one_tensor=False)
    assert made == 3  # the output side's, the lookup's, their sum
    got, made = gradient(one_tensor=True)
    assert made == 1  # the output side's, into which the lookup's rows went
    assert got.layout == torch.strided and torch.equal(got, dense)
    # Through the model's own output layer (which uses the weight itself), the lookup's rows come sparse and are
    # summed with it: the same gradient again.
    plain, rows = (AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval() for _ in range(2))
    tied_rows_gradient(rows)
    for model in (plain, rows):
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    assert torch.equal(rows.lm_head.weight.grad, plain.lm_head.weight.grad)
    # A copy (the rollout side's snapshot) looks up its own weights, not the original's.
    import copy

    snapshot = copy.deepcopy(rows)
    with torch.no_grad():
        rows.get_input_embeddings().weight.add_(1.0)
        assert torch.equal(snapshot.get_input_embeddings()(ids), plain.get_input_embeddings()(ids))
    # Not where the two sides are two weights (the input side's gradient would be all the weight gets).
    untied = build_model(build_tokenizer(), seed=0, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert not tied_rows_gradient(untied) and not hasattr(untied.get_input_embeddings(), "rows_seen_gradient")
    # A run's policy has it, PPO's critic (no output embeddings) does not, and a step ends where it ends without.
    trainers = [Trainer.build(_config(tiny_model_dir, sums_jsonl, tmp_path / name, algorithm="ppo-rlhf",
                                      reward=[f"{reward_module}:checksum"]), log=lambda text: None)
                for name in ("rows", "dense")]
    assert trainers[0].components.policy.get_input_embeddings().rows_seen_gradient
    assert not hasattr(trainers[0].components.critic.get_input_embeddings(), "rows_seen_gradient")
    del trainers[1].components.policy.get_input_embeddings().forward  # back to nn.Embedding's own
    for trainer in trainers:
        trainer.step(1)
    for (name, got), (_, want) in zip(*(t.components.policy.named_parameters() for t in trainers)):
        assert torch.equal(got, want), name
