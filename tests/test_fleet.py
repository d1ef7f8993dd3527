"""Several rollout servers behind one trainer (``--rollout-server A,B``, engine/rollout/fleet.py): the same draws
as one server, a server that fails left behind with its groups drawn again, a restarted one rejoining only with
the current weights, and one line when none is left. Builtin servers in this process, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from auto_research.engine.rollout import SamplingSettings, prompt_seed
from auto_research.engine.tiny import build_model, build_tokenizer
from tests.conftest import largest_difference, rms_difference
from tests.test_builtin_server import PROMPTS, lease_held, start_builtin_server, stop
from tests.test_distributed import workdir  # noqa: F401 - a fixture: the reward module torchrun's ranks import

SETTINGS = SamplingSettings(max_new_tokens=6, temperature=1.2, top_p=0.95, top_k=20)


@pytest.fixture
def servers(monkeypatch):
    """start(n) → n builtin servers' addresses; every server still running is stopped at the end."""
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    running, engines = [], []

    def start(n: int = 1, port: int = 0) -> list[str]:
        started = [start_builtin_server(port) for _ in range(n)]
        running.extend(server for server, _ in started)
        engines.extend(engine for _, engine in started)
        return [f"127.0.0.1:{server.server_address[1]}" for server, _ in started]

    start.running, start.engines = running, engines
    yield start
    for server in running:
        try:
            stop(server)
        except OSError:
            pass


def _client(address, model, tmp_path, chunk=2):
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler

    return ServerSampler(model, build_tokenizer(), SETTINGS, address, "embedded", World(), tmp_path / "run",
                         engine="builtin", chunk_prompts=chunk)


def _fleet(addresses, model, tmp_path, lines=None, chunk=2):
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.fleet import Fleet

    return Fleet(lambda address, weights: _client(address, weights, tmp_path, chunk), addresses, model, World(),
                 (lines if lines is not None else []).append, chunk)


def _draws(sampler, prompts=PROMPTS * 2, group_size=3, step=1):
    seeds = [prompt_seed(5, step, index) for index in range(len(prompts))]
    drawn = sampler.sample(prompts, group_size, seeds)
    logprobs = drawn.sampler_logprobs[drawn.completion_mask.bool()]
    return drawn.token_lists(), logprobs


@pytest.mark.parametrize("n", [2, 3])
def test_two_or_three_servers_draw_the_token_ids_of_one(servers, tmp_path, n):
    """8 prompts in units of 2 over n servers, each unit to whichever server is idle: the same token ids as one
    server, and the same log-probs (each unit is a request of the shapes one server gets)."""
    trained = build_model(build_tokenizer(), seed=1)
    one = _client(servers(1)[0], trained, tmp_path / "one")
    expected_ids, expected_logprobs = _draws(one)
    one.close()
    lines = []
    fleet = _fleet(servers(n), trained, tmp_path / "fleet", lines)
    ids, logprobs = _draws(fleet)
    fleet.close()
    assert ids == expected_ids
    assert torch.allclose(logprobs, expected_logprobs, atol=1e-5, rtol=0)
    assert lines == []


def test_a_server_that_fails_leaves_the_pool_and_the_others_draw_its_groups_with_the_same_seeds(servers, tmp_path):
    trained = build_model(build_tokenizer(), seed=1)
    one = _client(servers(1)[0], trained, tmp_path / "one")
    expected = _draws(one)[0]
    one.close()
    lines = []
    addresses = servers(2)
    fleet = _fleet(addresses, trained, tmp_path / "fleet", lines)
    stop(servers.running[-1])  # the second server is gone before the draw: its requests are refused
    assert _draws(fleet)[0] == expected
    assert len(lines) == 1 and lines[0].startswith(f"rollout server {addresses[1]} left the pool (--rollout-server "
                                                   f"{addresses[1]}: /generate failed")
    assert lines[0].endswith("; 1 of 2 serve on")
    assert list(fleet.members) == [addresses[0]]
    fleet.close()


