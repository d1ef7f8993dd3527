"""Weights to a rollout server over a torch.distributed group of two (gloo; ``--rollout-sync collective``,
engine/rollout/pushes.py): the same tensors as HTTP and shared memory, a bad tensor refused with the server's
weights unchanged, a run that trains as over HTTP, and the path's refusals in one line."""

from __future__ import annotations

import warnings

import pytest
import torch

from auto_research.engine.rollout import SamplingSettings, prompt_seed
from auto_research.engine.tiny import build_model, build_tokenizer
from tests.test_builtin_server import PROMPTS, start_builtin_server, stop


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    from auto_research.engine.rollout.transfer import SHARED_FOLDER

    started, engine = start_builtin_server(shared_folder=SHARED_FOLDER)  # offers a shared buffer, as rollout-serve
    yield engine, f"127.0.0.1:{started.server_address[1]}"
    stop(started)


def _client(model, address, run, sync):
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler

    return ServerSampler(model, build_tokenizer(), SamplingSettings(max_new_tokens=6, temperature=1.1), address,
                         "embedded", World(), run, engine="builtin", chunk_prompts=2, sync=sync)


@pytest.mark.parametrize("sync, path", [("collective", "a torch.distributed group (gloo)"),
                                        ("shared-memory", "shared memory"), ("http", "HTTP"),
                                        ("auto", "shared memory")])
def test_each_path_gives_the_server_the_same_tensors_and_draws(server, tmp_path, sync, path):
    engine, address = server
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", sync)
    assert client.transfer == path
    if client.transfer == "shared memory":  # the tied lm_head is not written: the server loads the embedding's slot
        assert client.link.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    for step in (1, 2):
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.mul_(1.01)
        client.load_weights(trained)
        assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
        seeds = [prompt_seed(4, step, index) for index in range(len(PROMPTS))]
        assert len(client.sample(PROMPTS, 2, seeds).completions) == 8  # drawn from this run's version
    client.close()


def test_a_bad_tensor_over_the_group_is_refused_and_the_server_keeps_its_weights(server, tmp_path):
    from auto_research.errors import RolloutEngineError

    engine, address = server
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", "collective")
    before = {name: tensor.clone() for name, tensor in engine.parameters.items()}
    with torch.no_grad():
        trained.model.norm.weight[0] = float("nan")
    with pytest.raises(RolloutEngineError) as caught:
        client.load_weights(trained)
    assert str(caught.value) == (f"--rollout-server {address} refused /weights/collective/push: tensor "
                                 "'model.norm.weight' has NaN or infinite values")
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in before.items())
    with torch.no_grad():
        trained.model.norm.weight[0] = 1.0
    client.load_weights(trained)  # the group still works
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    # the engine now serves the set the last push landed in; a bad push lands in the other and changes nothing
    served = {name: tensor.clone() for name, tensor in engine.parameters.items()}
    with torch.no_grad():
        trained.model.norm.weight[1] = float("inf")
    with pytest.raises(RolloutEngineError):
        client.load_weights(trained)
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in served.items())
    client.close()


def test_the_builtin_engine_serves_the_received_tensors_from_two_alternating_sets(server, tmp_path):
    """No copy into the engine: each push lands in the set the engine does not serve from, and the engine then
    serves from it; the tied lm_head is sent once and stays the embedding's own tensor."""
    engine, address = server
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", "collective")  # push 1: set 0
    assert client.link.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in client.link.where  # no room for it in the buckets: it is never sent
    where = []
    for _ in range(3):  # pushes 2, 3, 4: sets 1, 0, 1
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.mul_(1.01)
        client.load_weights(trained)
        assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
        where.append(engine.parameters["model.layers.0.mlp.up_proj.weight"].data_ptr())
    assert where[0] != where[1] and where[0] == where[2]
    assert engine.parameters["lm_head.weight"] is engine.parameters["model.embed_tokens.weight"]
    client.close()


def test_a_server_that_takes_no_ties_is_sent_every_weight(server, tmp_path, monkeypatch):
    """An older server answers its join without "tied": the trainer then sends the tied weight under both names."""
    from auto_research.engine.rollout import pushes

    monkeypatch.setattr(pushes, "check_ties", lambda tied, spec: {})
    engine, address = server
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", "collective")
    assert client.link.tied == {} and "lm_head.weight" in client.link.where
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.mul_(1.01)
    client.load_weights(trained)
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    client.close()


