"""Weights updated in flight and partial rollouts (--in-flight-updates): the continuous batch draws what the
builtin sampler draws, a swap between two decode steps records each token's version and log-prob under the
weights that drew it, the correction by hand on a two-version sequence, and runs: no group trained before its K
completions are done, no token older than K versions, a fixed batch, identical repeats, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout import eos_ids, prompt_seed
from auto_research.engine.rollout.builtin import sample
from auto_research.engine.rollout.partial import Pool, lanes_to_rows

PROMPTS = ["1+2=", "Q: what is 33+4?", "x", "abc 12", "9"]
TIMES = ("step_seconds", "tokens_per_second", "weight_sync_seconds")
REWARDS = """
def checksum(prompts, completions, rows):
    return [float(sum(map(ord, c)) % 5) for c in completions]
"""


def _model(seed: int):
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return model.eval(), tokenizer


def _ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _pool(model, tokenizer, group_size=4, max_new=12, temperature=1.3) -> Pool:
    return Pool(model, tokenizer, group_size, max_new, temperature, 0, 1.0, eos_ids(tokenizer, model),
                tokenizer.pad_token_id)


def test_the_continuous_batch_draws_what_the_builtin_sampler_draws():
    """Lanes admitted at different ticks into rows others freed: each group's ids and log-probs are the ones
    ``sample`` draws for its prompt and seed alone."""
    model, tokenizer = _model(0)
    seeds = [prompt_seed(42, 3, i) for i in range(len(PROMPTS))]
    pool, done, admitted, fewer = _pool(model, tokenizer), [], 2, 0
    pool.admit_many([(i, _ids(tokenizer, PROMPTS[i]), seeds[i]) for i in range(2)])  # one prefill, left-padded
    while len(done) < len(PROMPTS):
        while pool.size < 8 and admitted < len(PROMPTS):  # room for two groups: later ones wait for a free lane
            pool.admit(admitted, _ids(tokenizer, PROMPTS[admitted]), seeds[admitted])
            admitted += 1
        done += pool.tick()
        # Only the rows not yet ended decode (the batch and its KV cache): a lane's ended rows are not fed padding.
        going = (~pool.rows["ended"]).nonzero().squeeze(1).tolist() if pool.lanes else []
        assert sorted(pool.batch.get("row", torch.zeros(0)).tolist()) == going
        assert pool.cache is None or pool.cache.layers[0].keys.shape[0] == len(going)
        fewer += len(going) < pool.size
    assert fewer > 0  # some lane waited for its longest row with the others out of the batch
    assert sorted(lane.key for lane in done) == list(range(len(PROMPTS)))
    for lane in done:
        alone = sample(model, tokenizer, [PROMPTS[lane.key]], 4, 12, temperature=1.3, seeds=[seeds[lane.key]],
                       drop_finished=False)
        mask, width = alone.completion_mask, alone.completion_mask.shape[1]
        assert torch.equal(alone.completion_ids * mask, lane.tokens[:, :width] * mask)
        assert torch.allclose(alone.sampler_logprobs, lane.logprobs[:, :width] * mask, atol=1e-6)
        assert bool((lane.versions[:, :width][mask.bool()] == 0).all())
    pool.admit(0, _ids(tokenizer, PROMPTS[0]), seeds[0])
    pool.close()  # given up: its rows and KV cache go
    assert (pool.lanes, pool.rows, pool.batch, pool.cache, pool.tick()) == ([], {}, {}, None, [])


def test_a_model_with_a_sliding_window_is_refused_by_the_continuous_batch():
    """Its cache's layers hold fewer positions than the batch's mask: refused in one line (the CLI's exit 2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tokenizer = _model(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=60,
                         max_window_layers=0, layer_types=["sliding_attention"] * 2)
    pool = _pool(Qwen2ForCausalLM(config).eval(), tokenizer)
    from auto_research.errors import UserError

    with pytest.raises(UserError, match=r"^--in-flight-updates needs a model whose KV cache is a plain dynamic cache "
                                         r"per layer \(no sliding window"):
        pool.admit(0, _ids(tokenizer, PROMPTS[0]), 1)