def test_a_restarted_server_rejoins_only_holding_the_current_weights(servers, tmp_path, monkeypatch):
    """The second server dies and a new one (its initial weights, a new instance) starts on its port: the next push
    gives it this run's lease and the current weights before it draws again."""
    from auto_research.engine.rollout import fleet as fleets

    monkeypatch.setattr(fleets, "REJOIN_SECONDS", 0.0)
    trained = build_model(build_tokenizer(), seed=1)
    lines = []
    addresses = servers(2)
    fleet = _fleet(addresses, trained, tmp_path / "fleet", lines)
    stop(servers.running[-1])
    before = _draws(fleet)[0]
    assert list(fleet.members) == [addresses[0]]
    port = int(addresses[1].rsplit(":", 1)[1])
    server, engine = start_builtin_server(port)
    servers.running.append(server)
    assert not all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    with torch.no_grad():
        for parameter in trained.parameters():  # an optimizer step
            parameter.add_(0.01)
    fleet.load_weights(trained)
    assert list(fleet.members) == addresses
    assert lines[-1].startswith(f"rollout server {addresses[1]} joined the pool again with the current weights "
                                "through HTTP (it had left: ")
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    after = _draws(fleet, step=2)[0]
    fleet.close()
    one = _client(servers(1)[0], trained, tmp_path / "one")  # a server of its own with these weights
    assert after == _draws(one, step=2)[0] and after != before
    one.close()


def test_no_server_left_is_one_line_naming_each(servers, tmp_path):
    from auto_research.errors import RolloutEngineError

    trained = build_model(build_tokenizer(), seed=1)
    addresses = servers(2)
    fleet = _fleet(addresses, trained, tmp_path / "fleet")
    for server in servers.running:
        stop(server)
    with pytest.raises(RolloutEngineError) as caught:
        _draws(fleet)
    message = str(caught.value)
    assert message.startswith("--rollout-server: every rollout server of this run has left the pool (")
    assert all(f"{address}: --rollout-server {address}: /generate failed" in message for address in addresses)
    fleet.close()


def test_multi_turn_histories_stay_on_the_server_that_drew_their_first_turn(servers, tmp_path, game):
    """An environment's episodes over two servers: the trajectories of one server, and every later turn of an
    episode sent to the server that drew its first."""
    from auto_research.data.types import Example
    from auto_research.envs import EnvironmentFactory
    from auto_research.envs.rollout import EpisodeRunner

    tokenizer = build_tokenizer()
    trained = build_model(tokenizer, seed=1)
    settings = SamplingSettings(max_new_tokens=4, temperature=1.3)
    factory = EnvironmentFactory.load("sums_game:make_env", {"answer": "7"})
    examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((3, 4), (1, 1), (5, 2), (2, 2))]
    one = _client(servers(1)[0], trained, tmp_path / "one")
    fleet = _fleet(servers(2), trained, tmp_path / "fleet")
    homes = []
    remember = fleet._remember

    def record(histories, completions, drawn_by):
        homes.append({tuple(history): home for history, home in zip(histories, drawn_by)})
        remember(histories, completions, drawn_by)

    fleet._remember = record
    runs = {}
    for name, sampler in (("one", one), ("fleet", fleet)):
        runner = EpisodeRunner(sampler.generate_ids, tokenizer, factory, {}, settings, 3, 16,
                               (tokenizer.eos_token_id,), tokenizer.pad_token_id)
        runs[name] = runner.trajectories(examples, 3, [11, 12, 13, 14])
    one.close()
    fleet.close()
    for ours, theirs in zip(runs["fleet"], runs["one"]):
        for key in ("prompt_ids", "ids", "loss_mask", "turns", "reward"):
            assert getattr(ours, key) == getattr(theirs, key), key
    assert len(homes) >= 2 and len(set(homes[0].values())) == 2  # both servers drew first turns
    for first_turns in homes[0:1]:  # a group's first turns (equal prompts) on one server
        assert all(len({home for history, home in first_turns.items() if history == prompt}) == 1
                   for prompt in first_turns)
    for earlier, later in zip(homes, homes[1:]):
        for history, home in later.items():
            assert {home_before for before, home_before in earlier.items() if history[:len(before)] == before} == {home}