def test_tied_weights_are_one_parameter_under_two_names_never_a_lora_base():
    from auto_research.engine.rollout.remote import tied_weights

    tokenizer = build_tokenizer()
    assert tied_weights(build_model(tokenizer, seed=1)) == {"lm_head.weight": "model.embed_tokens.weight"}
    untied = build_model(tokenizer, seed=1)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert tied_weights(untied) == {}
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # PEFT warns that the adapted lm_head is tied: that is the case tested
        warnings.simplefilter("ignore")
        adapted = get_peft_model(build_model(tokenizer, seed=1), LoraConfig(r=2, target_modules=["lm_head"]))
    assert tied_weights(adapted) == {}  # lm_head's merged weight is not the embedding


def test_a_join_refuses_ties_the_served_weights_cannot_have():
    from auto_research.engine.rollout.guard import Refused
    from auto_research.engine.rollout.guard import check_ties

    spec = {"a": ([4, 2], "float32"), "b": ([4, 2], "float32"), "c": ([2, 4], "float32"), "d": ([4, 2], "bfloat16"),
            "e": ([4, 2], "float32")}
    assert check_ties({"b": "a", "e": "a"}, spec) == {"b": "a", "e": "a"}
    for tied, message in [
            ({"x": "a"}, "\"tied\" names a weight this server does not serve ('x' → 'a')"),
            ({"b": 3}, "\"tied\" names a weight this server does not serve ('b' → '3')"),
            ({"c": "a"}, "'c' cannot repeat 'a' (another shape or dtype, a later weight, or itself a repeat)"),
            ({"d": "a"}, "'d' cannot repeat 'a' (another shape or dtype, a later weight, or itself a repeat)"),
            ({"a": "b"}, "'a' cannot repeat 'b' (another shape or dtype, a later weight, or itself a repeat)"),
            ({"b": "a", "e": "b"}, "'e' cannot repeat 'b' (another shape or dtype, a later weight, or itself a "
                                   "repeat)"),
            (["b"], "\"tied\" must map names to the earlier names they repeat")]:
        with pytest.raises(Refused) as caught:
            check_ties(tied, spec)
        assert (caught.value.status, caught.value.message) == (400, message)


def test_adopting_a_tensor_tied_here_but_not_in_the_engine_copies_it():
    from auto_research.engine.rollout.builtin import BuiltinEngine

    own = {"embed": torch.nn.Parameter(torch.zeros(2, 2)), "head": torch.nn.Parameter(torch.zeros(2, 2))}
    fake = BuiltinEngine.__new__(BuiltinEngine)  # an engine of these two weights alone, one adapter base kept
    fake.parameters, fake.bases = own, {"head": 1}
    pushed = torch.arange(4.0).view(2, 2)
    fake.adopt_named(iter([("embed", pushed), ("head", pushed)]))
    assert own["embed"].data_ptr() == pushed.data_ptr()  # taken as it is
    assert own["head"].data_ptr() != pushed.data_ptr() and torch.equal(own["head"], pushed)  # its own memory
    assert fake.bases == {}