def test_a_pool_saved_with_its_ended_rows_still_in_the_batch_restores_and_decodes_on_the_same():
    """A state saved before rows left the batch as they ended (every row in the batch and its KV cache, the
    ``rows/`` tensors holding the batch's fields) restores: its ended rows leave the batch, and the lanes go on
    to the tokens the pool that saved it draws."""
    model, tokenizer = _model(0)
    for draw in range(20):  # the first seeds with a row ended before any lane is
        seeds = [prompt_seed(7, draw, i) for i in range(2)]
        pool = _pool(model, tokenizer)
        pool.admit_many([((i, seeds[i]), _ids(tokenizer, PROMPTS[i]), seeds[i]) for i in range(2)])
        while len(pool.batch["row"]) == pool.size and not pool.tick():
            pass
        if len(pool.lanes) == 2:
            break
    assert 0 < len(pool.batch["row"]) < pool.size == 8
    tensors, plain = pool.to_files([])
    rows, decoding = pool.size, tensors["batch/row"]
    older = {key: value for key, value in tensors.items() if not key.startswith("batch/")}
    for name in ("attention", "position", "logits", "logits_version"):
        value = tensors[f"batch/{name}"]
        every = value.new_zeros((rows, *value.shape[1:]))
        every[decoding] = value
        older[f"rows/{name}"] = every
    for index in range(plain["layers"]):
        for part in ("keys", "values"):
            value = tensors[f"cache/{index}/{part}"]
            every = value.new_zeros((rows, *value.shape[1:]))  # an ended row's cache: gone at the restore
            every[decoding] = value
            older[f"cache/{index}/{part}"] = every
    ends = {}
    for name, state in (("saving", None), ("new", tensors), ("older", older)):
        again = pool if state is None else _pool(model, tokenizer)
        if state is not None:
            assert again.from_files(state, plain) == []
            assert torch.equal(again.batch["row"], decoding)
        done = []
        while len(done) < 2:
            done += again.tick()
        ends[name] = sorted(done, key=lambda lane: lane.key)
    for name in ("new", "older"):
        for ours, theirs in zip(ends[name], ends["saving"]):
            assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.versions, theirs.versions)
            assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_swap_between_two_decode_steps_records_the_version_and_log_prob_of_each_token(recompute):
    """Weights A draw the first 3 tokens, weights B the rest. Recomputing the KV cache: every token's log-prob is
    its version's own log-prob of it given the whole history (the trainer's ``token_logprobs``). Keeping it, as the
    peers do: the tokens drawn before the swap are A's exactly, the later ones are neither A's nor B's own."""
    A, tokenizer = _model(0)
    B, _ = _model(1)
    weights_b = {name: tensor.clone() for name, tensor in B.state_dict().items()}
    model, _ = _model(0)
    pool = _pool(model, tokenizer, group_size=2, max_new=10, temperature=1.0)
    ids = _ids(tokenizer, "Q: what is 33+4?")
    eos = set(eos_ids(tokenizer, model))
    pool.admit("g", ids, 7)
    finished = []
    for _ in range(3):
        finished += pool.tick()
    model.load_state_dict(weights_b)
    pool.swap(1, recompute)
    while not finished:
        finished += pool.tick()
    lane = finished[0]
    prompt, prompt_mask, tokens, mask, logprobs, _, versions = lanes_to_rows(finished, tokenizer.pad_token_id,
                                                                            sorted(eos))
    sequences = torch.cat([prompt, tokens], dim=1)
    under = {version: token_logprobs(weights, sequences, prompt_mask, mask, group_size=2)
             for version, weights in ((0, A), (1, B))}
    first_after = 3 if recompute else 4  # kept: the logits pending at the swap were A's
    assert bool((versions[:, :first_after][mask[:, :first_after].bool()] == 0).all())
    later = mask.clone()
    later[:, :first_after] = 0
    assert later.sum() > 0, "the rows ended before the swap: nothing to check"
    assert bool((versions[later.bool()] == 1).all())
    before = mask.clone() - later
    assert torch.allclose(logprobs[before.bool()], under[0][before.bool()], atol=1e-5)
    if recompute:
        assert torch.allclose(logprobs[later.bool()], under[1][later.bool()], atol=1e-5)
    else:
        assert not torch.allclose(logprobs[later.bool()], under[1][later.bool()], atol=1e-3)
    assert lane.key == "g"