def _bounded(got, expected, rows) -> None:
    """Two processes against one: gradients summed in another order, which Adam lifts to up to lr in the odd
    element; a fault moves most elements by ~lr a step, so RMS <= the largest lr stepped with / 10
    (conftest.rms_difference)."""
    difference, bound = rms_difference(got, expected), max(row["learning_rate"] for row in rows) / 10
    print(f"two processes: weights' RMS difference from one {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(got, expected):.2e}")
    assert difference <= bound, (difference, bound)


def _trainer_run(address, tmp_path, name, **extra):
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    config = GenerationConfig(dataset="arithmetic-generate", steps=3, prompts_per_step=8, eval_every=0,
                              evaluation_examples=4, offline=True, progress=False, output_dir=tmp_path / name,
                              sampler="builtin", rollout_mode="server", rollout_server=address, **extra)
    lines = []
    trainer = Trainer.build(config, log=lines.append)
    try:
        rows = [trainer.step(step) for step in range(1, 4)]
        weights = {name: tensor.detach().clone() for name, tensor in trainer.components.policy.named_parameters()}
        lines.append(f"rollouts: {type(trainer.side).__name__}")
    finally:
        trainer.close()
    return rows, weights, lines


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_run_over_two_servers_ends_with_the_weights_of_one_and_survives_a_server_that_fails(servers, tmp_path,
                                                                                             staleness):
    """3 steps of RLOO over one server, over two, and over two of which the second fails from its second draw on
    (HTTP 500 after the client's retries): the same rewards at every step and the same final weights (RMS ≤ lr / 10).
    At K = 1 the two servers draw across batches (``fleet_stream``), the one server a batch at a time.
    One torch thread: two servers drawing at once in this one process share its thread pool, which changes their
    kernels' summation order (log-probs 1e-7 apart, weights up to 2e-5 after Adam's 3 steps on AMD); servers in
    processes of their own each have theirs."""
    from auto_research.engine.rollout.builtin import BuiltinEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _runs_with_a_fault(servers, tmp_path, staleness, BuiltinEngine)
    finally:
        torch.set_num_threads(threads)


def _runs_with_a_fault(servers, tmp_path, staleness, BuiltinEngine):

    rows_one, weights_one, _ = _trainer_run(servers(1)[0], tmp_path, "one", max_staleness=staleness)
    rows_two, weights_two, lines = _trainer_run(",".join(servers(2)), tmp_path, "two", max_staleness=staleness)
    # at K = 1 the fleet draws across batches (fleet_stream.py): each server moves on to the next version alone
    assert lines[-1] == f"rollouts: {'StreamedInFlight' if staleness else 'Synchronous'}"
    addresses = servers(2)
    failing = servers.engines[-1]
    calls = []
    original = BuiltinEngine.generate

    def fails_from_the_second(engine, *args, **kwargs):
        if engine is failing:
            calls.append(None)
            if len(calls) >= 2:
                raise RuntimeError("the server's engine failed")
        return original(engine, *args, **kwargs)

    BuiltinEngine.generate = fails_from_the_second
    try:
        rows_fault, weights_fault, lines = _trainer_run(",".join(addresses), tmp_path, "fault",
                                                        max_staleness=staleness)
    finally:
        BuiltinEngine.generate = original
    # The weights: two servers drawing in this process share its threads (above), so sums run in another order,
    # which Adam lifts to up to lr in the odd element (an Intel Xeon ended a k_proj bias 1.25e-4 apart at lr 3e-4);
    # a fault (a group lost or drawn twice, stale weights) moves most elements by ~lr: RMS <= lr / 10
    # (conftest.rms_difference).
    bound = max(row["learning_rate"] for row in rows_one) / 10
    for name, rows, weights in (("two", rows_two, weights_two), ("fault", rows_fault, weights_fault)):
        assert [row["reward_mean"] for row in rows] == [row["reward_mean"] for row in rows_one]
        difference = rms_difference(weights, weights_one)
        print(f"{name} servers: weights' RMS difference from one {difference:.2e} (bound {bound:.1e}), "
              f"largest {largest_difference(weights, weights_one):.2e}")
        assert difference <= bound, (name, difference, bound)
    # On a slow machine a push 10 s on may find the server answering (only its engine fails) and take it back,
    # until its next draw fails again: every such line names the failing server.
    left = [line for line in lines if "left the pool" in line]
    assert left and all(line.startswith(f"rollout server {addresses[1]} left the pool (--rollout-server "
                                        f"{addresses[1]}: /generate failed (HTTP 500") for line in left), left


