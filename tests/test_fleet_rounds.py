"""--in-flight-updates over several rollout servers (``train/partial_flight.FleetRounds``): each server holds a
continuous batch of its own, the step's groups split in the servers' order and the run's queue dealt by need, so a
round's batch does not depend on which server answers first; a server that leaves stops the run, and --resume ends
with the uninterrupted run's rows and weights."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from auto_research.errors import RolloutEngineError
from auto_research.train.partial_flight import FleetRounds, _split
from tests.test_fleet import servers  # noqa: F401 - a fixture: builtin servers in this process


def _fleet_rounds(members: list, addresses=("a:1", "b:2")):
    clients = [SimpleNamespace() for _ in members]
    for member, client in zip(members, clients):
        member.sampler = client
    fleet = SimpleNamespace(members=dict(zip(addresses, clients)), left={})
    return FleetRounds(fleet, members), fleet


class _Member:
    """A server's rounds that answer ``lanes`` after ``delay`` seconds and remember what they were asked."""

    def __init__(self, lanes, delay=0.0, pending=0, fails=None):
        self.lanes, self.delay, self.pending, self.fails, self.asked = lanes, delay, pending, fails, []

    def run(self, number, version, per_step, pool_groups, oldest_allowed, supply, settle):
        self.asked.append((per_step, pool_groups, [key for key, _, _ in supply]))
        time.sleep(self.delay)
        if self.fails:
            raise self.fails
        return self.lanes, 1, self.pending


def test_the_step_s_groups_and_the_pool_split_in_the_servers_order():
    assert _split(7, 3) == [3, 2, 2] and _split(4, 2) == [2, 2] and _split(9, 2) == [5, 4]


def test_the_queue_is_dealt_by_need_then_to_the_server_furthest_below_its_target():
    """Server a holds 5 of its target 6, b none of 6: a takes 1, b 6; of the 3 left, the first goes to a (a tie at
    0 below: the first server), the next to b (a is 1 above now), the last to a (a tie again)."""
    rounds, _ = _fleet_rounds([_Member([]), _Member([])])
    rounds.pendings = [5, 0]
    supply = [(f"g{index}", [index], index) for index in range(10)]
    a, b = rounds._deal(supply, [6, 6])
    assert [key for key, _, _ in a] == ["g0", "g7", "g9"]
    assert [key for key, _, _ in b] == ["g1", "g2", "g3", "g4", "g5", "g6", "g8"]


def test_a_round_is_the_servers_lanes_in_their_order_whichever_answers_first():
    """The first server answers last: its lanes still come first. Each is asked for its share of P = 5 groups (3 and
    2) and of the pool (4 and 3); the queue lengths reported are capped at each server's target."""
    slow, quick = _Member(["a1", "a2", "a3"], delay=0.3, pending=100), _Member(["b1", "b2"], pending=4)
    rounds, _ = _fleet_rounds([slow, quick])
    supply = [((index, index), [index], index) for index in range(25)]
    lanes, requeued, pending = rounds.run(1, 0, 5, 7, -1, supply, False)
    assert lanes == ["a1", "a2", "a3", "b1", "b2"] and requeued == 2
    assert [asked[:2] for asked in (slow.asked[0], quick.asked[0])] == [(3, 4), (2, 3)]
    # targets: 3·3 + 1 = 10 and 3·2 + 1 = 7; a takes the first 10, b the next 7, the 8 left split 4 and 4
    assert len(slow.asked[0][2]) == 14 and len(quick.asked[0][2]) == 11
    assert pending == 10 + 4 and rounds.pendings == [100, 4]


def test_a_server_that_fails_or_left_the_pool_stops_the_round_naming_it():
    """A server's failure stops the round with its own line (the first server's of several); any other error (a
    bug) is raised as it is."""
    broken = [RolloutEngineError("--rollout-server a:1: /partial/round failed"),
              RolloutEngineError("--rollout-server b:2: /partial/round failed")]
    rounds, _ = _fleet_rounds([_Member(["a"], fails=broken[0], delay=0.2), _Member(["b"], fails=broken[1])])
    with pytest.raises(RolloutEngineError, match=r"^--rollout-server a:1: /partial/round failed$"):
        rounds.run(1, 0, 2, 2, -1, [], False)
    rounds, fleet = _fleet_rounds([_Member(["a"]), _Member(["b"], fails=ValueError("a bug"))])
    with pytest.raises(ValueError, match=r"^a bug$"):
        rounds.run(1, 0, 2, 2, -1, [], False)
    fleet.left["a:1"] = ("its push failed", 0.0)
    del fleet.members["a:1"]
    with pytest.raises(RolloutEngineError, match=r"^--in-flight-updates: rollout server a:1 left the pool \(its push "
                                                 r"failed\); the groups it was decoding live on it alone$"):
        rounds.run(2, 1, 2, 2, -1, [], False)


def _run_args(args: list[str]) -> int:
    from auto_research.cli import main

    return main(args)