def test_the_correction_of_a_two_version_sequence_by_hand():
    """μ drew token 1 with version 0 (log μ = −1.0) and token 2 with version 1 (log μ = −0.5); π_old gives −0.8 and
    −0.9: the sequence's weight is the product of the per-token ratios, e^{0.2} · e^{−0.4} = e^{−0.2}, truncated at C."""
    from auto_research.algorithms.correction import importance_weights

    pi_old = torch.tensor([[-0.8, -0.9, 0.0]])
    mu = torch.tensor([[-1.0, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = importance_weights(pi_old - mu, mask, "sequence-tis", 2.0)
    assert torch.allclose(weights, torch.tensor([[math.exp(-0.2), math.exp(-0.2), 0.0]]), atol=1e-6)
    capped = importance_weights(torch.tensor([[0.5, 0.4, 0.0]]), mask, "sequence-tis", 2.0)
    assert torch.allclose(capped, torch.tensor([[2.0, 2.0, 0.0]]))


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "flight_rewards.py").write_text(REWARDS)
    return tmp_path


def _args(model, data, output, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "6", "--prompts-per-step", "4",
            "--group-size", "4", "--max-new-tokens", "12", "--learning-rate", "1e-2", "--evaluation-examples", "8",
            "--eval-every", "0", "--temperature", "1.0", "--offline", "--device", "cpu", "--no-progress",
            "--threads", "1", "--reward", "flight_rewards:checksum", "--output-dir", str(output), *extra]


def _rows(output: Path) -> list[dict]:
    run = next(output.iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in row.items() if not key.startswith("time_") and key not in TIMES}
            for row in rows]


def test_partial_rollouts_train_whole_groups_within_the_staleness_bound_and_repeat_exactly(
        tiny_model_dir, sums_jsonl, workdir, monkeypatch):
    from auto_research.cli import main

    monkeypatch.chdir(workdir)
    args = ("--max-staleness", "2", "--in-flight-updates")
    assert main(_args(tiny_model_dir, sums_jsonl, workdir / "a", *args)) == 0
    rows = [row for row in _rows(workdir / "a") if "staleness_max" in row]
    assert len(rows) == 6
    for row in rows:
        assert row["staleness_max"] <= 2  # no token older than K versions is trained on
        assert row["completions"] == 16  # the batch stays 4 groups of 4
    # Some completion spans two versions (the swap happened mid-completion), and later steps train on tokens of
    # the weights before the previous step.
    assert max(row["versions_per_sequence_max"] for row in rows) == 2
    assert max(row["staleness_max"] for row in rows) == 2
    assert main(_args(tiny_model_dir, sums_jsonl, workdir / "b", *args)) == 0
    assert _rows(workdir / "a") == _rows(workdir / "b")


def test_a_wider_pool_decodes_more_groups_at_once_and_hands_over_those_done_first():
    """pool_groups 3 for a step of 2: three groups decode at once, the round ends when two are done (in the order
    they finished), and the queue holds a group more before each round."""
    from auto_research.engine.partial_bounds import pool_groups
    from auto_research.engine.rollout.partial import Rounds, supply_target

    assert (supply_target(2), supply_target(2, 3), supply_target(4, 6)) == (6, 7, 14)
    assert (pool_groups(1.0, 4), pool_groups(1.5, 5), pool_groups(1.25, 4), pool_groups(1.1, 10)) == (4, 8, 5, 11)
    model, tokenizer = _model(0)
    held = {}
    for groups in (None, 3):
        rounds = Rounds(_pool(model, tokenizer, group_size=2, max_new=12))
        rounds.supply([((index, 50 + index), _ids(tokenizer, prompt), 50 + index)
                       for index, prompt in enumerate(PROMPTS + PROMPTS[:2])])
        sizes = []
        tick = rounds.pool.tick
        rounds.pool.tick = lambda: sizes.append(len(rounds.pool.lanes)) or tick()
        taken = rounds.run(0, 2, -1, False, groups)
        assert len(taken) == 2 and [lane.order for lane in taken] == sorted(lane.order for lane in taken)
        held[groups] = max(sizes)
    assert held == {None: 2, 3: 3}


def test_a_wider_pool_keeps_the_batch_and_the_bound_and_a_rollout_process_draws_the_same(
        tiny_model_dir, sums_jsonl, workdir, monkeypatch):
    """--in-flight-pool 1.5: the batch stays 4 groups of 4, no token is older than K, the rows differ from the
    pool of 1 (other groups finish first), and a rollout process (the server's pool_groups) gives the same rows."""
    from auto_research.cli import main

    monkeypatch.chdir(workdir)
    args = ("--max-staleness", "2", "--in-flight-updates", "--steps", "4")
    runs = {}
    for name, extra in (("one", ()), ("wide", ("--in-flight-pool", "1.5")),
                        ("apart", ("--in-flight-pool", "1.5", "--rollout-mode", "process"))):
        assert main(_args(tiny_model_dir, sums_jsonl, workdir / name, *args, *extra)) == 0
        runs[name] = [row for row in _rows(workdir / name) if "staleness_max" in row]
    assert len(runs["wide"]) == 4
    assert all(row["completions"] == 16 and row["staleness_max"] <= 2 for row in runs["wide"])
    assert [row["reward_mean"] for row in runs["wide"]] != [row["reward_mean"] for row in runs["one"]]
    for row in runs["apart"]:
        row.pop("weight_sync_bytes")
    assert runs["apart"] == runs["wide"]


def test_at_k_1_no_completion_spans_versions(tiny_model_dir, sums_jsonl, workdir, monkeypatch):
    """K = 1: a group carried over a round would hold a token two versions old, so it is drawn again."""
    from auto_research.cli import main

    monkeypatch.chdir(workdir)
    assert main(_args(tiny_model_dir, sums_jsonl, workdir / "a", "--max-staleness", "1", "--in-flight-updates",
                      "--steps", "4")) == 0
    rows = [row for row in _rows(workdir / "a") if "staleness_max" in row]
    assert len(rows) == 4 and all(row["versions_per_sequence_max"] == 1 for row in rows)
    assert all(row["staleness_max"] <= 1 for row in rows)


def test_in_flight_updates_refusals_are_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys, monkeypatch):
    from auto_research.cli import main

    def error(*extra) -> str:
        assert main(_args(tiny_model_dir, sums_jsonl, tmp_path, *extra)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("auto-research: error: "), lines
        return lines[0][len("auto-research: error: "):]

    assert error("--in-flight-updates") == ("--in-flight-updates needs --max-staleness K >= 1 (weights change while "
                                            "the rollout side draws; K bounds how old a trained token may be)")
    assert error("--recompute-kv-on-update") == "--recompute-kv-on-update is for --in-flight-updates"
    assert error("--in-flight-pool", "1.5") == "--in-flight-pool is for --in-flight-updates"
    for bad in ("0.5", "5", "nan"):
        assert error("--in-flight-updates", "--max-staleness", "1", "--in-flight-pool", bad) == (
            f"--in-flight-pool must be a number from 1 to 4 (times the step's groups), got {float(bad)}")
    assert error("--in-flight-updates", "--max-staleness", "1", "--sampler", "vllm") == (
        "--in-flight-updates with --sampler vllm needs --rollout-mode server (auto-research rollout-serve --engine "
        "vllm): its colocated engine is not wired to partial rollouts (docs/async.md)")
    assert error("--in-flight-updates", "--max-staleness", "1", "--algorithm", "remax").startswith(
        "--in-flight-updates with remax is not built")
    assert error("--in-flight-updates", "--max-staleness", "1", "--dynamic-sampling").startswith(
        "--in-flight-updates with --dynamic-sampling is not built")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it, checked before any process group starts
    assert error("--in-flight-updates", "--max-staleness", "1").startswith(
        "--in-flight-updates under torchrun needs rollout servers (--rollout-mode server)")
    assert not tmp_path.joinpath("rloo-sums-seed42").exists()


def test_a_rollout_process_decodes_the_rows_the_trainers_own_process_decodes(tiny_model_dir, sums_jsonl, workdir,
                                                                             monkeypatch):
    """--rollout-mode process: the continuous batch lives in the builtin rollout server (partial_serve.py), driven a
    round at a time, the weights pushed between rounds. Same seed, same rows as in the trainer's process, token
    versions and staleness included; only the push's own metric is new."""
    from auto_research.cli import main

    import os

    monkeypatch.chdir(workdir)
    args = ("--max-staleness", "2", "--in-flight-updates")
    assert main(_args(tiny_model_dir, sums_jsonl, workdir / "here", *args)) == 0
    cores = os.sched_getaffinity(0)
    assert main(_args(tiny_model_dir, sums_jsonl, workdir / "apart", *args, "--rollout-mode", "process")) == 0
    assert os.sched_getaffinity(0) == cores  # the caller's cores given back (the run pinned its thread meanwhile)
    here, apart = _rows(workdir / "here"), _rows(workdir / "apart")
    assert max(row.get("versions_per_sequence_max", 0) for row in apart) == 2  # completions spanning a push
    assert all(row.pop("weight_sync_bytes") > 0 for row in apart if "staleness_max" in row)
    assert here == apart


@pytest.mark.parametrize("recompute, mode", [(False, "colocate"), (True, "colocate"), (False, "process")])
def test_a_sigkill_then_resume_gives_the_rows_of_the_uninterrupted_run(tiny_model_dir, sums_jsonl, workdir, recompute,
                                                                       mode):
    """The checkpoint holds the next batch and the rollout side as its round left it (groups mid-completion with
    their KV caches, groups done but not handed over, the queue): the resumed run's rows are the same. In a rollout
    process that state is the server's, read at the checkpoint and restored into the new process."""
    import os

    from safetensors.torch import load_file

    from conftest import kill_after_checkpoint, run_cli

    env = {"PYTHONPATH": str(workdir) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Every checkpoint kept: a fast run (about 15 ms a step on an idle AMD EPYC) reached step 5 and pruned
    # step-000002 between two of kill_after_checkpoint's looks, 3 times in 12 runs.
    common = ("--max-staleness", "2", "--in-flight-updates", "--checkpoint-every", "2", "--steps", "5",
              "--keep-checkpoints", "3", "--rollout-mode", mode, *(("--recompute-kv-on-update",) if recompute else ()))
    whole = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "whole", *common), env=env, cwd=workdir)
    assert whole.returncode == 0, whole.stderr[-3000:]
    rows = _rows(workdir / "whole")
    killed = workdir / "killed"
    args = _args(tiny_model_dir, sums_jsonl, killed, *common)
    checkpoint = killed / "rloo-sums-seed42" / "checkpoints" / "step-000002"
    kill_after_checkpoint(args, {**os.environ, **env}, checkpoint)
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["in_flight"][0]
    assert [batch["step"] for batch in saved[:-1]] == [3] and saved[-1]["side"]["lanes"]  # groups mid-completion
    resumed = run_cli(*args, "--resume", env=env, cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _rows(killed) == rows
    final = sorted((next(killed.iterdir()) / "checkpoints").iterdir())[-1] / "model.safetensors"
    expected = sorted((next((workdir / "whole").iterdir()) / "checkpoints").iterdir())[-1] / "model.safetensors"
    got, want = load_file(str(final)), load_file(str(expected))
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_restored_rounds_refuse_a_finished_group_whose_tensors_disagree_before_touching_the_pool():
    """Rounds.restore checks the groups done and the queue before the pool takes anything (a rollout server answers
    the ValueError with a 400)."""
    import types

    from auto_research.engine.rollout.partial import Rounds

    taken = []
    rounds = Rounds(types.SimpleNamespace(K=2, from_files=lambda tensors, plain: taken.append(plain) or []))
    good = {"finished/0/tokens": torch.zeros(2, 3, dtype=torch.long), "finished/0/logprobs": torch.zeros(2, 3),
            "finished/0/versions": torch.zeros(2, 3, dtype=torch.long), "finished/0/entropies": torch.zeros(2, 3)}
    plain = {"finished": [{"key": [0, 7], "order": 0, "prompt_ids": [5]}], "pending": [[[1, 8], [5, 6], 8]],
             "requeued": 0}
    for name, bad in (("entropies", torch.zeros(1, 3)), ("logprobs", torch.zeros(2, 2))):
        with pytest.raises(ValueError, match=r"^finished group 0 is not 2 rows of tokens, log-probs, versions"):
            rounds.restore({**good, f"finished/0/{name}": bad}, plain)
    with pytest.raises(ValueError, match=r"^a queued group is not \[\[prompt index, seed\], prompt ids, seed\]"):
        rounds.restore(good, {**plain, "pending": [[[1, True], [5], True]]})
    assert not taken
    rounds.restore(good, plain)
    assert len(taken) == 1 and list(rounds.pending) == [((1, 8), [5, 6], 8)]