def test_every_server_gone_is_one_line_with_the_last_checkpoint_and_resume_ends_with_the_uninterrupted_weights(
        servers, tmp_path, capsys):
    """From the command line: a run over two servers (given as a file of addresses) against the same run over two
    others (given as a list) whose engines both fail from step 3's draws on: exit 2 and one line naming every server
    and the last good checkpoint; with the engines well again, --resume ends with the uninterrupted run's weights."""
    from safetensors.torch import load_file

    from auto_research.cli import main
    from auto_research.engine.rollout.builtin import BuiltinEngine

    def run(output, addresses, *extra):
        return main(["post-train", "--dataset", "arithmetic-generate", "--steps", "4", "--prompts-per-step", "4",
                     "--offline", "--no-progress", "--eval-every", "0", "--evaluation-examples", "4", "--threads", "1",
                     "--checkpoint-every", "1", "--sampler", "builtin", "--rollout-mode", "server",
                     "--rollout-server", addresses, "--output-dir", str(output), *extra])

    listed = tmp_path / "servers.txt"
    listed.write_text("# the fleet\n" + "\n".join(servers(2)) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the test above
    try:
        assert run(tmp_path / "whole", str(listed)) == 0
        addresses = ",".join(servers(2))
        failing, original = set(servers.engines[-2:]), BuiltinEngine.generate

        def fails_from_step_3(engine, *args, **kwargs):
            if engine in failing and list((tmp_path / "faulty").glob("*/checkpoints/step-000002")):
                raise RuntimeError("the engine failed")
            return original(engine, *args, **kwargs)

        capsys.readouterr()
        BuiltinEngine.generate = fails_from_step_3
        try:
            assert run(tmp_path / "faulty", addresses) == 2
        finally:
            BuiltinEngine.generate = original
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("auto-research: error: --rollout-server: every rollout server of this run has left "
                               "the pool ("), line
        assert all(f"{address}: --rollout-server {address}: /generate failed" in line
                   for address in addresses.split(","))
        folder = next((tmp_path / "faulty").iterdir())
        assert line.endswith(f"the last good checkpoint is {folder / 'checkpoints'}/step-000002 (restart the server, "
                             "then continue with the same command and --resume)"), line
        assert run(tmp_path / "faulty", addresses, "--resume") == 0
    finally:
        torch.set_num_threads(threads)
    whole = next((tmp_path / "whole").iterdir())
    final = load_file(str(folder / "checkpoints" / "step-000004" / "model.safetensors"))
    expected = load_file(str(whole / "checkpoints" / "step-000004" / "model.safetensors"))
    bound = max(json.loads(line)["learning_rate"] for line in (whole / "metrics.jsonl").read_text().splitlines()) / 10
    difference = rms_difference(final, expected)  # as in the test above: two servers drawing in this process
    print(f"resumed: weights' RMS difference {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(final, expected):.2e}")
    assert difference <= bound, (difference, bound)


def test_the_forms_of_rollout_server_and_their_refusals(tmp_path, capsys):
    from auto_research.errors import UserError
    from auto_research.http import split_addresses

    listed = tmp_path / "servers.txt"
    listed.write_text("10.0.0.1:8000  # the first\n\n10.0.0.2:8000, 10.0.0.3:8001\n")
    assert split_addresses(str(listed)) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8001"]
    assert split_addresses("a:1, b:2") == ["a:1", "b:2"] and split_addresses("a:1") == ["a:1"]
    for value, message in (
            ("a:1,a:1", "--rollout-server: a:1 given twice (one lease per server and run)"),
            ("a:1,b", "--rollout-server 'b': expected HOST:PORT, e.g. 127.0.0.1:8000"),
            ("localhost", "--rollout-server 'localhost': expected HOST:PORT, e.g. 127.0.0.1:8000"),
            (str(tmp_path / "none.txt"), f"--rollout-server {str(tmp_path / 'none.txt')!r}: expected HOST:PORT, a list "
                                         "HOST:PORT,HOST:PORT or a file of addresses, one a line (no such file)")):
        with pytest.raises(UserError) as caught:
            split_addresses(value)
        assert str(caught.value) == message
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    with pytest.raises(UserError, match="no address in it"):
        split_addresses(str(tmp_path / "empty.txt"))
    from auto_research.cli import main

    assert main(["post-train", "--dataset", "arithmetic-generate", "--steps", "2", "--sampler", "builtin",
                 "--rollout-mode", "server", "--rollout-server", "127.0.0.1:8000,127.0.0.1:8000"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "auto-research: error: --rollout-server: 127.0.0.1:8000 given twice (one lease per server and run)"]


def test_a_server_that_stops_answering_is_left_by_its_heartbeat_and_its_unit_drawn_elsewhere(servers, tmp_path,
                                                                                              monkeypatch):
    """The second server's engine hangs mid-draw and its heartbeat goes unanswered: the draw does not wait for its
    request's timeout; the unit goes to the first server. (The heartbeat's count is shown against a stopped server,
    with beats of 0.2 s.) At the run's end the server that left, alive after all, is given its lease back (it was
    held for 593 s by a finished run once, under load, and the next run refused)."""
    import threading
    import time

    from auto_research.engine.rollout import client as clients
    from auto_research.engine.rollout.builtin import BuiltinEngine

    monkeypatch.setattr(clients, "HEARTBEAT_SECONDS", 0.2)
    trained = build_model(build_tokenizer(), seed=1)
    beating = _client(servers(1)[0], trained, tmp_path / "beating")
    assert beating.answering
    stop(servers.running[-1])
    deadline = time.monotonic() + 30
    while beating.answering and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not beating.answering and beating.unanswered >= clients.SILENT_BEATS
    beating.abandon()

    one = _client(servers(1)[0], trained, tmp_path / "one")
    expected = _draws(one)[0]
    one.close()
    addresses = servers(2)
    hanging, released, original = servers.engines[-1], threading.Event(), BuiltinEngine.generate
    waited_out = []

    def hangs(engine, *args, **kwargs):
        if engine is hanging:
            fleet.members[addresses[1]].hung = True  # what its heartbeat would find (here only the engine hangs)
            if not released.wait(600):
                waited_out.append(None)
        return original(engine, *args, **kwargs)

    def draws_in_flight():
        return [thread for thread in threading.enumerate() if thread.name.startswith("draw-")]

    lines = []
    fleet = _fleet(addresses, trained, tmp_path / "fleet", lines)
    monkeypatch.setattr(BuiltinEngine, "generate", hangs)
    monkeypatch.setattr(clients.ServerSampler, "answering", property(lambda client: not getattr(client, "hung", False)))
    try:
        assert _draws(fleet)[0] == expected
        assert not released.is_set() and not waited_out  # drawn while the hung request still hung
    finally:
        released.set()
        for thread in draws_in_flight():  # the abandoned request ends before the test does (and its server)
            thread.join(60)
    assert not draws_in_flight()
    assert lines == [f"rollout server {addresses[1]} left the pool (it stopped answering (no heartbeat)); 1 of 2 "
                     "serve on"]
    assert lease_held(addresses[1])  # left, not told: a server that was only slow still holds the run's lease
    fleet.close()
    assert not lease_held(addresses[1]) and not lease_held(addresses[0])  # given back at the run's end, both


def _rollout_serve(model_dir):
    """``rollout-serve --engine builtin`` of ``model_dir`` in a process of its own: (the process, its address)."""
    import threading

    env = {key: value for key, value in os.environ.items() if key != "AUTO_RESEARCH_API_KEY"}
    process = subprocess.Popen([sys.executable, "-m", "auto_research", "rollout-serve", "--engine", "builtin",
                                "--model", str(model_dir), "--port", "0", "--offline", "--threads", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    for line in process.stderr:
        if line.startswith("serving "):
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()  # keep draining
            return process, line.split("http://")[1].split()[0]
    raise AssertionError(f"rollout-serve did not start (exit {process.wait()})")


def test_two_torchrun_processes_over_two_servers_end_with_the_weights_of_one_process_over_one(tiny_model_dir,
                                                                                             sums_jsonl, workdir):
    """torchrun --nproc-per-node 2 over two servers (in processes of their own): each rank's fleet spreads its
    own groups, the pushes go to both servers one after the other; the same rewards and weights (RMS ≤ lr / 10) as one
    process over one server."""
    from tests.conftest import run_cli
    from tests.test_distributed import _args, _final, _rows, _torchrun

    servers = [_rollout_serve(tiny_model_dir) for _ in range(2)]
    try:
        served = ("--sampler", "builtin", "--rollout-mode", "server", "--rollout-server")
        one = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "one", *served, servers[0][1]), cwd=workdir)
        assert one.returncode == 0, one.stderr[-3000:]
        two = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "two", *served,
                              ",".join(address for _, address in servers)), cwd=workdir)
        assert two.returncode == 0, two.stderr[-3000:]
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=60)
    assert "sampling with 2 builtin rollout servers" in two.stderr
    expected, got = _final(workdir / "one"), _final(workdir / "two")
    _bounded(got, expected, _rows(workdir / "one"))
    for a, b in zip(_rows(workdir / "one"), _rows(workdir / "two"), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"]


def test_in_flight_updates_under_torchrun_over_one_server_end_where_one_process_ends(tiny_model_dir, sums_jsonl,
                                                                                     workdir):
    """--in-flight-updates under torchrun (partial_serve.py): the server holds one continuous batch for the run,
    every rank sends each round and takes its slice of the groups it finished. Two processes train on what one
    process trains on: the same rows, and the same weights (RMS ≤ lr / 10)."""
    from tests.conftest import run_cli
    from tests.test_distributed import _args, _final, _rows, _torchrun

    server, address = _rollout_serve(tiny_model_dir)
    try:
        served = ("--sampler", "builtin", "--rollout-mode", "server", "--rollout-server", address,
                  "--max-staleness", "2", "--in-flight-updates", "--steps", "5", "--checkpoint-every", "2")
        one = run_cli(*_args(tiny_model_dir, sums_jsonl, workdir / "one", *served), cwd=workdir)
        assert one.returncode == 0, one.stderr[-3000:]
        two = _torchrun(_args(tiny_model_dir, sums_jsonl, workdir / "two", *served), cwd=workdir)
        assert two.returncode == 0, two.stderr[-3000:]
        # Every process SIGKILLed after the checkpoint of step 2 (which holds the server's state as round 3 left
        # it), then --resume: rank 0 restores the state into the server, and the run ends as the uninterrupted one.
        killed = workdir / "killed"
        _kill_torchrun_after(_args(tiny_model_dir, sums_jsonl, killed, *served), workdir,
                             killed / "rloo-sums-seed42" / "checkpoints" / "step-000002")
        resumed = _torchrun(_args(tiny_model_dir, sums_jsonl, killed, *served, "--resume"), cwd=workdir)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
    uninterrupted, again = _final(workdir / "two"), _final(killed)
    assert all(torch.equal(uninterrupted[name], again[name]) for name in uninterrupted)
    expected, got = _final(workdir / "one"), _final(workdir / "two")
    _bounded(got, expected, _rows(workdir / "one"))
    rows_one, rows_two = _rows(workdir / "one"), _rows(workdir / "two")
    assert max(row.get("versions_per_sequence_max", 0) for row in rows_one) == 2  # completions spanning a push
    for a, b in zip(rows_one, rows_two, strict=True):
        for name in ("reward_mean", "completion_length", "staleness_mean", "staleness_max", "completions"):
            assert a.get(name) == b.get(name), (name, a.get(name), b.get(name))


def _kill_torchrun_after(args: list[str], workdir, checkpoint) -> None:
    """torchrun --nproc-per-node 2 ARGS, every process of it SIGKILLed once ``checkpoint`` exists."""
    import signal
    import time
    from pathlib import Path

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *args]
    agent = subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 240
    while time.time() < deadline and not checkpoint.is_dir() and agent.poll() is None:
        time.sleep(0.02)
    assert checkpoint.is_dir(), "the run never saved the checkpoint"
    workers = [int(pid) for task in Path(f"/proc/{agent.pid}/task").iterdir()
               for pid in (task / "children").read_text().split()]
    for session in (agent.pid, *workers):  # torchrun starts each worker in a session of its own
        os.killpg(session, signal.SIGKILL)
    agent.wait()