def test_a_run_over_the_group_trains_as_over_http(server, tmp_path):
    """3 RLOO steps with --rollout-sync collective and with http against the same server: the same rewards and the
    same final weights (the server held the same tensors at every draw)."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    _, address = server
    runs = {}
    for sync in ("collective", "http"):
        config = GenerationConfig(dataset="arithmetic-generate", steps=3, prompts_per_step=4, eval_every=0,
                                  evaluation_examples=4, offline=True, progress=False, output_dir=tmp_path / sync,
                                  sampler="builtin", rollout_mode="server", rollout_server=address, rollout_sync=sync)
        lines = []
        trainer = Trainer.build(config, log=lines.append)
        try:
            rows = [trainer.step(step) for step in (1, 2, 3)]
            weights = {name: tensor.detach().clone() for name, tensor in trainer.components.policy.named_parameters()}
        finally:
            trainer.close()
        runs[sync] = rows, weights, lines
    assert any("through a torch.distributed group (gloo)" in line for line in runs["collective"][2])
    assert [row["reward_mean"] for row in runs["collective"][0]] == [row["reward_mean"] for row in runs["http"][0]]
    assert all(torch.equal(runs["collective"][1][name], tensor) for name, tensor in runs["http"][1].items())


def test_sync_refusals_are_one_line(capsys, monkeypatch, tmp_path):
    from auto_research.cli import main

    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)

    def error(*extra) -> str:
        assert main(["post-train", "--dataset", "arithmetic-generate", "--steps", "2", "--offline", "--no-progress",
                     "--output-dir", str(tmp_path), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    assert error("--rollout-sync", "nccl").startswith("--rollout-sync 'nccl'")
    assert error("--rollout-sync", "http") == ("--rollout-sync http is for a rollout server (--rollout-mode server or "
                                               "process)")
    started, _ = start_builtin_server()  # no shared buffer
    try:
        address = f"127.0.0.1:{started.server_address[1]}"
        assert error("--sampler", "builtin", "--rollout-mode", "server", "--rollout-server", address,
                     "--rollout-sync", "shared-memory") == (
            f"--rollout-sync shared-memory: --rollout-server {address} offers no shared buffer this process can map "
            "(another host or user, or a server started without one)")
    finally:
        stop(started)


def test_the_backend_is_chosen_by_device_nccl_between_gpus_gloo_otherwise(monkeypatch):
    """One code path: NCCL where both sides' weights are on CUDA and both torches have it, else gloo (this CPU
    torch has no NCCL, so the CUDA case is this torch told it has)."""
    import torch.distributed as dist

    from auto_research.engine.rollout.pushes import backends, choose_backend

    assert backends("cpu") == ["gloo"]
    assert backends("cuda") == (["nccl", "gloo"] if dist.is_nccl_available() else ["gloo"])
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backends("cuda:1") == ["nccl", "gloo"] and backends("cpu") == ["gloo"]
    assert choose_backend(["nccl", "gloo"], ["nccl", "gloo"]) == "nccl"  # two GPUs
    assert choose_backend(["nccl", "gloo"], ["gloo"]) == "gloo"  # a server on the CPU
    assert choose_backend(["gloo"], ["nccl", "gloo"]) == "gloo"  # a trainer on the CPU
    assert choose_backend(["gloo"], True) == "gloo"  # an older server's "collective": true
    assert choose_backend(["gloo"], []) is None and choose_backend(["gloo"], None) is None


def test_a_backend_the_server_cannot_take_is_refused_in_one_line(server, tmp_path, monkeypatch):
    import json

    from auto_research.engine.rollout import server as server_module
    from auto_research.errors import RolloutEngineError, UserError

    engine, address = server
    client = _client(build_model(build_tokenizer(), seed=1), address, tmp_path / "run", "collective")
    with pytest.raises(RolloutEngineError) as caught:  # a trainer on a GPU asking for NCCL: the engine is on the CPU
        client._call("/weights/collective", json.dumps({"store": "127.0.0.1:1", "group": "g",
                                                        "backend": "nccl"}).encode())
    assert str(caught.value) == (f"--rollout-server {address} refused /weights/collective: this server cannot join "
                                 "a 'nccl' group: its engine on cpu takes gloo")
    client.close()
    monkeypatch.setattr(server_module, "backends", lambda device: ["nccl"])  # /health: a server on a GPU
    with pytest.raises(UserError) as caught:
        _client(build_model(build_tokenizer(), seed=1), address, tmp_path / "run2", "collective")
    assert str(caught.value) == (f"--rollout-server {address} cannot join a torch.distributed group with this "
                                 "trainer (the server takes nccl; this trainer, its weights on cpu, gloo)")


def test_a_push_goes_in_buckets_of_one_dtype_up_to_64_mib_a_larger_tensor_alone():
    from auto_research.engine.rollout.pushes import BUCKET_BYTES, layout

    assert BUCKET_BYTES == 64 * 2**20
    mib = 2**20 // 4  # float32 values in a MiB
    spec = {"a": ((mib, 10), "float32"), "b": ((mib, 50), "float32"), "c": ((mib, 10), "float32"),  # 10+50, then 10
            "d": ((mib * 100,), "float32"),  # 100 MiB: alone
            "e": ((3,), "float32"), "f": ((4,), "bfloat16"), "g": ((5,), "bfloat16")}  # another dtype: a new bucket
    assert layout(spec) == [
        ("float32", [("a", 0, 10 * mib, (mib, 10)), ("b", 10 * mib, 50 * mib, (mib, 50))], 60 * mib),
        ("float32", [("c", 0, 10 * mib, (mib, 10))], 10 * mib),
        ("float32", [("d", 0, 100 * mib, (mib * 100,))], 100 * mib),
        ("float32", [("e", 0, 3, (3,))], 3),
        ("bfloat16", [("f", 0, 4, (4,)), ("g", 4, 5, (5,))], 9)]


def test_a_tensor_of_another_shape_than_the_servers_is_refused_before_it_is_sent(server, tmp_path):
    from auto_research.errors import RolloutEngineError

    _, address = server
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", "collective")
    client.link.begin()
    with pytest.raises(RolloutEngineError) as caught:
        client.link.send("model.embed_tokens.weight", torch.zeros(3, 3))
    assert str(caught.value).startswith("the push sends 'model.embed_tokens.weight' as [3, 3] torch.float32 where "
                                        "the server expects [")
    client.close()  # its lease back; the server's half-received push ends at its own timeout


STRANGER = """
import datetime, json, socket, sys, time

