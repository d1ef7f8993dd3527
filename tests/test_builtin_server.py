"""The builtin sampler as a rollout server (``rollout-serve --engine builtin``, ``--sampler builtin --rollout-mode
server``): a CPU-only run's rollout side in a process of its own. No vLLM is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from auto_research.engine.rollout import SamplingSettings, prompt_seed
from auto_research.engine.rollout.builtin import BuiltinEngine, sample
from auto_research.engine.tiny import build_model, build_tokenizer

PROMPTS = ["1+2=", "Q: what is 33+4?", "x", "7*8="]


def start_builtin_server(port: int = 0, shared_folder=None, model=None):
    """A builtin engine (``model``, else the embedded architecture at seed 0) behind the real HTTP server, in this
    process; shared-memory buffers in ``shared_folder`` (None: HTTP only)."""
    from auto_research.engine.rollout.guard import weight_spec
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.rollout.server import Limits, Served, fingerprint, make_server

    tokenizer = build_tokenizer()
    served_model = model if model is not None else build_model(tokenizer, seed=0)
    engine = BuiltinEngine(served_model, tokenizer)
    served = Served("embedded", fingerprint(served_model.config, tokenizer),
                    weight_spec(pushed_weights(served_model, torch.float32)), served_model.config.vocab_size, "float32")
    server = make_server(engine, served, "127.0.0.1", port, Limits(shared_folder=shared_folder))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, engine


def stop(server) -> None:
    server.shutdown()
    server.intake.close()
    server.server_close()


@pytest.fixture
def builtin_server(monkeypatch):
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    server, engine = start_builtin_server()
    yield engine, f"127.0.0.1:{server.server_address[1]}"
    stop(server)


def lease_held(address: str) -> bool:
    from urllib.request import urlopen

    with urlopen(f"http://{address}/health", timeout=10) as answer:
        return json.loads(answer.read())["lease"]["held"]


def test_the_server_draws_what_the_trainers_own_sampler_draws_from_the_pushed_weights(builtin_server, tmp_path):
    """The trainer's weights (not the server's initial ones) pushed through the real HTTP server, then one draw:
    the same token ids as ``sample`` in the trainer's process, in requests of 3 prompts, and the same log-probs to
    fp32 rounding (the server's request thread need not run this thread's kernels)."""
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler

    engine, address = builtin_server
    tokenizer = build_tokenizer()
    trained = build_model(tokenizer, seed=1)
    settings = SamplingSettings(max_new_tokens=8, temperature=1.2, top_p=0.95, top_k=20)
    client = ServerSampler(trained, tokenizer, settings, address, "embedded", World(), tmp_path / "run",
                           engine="builtin", chunk_prompts=3)
    seeds = [prompt_seed(5, 1, index) for index in range(len(PROMPTS))]
    drawn = client.sample(PROMPTS, 3, seeds)
    assert lease_held(address)
    client.close()
    assert not lease_held(address)
    assert client.transfer == "HTTP"  # this server offers no shared buffer
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    parts = [sample(trained, tokenizer, PROMPTS[start: start + 3], 3, 8, 1.2, 0.95, 20, seeds=seeds[start: start + 3])
             for start in (0, 3)]
    expected = [row for part in parts for row in part.token_lists()]
    assert drawn.token_lists() == expected
    expected_logprobs = [value for part in parts for row, mask in zip(part.sampler_logprobs, part.completion_mask)
                         for value in row[mask.bool()].tolist()]
    # Not bit for bit: the same batches, but the forward runs on the server's request thread, whose kernels may sum
    # in another order (an Intel Xeon drew -2.85574222 against -2.85574245, one ulp). Rounding through the 3 layers
    # is a few ulps of each logit, under 1e-5 for log-probs above -20; weights other than the pushed ones, or another
    # temperature, move them by 1e-3 or more.
    logprobs = drawn.sampler_logprobs[drawn.completion_mask.bool()]
    difference = float((logprobs.double() - torch.tensor(expected_logprobs, dtype=torch.float64)).abs().max())
    print(f"log-probs: largest difference {difference:.2e} (bound 1e-5)")
    assert difference <= 1e-5, difference
    assert not drawn.trained_distribution  # another process's forward: the trainer computes π_old itself


def metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_k1_in_a_rollout_process_trains_on_the_batches_the_in_process_thread_draws(tmp_path):
    """--max-staleness 1 with the rollout side in a process the run starts (--rollout-mode process: the builtin
    rollout server on a core of its own) and with it in a thread: the fixed schedule makes them draw the same
    batches from the same versions of the weights (the same rewards at every step), and train to the same
    weights up to the two processes' kernels (the server's log-probs are μ, not π_old). The process is gone
    once the run is."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("AUTO_RESEARCH_API_KEY", None)
    # The embedded model warm-started on arithmetic (cached by the first test that needs it): rewards vary.
    common = ["post-train", "--dataset", "arithmetic-generate", "--steps", "4", "--prompts-per-step", "8",
              "--offline", "--no-progress", "--max-staleness", "1", "--eval-every", "0", "--threads", "1",
              "--evaluation-examples", "8"]
    runs = {}
    for name, extra in (("thread", []), ("process", ["--rollout-mode", "process"])):
        done = subprocess.run([sys.executable, "-m", "auto_research", *common, *extra, "--output-dir",
                               str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[name] = metrics(next((tmp_path / name).iterdir()))
    last_core = max(os.sched_getaffinity(0))
    assert f"sampling with a builtin rollout process on CPU(s) [{last_core}]" in done.stderr
    started_by_a_run = "rollout-serve --engine builtin --host 127.0.0.1 --port 0"
    assert started_by_a_run not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    thread, served = runs["thread"], runs["process"]
    assert [row["staleness_max"] for row in served] == [0, 1, 1, 1]
    assert [row["reward_mean"] for row in served] == [row["reward_mean"] for row in thread]
    assert [row["weight_sync_seconds"] > 0 for row in served] == [True] * 4
    for mine, theirs in zip(served, thread):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)
        assert mine["rollout_logprob_diff_mean"] == pytest.approx(theirs["rollout_logprob_diff_mean"], abs=1e-4)
    assert served[-1]["rollout_logprob_diff_mean"] > 1e-3  # the weights moved: one version of staleness shows


def test_rollout_process_refusals_are_one_line(capsys):
    from auto_research.cli import main

    def error(*extra) -> str:
        assert main(["post-train", "--dataset", "arithmetic-generate", "--steps", "2", *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    cores = sorted(os.sched_getaffinity(0))
    assert error("--rollout-mode", "process", "--sampler", "vllm") == (
        "--rollout-mode process starts the builtin sampler's server; for vLLM start auto-research rollout-serve "
        "and use --rollout-mode server")
    assert error("--rollout-mode", "process", "--rollout-cores", "1-x") == (
        "--rollout-cores '1-x': expected CPU numbers or ranges, e.g. 1 or 2-3")
    assert error("--rollout-mode", "process", "--rollout-cores", "4096") == (
        f"--rollout-cores '4096': this process may run on CPUs {cores} only")
    spelled = ",".join(map(str, cores))
    assert error("--rollout-mode", "process", "--rollout-cores", spelled) == (
        f"--rollout-cores {spelled!r} takes every CPU this process may use; leave the trainer one")
    assert error("--rollout-cores", str(cores[0])) == "--rollout-cores is for --rollout-mode process"
    before = os.sched_getaffinity(0)
    try:  # a process left one CPU (a pinned container, say) has none to give its rollout process
        os.sched_setaffinity(0, {cores[0]})
        assert error("--rollout-mode", "process") == (
            f"--rollout-mode process needs two CPUs, the rollout process's and the trainer's, and this process may "
            f"run on CPU {cores[0]} only (use --rollout-mode colocate)")
    finally:
        os.sched_setaffinity(0, before)


def test_a_server_restarted_under_a_run_is_refused_before_its_samples_are_trained_on(monkeypatch, tmp_path):
    """The server dies and comes back on the same port (a supervisor) between a push and the next draw: it would
    sample from its initial weights; the trainer's client refuses the answer, naming the restart."""
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.errors import RolloutEngineError

    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    server, _ = start_builtin_server()
    port = server.server_address[1]
    tokenizer = build_tokenizer()
    client = ServerSampler(build_model(tokenizer, seed=1), tokenizer, SamplingSettings(4), f"127.0.0.1:{port}",
                           "embedded", World(), tmp_path / "run", engine="builtin")
    seeds = [prompt_seed(5, 1, index) for index in range(len(PROMPTS))]
    assert len(client.sample(PROMPTS, 2, seeds).completions) == 8  # version 1, this run's
    stop(server)
    server, _ = start_builtin_server(port)
    try:
        with pytest.raises(RolloutEngineError) as caught:
            client.sample(PROMPTS, 2, seeds)
        assert str(caught.value) == (f"--rollout-server 127.0.0.1:{port} restarted since this run pushed its weights "
                                     "(its samples would come from another policy)")
        client.close()
    finally:
        stop(server)


def test_a_trainer_built_from_python_gives_the_servers_lease_back_when_closed(builtin_server, tmp_path):
    """``Trainer.close`` closes the sampler too: the next run (here, a second Trainer) may take the server."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    _, address = builtin_server
    for run in ("first", "second"):
        config = GenerationConfig(dataset="arithmetic-generate", steps=2, prompts_per_step=4, eval_every=0,
                                  evaluation_examples=4, offline=True, progress=False, output_dir=tmp_path / run,
                                  sampler="builtin", vllm_mode="server", vllm_server=address)
        trainer = Trainer.build(config, log=lambda line: None)
        assert trainer.step(1)["weight_sync_seconds"] > 0 and lease_held(address)
        trainer.close()
        assert not lease_held(address)


def test_multi_turn_trajectories_through_a_live_server_are_the_trainer_s_own_token_for_token(builtin_server, tmp_path,
                                                                                              game):
    """An environment's episodes drawn through the real HTTP server (``generate_ids``: one completion per history,
    the history sent as token ids) against the same episodes drawn by the trainer's own sampler from the pushed
    weights: the same prompt ids, trajectory ids, loss masks, turns, truncation flags and rewards, and log-probs to
    float32 rounding."""
    from auto_research.data.types import Example
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.builtin import BuiltinSampler
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.envs import EnvironmentFactory
    from auto_research.envs.rollout import EpisodeRunner

    engine, address = builtin_server
    tokenizer = build_tokenizer()
    trained = build_model(tokenizer, seed=1)
    settings = SamplingSettings(max_new_tokens=4, temperature=1.3)
    factory = EnvironmentFactory.load("sums_game:make_env", {"answer": "7"})
    examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((3, 4), (1, 1), (5, 2))]
    client = ServerSampler(trained, tokenizer, settings, address, "embedded", World(), tmp_path / "run",
                           engine="builtin", chunk_prompts=2)
    client.load_weights(trained)
    runs = {}
    for name, sampler in (("server", client), ("trainer", BuiltinSampler(trained, tokenizer, settings, 2))):
        runner = EpisodeRunner(sampler.generate_ids, tokenizer, factory, {}, settings, 3, 16,
                               (tokenizer.eos_token_id,), tokenizer.pad_token_id)
        runs[name] = runner.trajectories(examples, 3, [11, 12, 13])
    client.close()
    assert len(runs["server"]) == len(runs["trainer"]) == 9
    for ours, theirs in zip(runs["server"], runs["trainer"]):
        for key in ("prompt_ids", "ids", "loss_mask", "turns", "truncated", "reward"):
            assert getattr(ours, key) == getattr(theirs, key), key
        # The same draws; the odd first token's log-prob differs in its last float32 bits between the server's
        # request thread and this one (the trainer recomputes π_old from its own forward in any case): to fp32
        # rounding, as in the test of one draw above.
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    largest = max(abs(a - b) for ours, theirs in zip(runs["server"], runs["trainer"])
                  for a, b in zip(ours.logprobs, theirs.logprobs))
    print(f"log-probs: largest difference {largest:.2e} (bound 1e-5)")
    assert sum(t.turns for t in runs["server"]) > 9  # some went on after the environment answered "no"
    assert any(0 in t.loss_mask for t in runs["server"])  # environment tokens, masked out


def _call(address: str, path: str, body=None, lease: str | None = None) -> tuple[int, object]:
    """(status, JSON answer, or the bytes of a binary one)."""
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = urllib.request.Request(f"http://{address}{path}", data=data, headers={"X-Lease": lease} if lease else {})
    try:
        with urllib.request.urlopen(sent, timeout=60) as answer:
            raw = answer.read()
            return answer.status, raw if answer.headers["Content-Type"] == "application/octet-stream" else json.loads(raw)
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        assert text.count("\n") == 0, text  # one JSON line
        return error.code, json.loads(text)["error"]


def test_partial_rounds_belong_to_the_lease_holder_come_in_order_and_their_state_goes_back_exactly(builtin_server):
    """/partial/round, /partial/state and /partial/restore (partial_serve.py): what a run with --in-flight-updates
    in a rollout server sends, and each refusal a line."""
    engine, address = builtin_server
    tokenizer = build_tokenizer()
    status, lease = _call(address, "/lease", {"holder": {"host": "h", "pid": 1, "run": "/r"}, "secret": "5" * 64})
    assert status == 200
    lease = lease["lease"]
    supply = [[[index, 100 + index], tokenizer(prompt, add_special_tokens=False)["input_ids"], 100 + index]
              for index, prompt in enumerate(PROMPTS * 3)]
    body = {"round": 1, "version": 0, "weights_version": 0, "per_step": 4, "oldest_allowed": -1,
            "recompute_kv": False, "group_size": 2, "supply": supply,
            "settings": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    status, refusal = _call(address, "/partial/round", body)
    assert status == 409 and refusal.startswith("this request does not carry the server's lease")
    assert _call(address, "/partial/round", body, "x" * 32) == (status, refusal)
    assert _call(address, "/partial/round", {**body, "weights_version": 3}, lease) == (
        409, "the round names weights version 3, but the server holds version 0")
    assert _call(address, "/partial/round", {**body, "supply": [[[0, 1], [5], 2]]}, lease) == (
        400, "supply item 0 must be [[prompt index, seed], prompt ids, seed]")
    assert _call(address, "/partial/round", {**body, "supply": supply[:11]}, lease) == (
        400, "the queue would hold 11 groups; a round needs 12 (3 steps' worth, and the pool's extra groups) so as "
             "never to run dry")
    assert _call(address, "/partial/round", {**body, "pool_groups": 3}, lease) == (
        400, "pool_groups must be an integer in 4..16, got 3")
    assert _call(address, "/partial/round", {**body, "pool_groups": 6}, lease) == (  # 2 more groups at the start
        400, "the queue would hold 12 groups; a round needs 14 (3 steps' worth, and the pool's extra groups) so as "
             "never to run dry")
    assert _call(address, "/partial/round", {**body, "settle": 1}, lease) == (
        400, "recompute_kv and settle must be true or false")
    assert _call(address, "/partial/round", {**body, "pools": 6}, lease) == (
        400, "a round has the fields round, version, weights_version, per_step, oldest_allowed, recompute_kv, "
             "group_size, settings, supply (and pool_groups, settle, optionally)")
    assert _call(address, "/partial/round", {**body, "supply": supply[:11] + supply[:1]}, lease) == (
        400, "supply holds a group twice (its [prompt index, seed])")
    status, first = _call(address, "/partial/round", body, lease)
    assert status == 200 and len(first["lanes"]) == 4
    lanes = first["lanes"]
    assert all(len(lane["tokens"]) == 2 and set(sum(lane["versions"], [])) <= {0, -1} for lane in lanes)
    # The pool holds 4 groups; the 4 done were replaced from the queue: 12 supplied, 8 admitted so far at least.
    assert first["pending"] <= 12 - 8 and first["requeued"] == 0
    status, saved = _call(address, "/partial/state", {"round": 1}, lease)
    assert status == 200 and isinstance(saved, bytes)
    assert _call(address, "/partial/state", {"round": 7}, lease) == (404, "no state of round 7 is kept for this "
                                                                          "lease (kept: [1])")
    assert _call(address, "/partial/round", {**body, "round": 3}, lease) == (
        409, "round 3 after round 1: rounds come one at a time, in order")
    status, refusal = _call(address, "/partial/round", {**body, "round": 2}, lease)  # groups queued already
    assert status == 400 and refusal.startswith("supply holds group [") and refusal.endswith(
        "which these rounds hold already")
    second = {**body, "round": 2, "supply": supply[:8]}  # fresh groups for the queue (held ones are refused)
    second["supply"] = [[[index + 100, seed], ids, seed] for (index, seed), ids, seed in supply[:8]]
    status, after = _call(address, "/partial/round", second, lease)
    assert status == 200
    assert _call(address, "/partial/round", second, lease) == (200, after)  # sent again: the same answer
    # The state of round 1 put back: round 2 again draws the very same groups, tokens and log-probs.
    assert _call(address, "/partial/restore", saved, lease) == (200, {"round": 1})
    status, again = _call(address, "/partial/round", second, lease)
    assert status == 200 and again["lanes"] == after["lanes"]
    assert _call(address, "/partial/state", {"round": 1}, lease) == (200, saved)  # the round ran on a copy of it
    assert _call(address, "/partial/restore", b"not a state", lease)[0] == 400
    # A state that does not fit (a tampered checkpoint) is refused at its restore, not at the next round.
    import safetensors.torch

    from auto_research.engine.rollout.partial_serve import read_state

    tensors, plain = read_state(saved)

    def tampered(**changes):
        changed = {**tensors, **{key: value for key, value in changes.items() if not key.startswith("plain_")}}
        return safetensors.torch.save(changed, metadata={"plain": json.dumps(
            {**plain, **{key[len("plain_"):]: value for key, value in changes.items() if key.startswith("plain_")}})})

    decoding = len(tensors["batch/row"])  # the rows not yet ended
    narrowed = {"batch/attention": tensors["batch/attention"][:, 1:].contiguous()}
    short = {"cache/0/keys": tensors["cache/0/keys"][1:].contiguous()}
    outside = {"plain_pending": [[key, [engine.tokenizer.vocab_size + 5], seed] for key, _, seed in plain["pending"]]}
    for changes, why in ((narrowed, f"cache layer 0 does not hold {decoding} rows of"),
                         (short, f"cache layer 0 does not hold {decoding} rows of"),
                         ({"plain_lanes": plain["lanes"][1:]}, "rows/t has shape"),
                         ({"batch/row": tensors["batch/row"][1:].contiguous()}, "batch/attention has shape"),
                         ({"batch/row": tensors["batch/row"].flip(0).contiguous() * 0},
                          "batch/row does not name each row still decoding once"),
                         ({"batch/row": tensors["batch/row"].bool()}, "batch/row holds torch.bool"),
                         ({"rows/ended": tensors["rows/ended"].long()}, "rows/ended holds torch.int64"),
                         ({"rows/t": torch.full_like(tensors["rows/t"], 6)},  # a row not ended, its budget spent
                          "rows/t counts tokens outside 0..6 (and below it for a row not ended)"),
                         ({"cache/0/keys": tensors["cache/0/keys"][:, :, 1:].contiguous(),
                           "cache/0/values": tensors["cache/0/values"][:, :, 1:].contiguous()},
                          f"cache layer 0 does not hold {decoding} rows of"),
                         ({"plain_layers": 4}, "the cache has 4 layers, the model 3"),
                         (outside, "a prompt is not token ids of a vocabulary of"),
                         ({"plain_pending": [[key[:1], ids, seed] for key, ids, seed in plain["pending"]]},
                          "a queued group is not [[prompt index, seed], prompt ids, seed]"),
                         ({"rows/t": tensors["rows/t"].float()}, "rows/t holds torch.float32"),
                         ({"cache/1/keys": tensors["cache/1/keys"][:, :1].contiguous(),
                           "cache/1/values": tensors["cache/1/values"][:, :1].contiguous()},
                          "cache layer 1 is not 3 heads of 32 values in one float dtype"),
                         ({"cache/0/values": tensors["cache/0/values"].double()},
                          "cache layer 0 is not 3 heads of 32 values in one float dtype")):
        status, refusal = _call(address, "/partial/restore", tampered(**changes), lease)
        assert status == 400 and refusal.startswith("the state does not fit this server's model and rounds: " + why), \
            refusal
    assert _call(address, "/partial/restore", saved, lease) == (200, {"round": 1})  # the good one still goes in
    assert _call(address, "/partial/round", {**second, "round": 3, "supply": [],
                                             "settings": {**body["settings"], "top_k": 5}}, lease)[0] == 400
    # The lease given back: its rounds go with it.
    assert _call(address, "/lease/release", {}, lease) == (200, {})
    status, lease = _call(address, "/lease", {"holder": {"host": "h", "pid": 1, "run": "/r"}, "secret": "5" * 64})
    assert _call(address, "/partial/state", {"round": 2}, lease["lease"]) == (
        404, "no state of round 2 is kept for this lease (kept: none)")


def test_a_round_the_engine_failed_is_a_500_then_a_409_naming_it_and_a_new_lease_starts_afresh(
        builtin_server, monkeypatch):
    """The engine failing mid-round leaves the rounds half done: that round sent again (the trainer's client retries
    a 500) or any later one is refused with the failure named, never run on what the failed one left (which read as
    "supply holds group ..., which these rounds hold already"). A new lease starts a new session."""
    from auto_research.engine.rollout.partial import Rounds

    _, address = builtin_server
    tokenizer = build_tokenizer()
    lease = _call(address, "/lease", {"holder": {"host": "h", "pid": 1, "run": "/r"}, "secret": "6" * 64})[1]["lease"]
    supply = [[[index, 100 + index], tokenizer(prompt, add_special_tokens=False)["input_ids"], 100 + index]
              for index, prompt in enumerate(PROMPTS * 3)]
    body = {"round": 1, "version": 0, "weights_version": 0, "per_step": 4, "oldest_allowed": -1,
            "recompute_kv": False, "group_size": 2, "supply": supply,
            "settings": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    first = _call(address, "/partial/round", body, lease)
    assert first[0] == 200
    fresh = [[[index + 100, seed], ids, seed] for (index, seed), ids, seed in supply[:8]]
    second = {**body, "round": 2, "supply": fresh}
    run = Rounds.run

    def failing(self, *args):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(Rounds, "run", failing)
    assert _call(address, "/partial/round", second, lease) == (500, "the engine failed: RuntimeError: the device "
                                                                     "fell over")
    monkeypatch.setattr(Rounds, "run", run)
    gone = ("round 2 failed in this server's engine (RuntimeError: the device fell over): this lease's partial "
            "rollouts are gone; --resume the run from its last checkpoint")
    assert _call(address, "/partial/round", second, lease) == (409, gone)
    assert _call(address, "/partial/round", {**second, "round": 3}, lease) == (409, gone)
    assert _call(address, "/partial/state", {"round": 1}, lease)[0] == 200  # what a checkpoint read before is kept
    # The lease given back and taken again (a run started afresh): a new session, whose first round is the same.
    assert _call(address, "/lease/release", {}, lease) == (200, {})
    lease = _call(address, "/lease", {"holder": {"host": "h", "pid": 2, "run": "/r"}, "secret": "6" * 64}
                  )[1]["lease"]
    assert _call(address, "/partial/round", body, lease) == first
    # The state's copy failing (the device's memory, say) after the round took its groups out: the same.
    monkeypatch.setattr(Rounds, "to_files", failing)
    assert _call(address, "/partial/round", second, lease)[0] == 500
    monkeypatch.undo()
    assert _call(address, "/partial/round", second, lease) == (409, gone)


def test_in_flight_updates_against_a_server_that_cannot_decode_partial_rollouts_is_one_line(builtin_server, tmp_path,
                                                                                          capsys):
    """A vLLM server, or a builtin one older than partial_serve.py, says ``"partial": false`` (or nothing)."""
    from auto_research.cli import main

    engine, address = builtin_server
    engine.partial_rollouts = False  # as an engine without the continuous batch
    assert main(["post-train", "--dataset", "arithmetic-generate", "--steps", "2", "--rollout-mode", "server",
                 "--rollout-server", address, "--max-staleness", "1", "--in-flight-updates",
                 "--output-dir", str(tmp_path), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"auto-research: error: --in-flight-updates: the rollout server at {address} cannot decode "
                         "partial rollouts (it needs auto-research rollout-serve --engine builtin or vllm, of this "
                         "version or later, without --enable-lora)")
    assert not lease_held(address)  # the run gave the lease back


def test_a_restore_is_checked_by_the_rules_of_the_rounds_it_replaces(builtin_server):
    """/partial/restore refuses what a round would: log-probs that are NaN or above 0, versions beyond the run's,
    settings over a round's bounds, more groups than rounds can hold, tensors no round saves, and a body larger than
    such a state can be (refused before it is read). Each is a 4xx line, and the lease's rounds stay as they were."""
    import safetensors.torch

    from auto_research.engine.rollout.partial_serve import read_state

    _, address = builtin_server
    tokenizer = build_tokenizer()
    lease = _call(address, "/lease", {"holder": {"host": "h", "pid": 1, "run": "/r"}, "secret": "7" * 64})[1]["lease"]
    supply = [[[index, 100 + index], tokenizer(prompt, add_special_tokens=False)["input_ids"], 100 + index]
              for index, prompt in enumerate(PROMPTS * 3)]
    body = {"round": 1, "version": 0, "weights_version": 0, "per_step": 4, "oldest_allowed": -1,
            "recompute_kv": False, "group_size": 2, "supply": supply,
            "settings": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    assert _call(address, "/partial/round", body, lease)[0] == 200
    saved = _call(address, "/partial/state", {"round": 1}, lease)[1]
    fresh = [[[index + 100, seed], ids, seed] for (index, seed), ids, seed in supply[:8]]
    assert _call(address, "/partial/round", {**body, "round": 2, "supply": fresh}, lease)[0] == 200
    kept = _call(address, "/partial/state", {"round": 2}, lease)
    assert kept[0] == 200
    tensors, plain = read_state(saved)

    def tampered(extra=None, **changes):
        changed = {**tensors, **(extra or {})}
        return safetensors.torch.save(changed, metadata={"plain": json.dumps({**plain, **changes})})

    logprobs = tensors["rows/logprobs"]
    nan, positive = logprobs.clone(), logprobs.clone()
    nan[0, 0], positive[0, 0] = float("nan"), 0.5
    versions = tensors["rows/versions"].clone()
    versions[0, 0] = 10**15
    done = len(plain["finished"])
    held = len(plain["lanes"]) + done
    many = [[[index, index], [5], index] for index in range(1000, 21000)]  # 20,000 groups queued
    rules = "the state breaks a round's rules: "
    for (status, message), body_of in (
            ((400, rules + "rows/logprobs holds log-probs that are NaN, infinite or above 0"),
             tampered({"rows/logprobs": nan})),
            ((400, rules + "rows/logprobs holds log-probs that are NaN, infinite or above 0"),
             tampered({"rows/logprobs": positive})),
            ((400, rules + "version must be an integer in 0..1, got 1000000000000000"), tampered(version=10**15)),
            ((400, rules + "rows/versions holds versions outside -1..0 (the state's version)"),
             tampered({"rows/versions": versions})),
            ((400, rules + "per_step must be an integer in 1..4096, got 1000000"),
             tampered(config={**plain["config"], "per_step": 10**6})),
            ((400, rules + f"the state holds {20000 + held} groups (queued, decoding and done); rounds of 4 groups a "
                           "step, 4 decoding at once, hold at most 24"), tampered(pending=many)),
            ((400, rules + "the state holds a tensor 'extra/blob', which no round saves"),
             tampered({"extra/blob": torch.zeros(4)})),
            ((400, rules + f"the state holds a tensor 'finished/{done}/tokens', which no round saves"),
             tampered({f"finished/{done}/tokens": torch.zeros(2, 6, dtype=torch.long)}))):  # one group too many
        assert _call(address, "/partial/restore", body_of, lease) == (status, message)
        assert _call(address, "/partial/state", {"round": 2}, lease) == kept  # the rounds as they were
    # A 64 MiB tensor: the body is over what a state of these settings can be, refused from its header alone.
    status, refusal = _call(address, "/partial/restore", tampered({"extra/blob": torch.zeros(2**24)}), lease)
    assert status == 413 and refusal.startswith("a state of ") and "bytes is over the " in refusal, refusal
    assert refusal.endswith("bytes that rounds of 4 groups a step (4 decoding at once) of 2 completions of up to "
                            "6 new tokens can hold"), refusal
    assert _call(address, "/partial/state", {"round": 2}, lease) == kept
    assert _call(address, "/partial/restore", saved, lease) == (200, {"round": 1})  # the good one still goes in