def test_a_fleet_that_loses_a_server_then_all_resumes_to_the_weights_of_one_server_bit_for_bit(servers, tmp_path,
                                                                                                capsys):
    """From the command line at --max-staleness 1 and --generation-batch-size 8 (units of 2 prompts): a run over one
    server against a run over two, the second of which is killed at its first draw after step 1's checkpoint (its
    unit drawn again by the first), and the first fails from step 3's draws on (exit 2, the last good checkpoint
    step 2). With a new server on the killed one's port (its initial weights), --resume ends with the one-server run's
    weights to the bit: the units are the one server's requests, so neither the kill, nor the redraw, nor the resume
    changes a row."""
    import threading

    from safetensors.torch import load_file

    from auto_research.cli import main
    from auto_research.engine.rollout.builtin import BuiltinEngine

    def run(output, addresses, *extra):
        return main(["post-train", "--dataset", "arithmetic-generate", "--steps", "4", "--prompts-per-step", "4",
                     "--offline", "--no-progress", "--eval-every", "0", "--evaluation-examples", "4", "--threads", "1",
                     "--checkpoint-every", "1", "--max-staleness", "1", "--generation-batch-size", "8",
                     "--sampler", "builtin", "--rollout-mode", "server", "--rollout-server", addresses,
                     "--output-dir", str(output), *extra])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_a_run_over_two_servers_...
    try:
        assert run(tmp_path / "whole", servers(1)[0]) == 0
        addresses = servers(2)
        (first, killed), original = servers.engines[-2:], BuiltinEngine.generate
        killed_server, faulty, kills = servers.running[-1], tmp_path / "faulty", []

        def checkpoint(step):
            return list(faulty.glob(f"*/checkpoints/step-{step:06d}"))

        def faults(engine, *args, **kwargs):
            if engine is killed and checkpoint(1):
                if not kills:  # the server goes away for good, this request unanswered
                    kills.append(threading.Thread(target=stop, args=(killed_server,), daemon=True))
                    kills[0].start()
                raise RuntimeError("killed")
            if engine is first and checkpoint(2):
                raise RuntimeError("the engine failed")
            return original(engine, *args, **kwargs)

        BuiltinEngine.generate = faults
        try:
            assert run(faulty, ",".join(addresses)) == 2
        finally:
            BuiltinEngine.generate = original
        kills[0].join(10)
        servers.running.remove(killed_server)
        err = capsys.readouterr().err
        assert f"rollout server {addresses[1]} left the pool" in err
        assert "the last good checkpoint is" in err.strip().splitlines()[-1]
        restarted, _ = start_builtin_server(int(addresses[1].rsplit(":", 1)[1]))  # its initial weights, a new life
        servers.running.append(restarted)
        assert run(faulty, ",".join(addresses), "--resume") == 0
    finally:
        torch.set_num_threads(threads)
    whole, folder = next((tmp_path / "whole").iterdir()), next(faulty.iterdir())
    final = load_file(str(folder / "checkpoints" / "step-000004" / "model.safetensors"))
    expected = load_file(str(whole / "checkpoints" / "step-000004" / "model.safetensors"))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected), max(
        (final[name] - expected[name]).abs().max().item() for name in expected)