import torch.distributed as dist

port, found = int(sys.argv[1]), {}
try:  # torch's own store client, as a TCPStore served it to anyone
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=2))
    store.set("mine", b"1")
    found["read back"] = store.get("mine").decode()
    found["keys"] = store.num_keys()
except Exception as error:
    found["store client"] = type(error).__name__
for name, answer in (("wrong answer", b"\\0" * 64), ("no answer", b"")):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
        started, received = time.monotonic(), b""
        raw.sendall(answer)
        try:
            while chunk := raw.recv(4096):
                received += chunk
            found[name] = {"closed after": time.monotonic() - started, "received": len(received)}
        except OSError as error:
            found[name] = {"still open": type(error).__name__}
print(json.dumps(found))
"""


def _listening() -> set:
    """This process's listening TCP sockets, as (address, port)."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # each 32-bit word little-endian
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def test_the_rendezvous_listens_on_the_loopback_and_serves_no_process_but_the_lease_holders_server(
        server, tmp_path, monkeypatch):
    """With a server on 127.0.0.1, the store and gloo's listeners (the trainer's and the server's) listen there
    alone (a TCPStore listened on every interface). A process that is not the trainer cannot read or write the
    store's keys, nor join (torch's own store client fails), and its connections are closed, whether it answers
    the challenge wrongly or not at all; an answer under another lease's key is refused too. The group then pushes
    as before."""
    import json
    import socket
    import subprocess
    import sys

    engine, address = server
    before = _listening()
    trained = build_model(build_tokenizer(), seed=1)
    client = _client(trained, address, tmp_path / "run", "collective")
    opened = _listening() - before
    assert len(opened) >= 3, opened  # the store, and a gloo listener on each side
    assert {host for host, _ in opened} == {"127.0.0.1"}, opened
    port = client.link.store.port
    assert ("127.0.0.1", port) in opened
    from auto_research.engine.rollout import rendezvous

    monkeypatch.setattr(rendezvous, "AUTH_SECONDS", 1.0)  # (the default 5 s: the test need not wait as long)
    done = subprocess.run([sys.executable, "-c", STRANGER, str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout)
    assert "read back" not in found and "keys" not in found and "store client" in found, found
    for name in ("wrong answer", "no answer"):
        assert "closed after" in found[name] and found[name]["closed after"] < 10, found
        assert found[name]["received"] == len(rendezvous.MAGIC) + 32, found  # the challenge, nothing else
    with pytest.raises(ConnectionError):
        rendezvous.RemoteStore("127.0.0.1", port, rendezvous.link_key("another lease", "a group"), 5.0)
    assert client.link.store.refused >= 4
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.mul_(1.01)
    client.load_weights(trained)  # the group still works
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in trained.named_parameters())
    client.close()
    with pytest.raises(ConnectionRefusedError):  # the store goes with the run
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