def _run(output, addresses, *extra):
    return _run_args(["post-train", "--dataset", "arithmetic-generate", "--steps", "5", "--prompts-per-step", "3",
                 "--offline", "--no-progress", "--eval-every", "0", "--evaluation-examples", "4", "--threads", "1",
                 "--checkpoint-every", "2", "--max-staleness", "2", "--in-flight-updates", "--sampler", "builtin",
                 "--rollout-mode", "server", "--rollout-server", addresses, "--output-dir", str(output), *extra])


def _rows(output) -> list[dict]:
    folder = next(output.iterdir())
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _weights(output) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next(output.iterdir()) / "checkpoints" / "step-000005" / "model.safetensors"))


KEYS = ("reward_mean", "completion_length", "staleness_mean", "staleness_max", "completions")


def test_two_servers_decode_in_flight_repeat_exactly_and_resume_after_one_fails(servers, tmp_path, capsys,
                                                                                one_thread):
    """Three prompts a step over two builtin servers (2 groups and 1): twice the same rows; then the second server's
    engine fails after the checkpoint of step 2, the run stops in one line naming it and that checkpoint, and
    --resume (its engine well again) ends with the uninterrupted run's rows and weights to the bit."""
    from auto_research.engine.rollout.partial import Pool

    addresses = servers(2)
    assert _run(tmp_path / "a", ",".join(addresses)) == 0
    addresses = servers(2)
    assert _run(tmp_path / "b", ",".join(addresses)) == 0
    addresses = servers(2)
    failing, original, faulty = servers.engines[-1].model, Pool.tick, tmp_path / "faulty"
    lock = threading.Lock()

    def tick(pool):
        with lock:
            broken = pool.model is failing and list(faulty.glob("*/checkpoints/step-000002"))
        if broken:
            raise RuntimeError("the engine failed")
        return original(pool)

    capsys.readouterr()
    Pool.tick = tick
    try:
        assert _run(faulty, ",".join(addresses)) == 2
    finally:
        Pool.tick = original
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"auto-research: error: --rollout-server {addresses[1]} ") and "the engine failed" in line
    assert line.endswith(f"the last good checkpoint is {next(faulty.iterdir()) / 'checkpoints'}/step-000002 "
                         "(restart the server, then continue with the same command and --resume)"), line
    assert _run(faulty, ",".join(addresses), "--resume") == 0
    first, again, resumed = _rows(tmp_path / "a"), _rows(tmp_path / "b"), _rows(faulty)
    steps = [row for row in first if "staleness_max" in row]
    assert len(steps) == 5 and all(row["staleness_max"] <= 2 for row in steps)
    assert max(row.get("versions_per_sequence_max", 0) for row in steps) == 2  # completions spanning a push
    for rows in (again, resumed):
        mine = [row for row in rows if "staleness_max" in row]
        assert [[row.get(key) for key in KEYS] for row in mine[-len(steps):]] == [
            [row.get(key) for key in KEYS] for row in steps]
    expected = _weights(tmp_path / "a")
    for output in (tmp_path / "b", faulty):
        got = _weights(output)
        assert all(torch.equal(expected[name], got[name]) for name in expected), output


@pytest.fixture
def one_thread():
    """Two servers decoding in this one process: one torch thread, one summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_resume_over_other_servers_is_one_line(servers, tmp_path, capsys, one_thread):
    addresses = servers(3)
    assert _run(tmp_path / "run", ",".join(addresses[:2]), "--steps", "3") == 0
    capsys.readouterr()
    assert _run(tmp_path / "run", ",".join(addresses), "--steps", "4", "--resume") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("auto-research: error: --resume: the run in ") and line.endswith(
        f"was started with different settings: rollout_server (was '{addresses[0]},{addresses[1]}', now "
        f"'{','.join(addresses)}'); resume with its own (--rollout-server {addresses[0]},{addresses[1]}), or start a "
        "new run (--overwrite, or another --run-name)"), line


def test_two_torchrun_processes_over_two_servers_train_on_the_rows_of_one_process(servers, tmp_path, one_thread):
    """Every rank sends each round to each server (the same request: the first rank's runs it, the others get its
    answer) and trains its slice of the round's groups: two processes log what one process logs, step by step."""
    from tests.test_distributed import _torchrun

    def args(output):
        return ["post-train", "--dataset", "arithmetic-generate", "--steps", "4", "--prompts-per-step", "4",
                "--offline", "--no-progress", "--eval-every", "0", "--evaluation-examples", "4", "--threads", "1",
                "--max-staleness", "2", "--in-flight-updates", "--sampler", "builtin", "--rollout-mode", "server",
                "--rollout-server", ",".join(servers(2)), "--output-dir", str(output)]

    assert _run_args(args(tmp_path / "one")) == 0
    two = _torchrun(args(tmp_path / "two"), cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one, two = ([row for row in _rows(tmp_path / name) if "staleness_max" in row] for name in ("one", "two"))
    assert len(one) == 4 and max(row["versions_per_sequence_max"] for row in one) == 2
    assert [[row.get(key) for key in KEYS] for row in two] == [[row.get(key) for key in KEYS] for row in one]
