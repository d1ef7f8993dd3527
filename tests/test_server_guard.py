"""The rollout server's guard without vLLM: the lease (one trainer per server), the checks of /generate and of a
weight push, and the HTTP server in front of a fake engine (API key, a slow client, an engine failure, a lapsed
lease). The same refusals against the real engine, with its draws unchanged, are in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.guard import Leases, Refused, WeightPush, check_claim, check_generate
from auto_research.engine.rollout.serve import is_loopback
from auto_research.engine.rollout.server import Limits, Served, make_server

HOLDER = {"host": "node-a", "pid": 111, "run": "/runs/one"}
SECRET, OTHER_SECRET = "5" * 64, "6" * 64
SECRET_NEEDED = ("a lease claim carries the run's secret: 32..256 ASCII characters (the trainer keeps it in its run "
                 "folder)")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def refusal(call, *args) -> Refused:
    with pytest.raises(Refused) as caught:
        call(*args)
    return caught.value


def test_one_lease_at_a_time_taken_over_only_with_the_runs_secret_and_freed_when_its_holder_stops_renewing():
    clock = Clock()
    leases = Leases(60.0, clock, reveal=True)  # behind an API key: refusals name the holder in full
    token = leases.claim(HOLDER, SECRET)
    other = refusal(leases.claim, {"host": "node-b", "pid": 222, "run": "/runs/two"}, OTHER_SECRET)
    assert other.status == 409
    assert other.message == ("this server serves another trainer (host node-a, PID 111, run folder /runs/one); stop "
                             "that run (kill 111 on node-a), or wait: its lease lapses 60 s after it stops renewing "
                             "it, or start another server")
    clock.now += 50
    leases.check(token)  # a push or a heartbeat renews it: 50 s later it still has 60 s to go
    clock.now += 59
    assert refusal(leases.claim, {"host": "node-b", "pid": 222, "run": "/runs/two"}, OTHER_SECRET).message.endswith(
        "its lease lapses 1 s after it stops renewing it, or start another server")
    # The holder's own host, run folder and even PID, without the run's secret: the client's word, refused.
    for claimed in (HOLDER, {**HOLDER, "pid": 333}):
        assert refusal(leases.claim, claimed, OTHER_SECRET).status == 409
    leases.check(token)  # still the holder's
    # --resume (the run's secret, read from its folder) takes it over at once; the old token is dead.
    resumed = leases.claim({**HOLDER, "pid": 333}, SECRET)
    assert resumed != token and leases.status() == {"held": True, "holder": {**HOLDER, "pid": 333}}
    assert refusal(leases.check, token).status == 409
    # The holder dies: 60 s after its last renewal anyone may take the server.
    clock.now += 60
    assert leases.status() == {"held": False}
    taken = leases.claim({"host": "node-b", "pid": 222, "run": "/runs/two"}, OTHER_SECRET)
    assert refusal(leases.check, resumed).message == (
        "this request does not carry the server's lease (it is held by host node-b, PID 222, run folder /runs/two); "
        "weights are taken only from the trainer holding it")
    assert refusal(leases.check, "é" * 32).status == 409  # any Latin-1 text a header holds: refused, not a 500
    leases.release(taken)
    assert leases.status() == {"held": False}


def test_without_an_api_key_the_lease_names_its_holders_host_alone():
    """Anyone may ask a server without a key: its PID and run folder are the holder's business (the server's log
    names them)."""
    clock = Clock()
    leases = Leases(60.0, clock)
    token = leases.claim(HOLDER, SECRET)
    assert leases.status() == {"held": True, "holder": {"host": "node-a"}}
    assert refusal(leases.claim, {**HOLDER, "pid": 9}, OTHER_SECRET).message == (
        "this server serves another trainer (host node-a); stop that run (the server's log names its PID and run "
        "folder), or wait: its lease lapses 60 s after it stops renewing it, or start another server")
    assert refusal(leases.check, None).message == (
        "this request does not carry the server's lease (it is held by host node-a); weights are taken only from the "
        "trainer holding it")
    leases.release(token)


@pytest.mark.parametrize("claim, message", [
    ([], 'a lease claim is {"holder": {"host", "pid", "run"}, "secret"}'),
    ({"holder": "me", "secret": SECRET}, 'a lease claim is {"holder": {"host", "pid", "run"}, "secret"}'),
    ({"holder": {"host": "node-b"}, "secret": SECRET},
     "a lease claim needs the holder's host, pid and run folder; 'pid' is missing"),
    ({"holder": {**HOLDER, "host": True}, "secret": SECRET}, "'host' must be text, got true"),
    ({"holder": {**HOLDER, "pid": "111"}, "secret": SECRET}, "'pid' must be an integer, got \"111\""),
    ({"holder": {**HOLDER, "pid": False}, "secret": SECRET}, "'pid' must be an integer, got false"),
    ({"holder": {**HOLDER, "run": ["/runs"]}, "secret": SECRET}, "'run' must be text, got [\"/runs\"]"),
    ({"holder": {**HOLDER, "run": ""}, "secret": SECRET}, "'run' must be 1..4096 characters, got 0"),
    ({"holder": HOLDER}, SECRET_NEEDED),
    ({"holder": HOLDER, "secret": "short"}, SECRET_NEEDED),
    ({"holder": HOLDER, "secret": "é" * 64}, SECRET_NEEDED),
    ({"holder": HOLDER, "secret": 12345}, SECRET_NEEDED),
])
def test_a_malformed_lease_claim_is_refused_naming_its_fault(claim, message):
    refused = refusal(check_claim, claim)
    assert (refused.status, refused.message) == (400, message)


def test_a_well_formed_claim_is_read_as_given():
    assert check_claim({"holder": {**HOLDER, "extra": 1}, "secret": SECRET}) == (HOLDER, SECRET)


GOOD = {"prompt_ids": [[1, 2, 3], [4]], "group_size": 4, "seeds": [7, 8],
        "settings": {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 0}}


@pytest.mark.parametrize("change, message", [
    ({"group_size": None}, "missing field 'group_size' (a request has prompt_ids, group_size, seeds, settings)"),
    ({"extra": 1}, "unknown field 'extra' (a request has prompt_ids, group_size, seeds, settings)"),
    ({"prompt_ids": []}, "prompt_ids must be a list of 1..4096 prompts (lists of token ids)"),
    ({"prompt_ids": [[1], []]}, "prompt 1 is empty or not a list of token ids"),
    ({"prompt_ids": [[1, 50]]}, "prompt 0 has token id 50, outside the vocabulary 0..49"),
    ({"prompt_ids": [[-1]]}, "prompt 0 has token id -1, outside the vocabulary 0..49"),
    ({"prompt_ids": [[1.5]]}, "prompt 0 has token id 1.5, outside the vocabulary 0..49"),
    ({"group_size": 0}, "group_size must be in 1..256, got 0"),
    ({"group_size": 100000}, "group_size must be in 1..256, got 100000"),
    ({"seeds": [1]}, "seeds must be a list of one integer per prompt (2)"),
    ({"settings": {"max_new_tokens": 10**7}}, "max_new_tokens 10000000 with a prompt of 3 tokens exceeds the "
                                                "server's max_model_len 32"),
    ({"settings": {"max_new_tokens": 30}}, "max_new_tokens 30 with a prompt of 3 tokens exceeds the server's "
                                             "max_model_len 32"),
    ({"settings": {"max_new_tokens": 0}}, "max_new_tokens must be at least 1, got 0"),
    ({"settings": {"max_new_tokens": 4, "temperature": -1}}, "temperature must be in [0, 100], got -1"),
    ({"settings": {"max_new_tokens": 4, "temperature": float("nan")}}, "temperature must be a finite number, got nan"),
    ({"settings": {"max_new_tokens": 4, "top_p": 0}}, "top_p must be in (0, 1], got 0"),
    ({"settings": {"max_new_tokens": 4, "top_p": 1.5}}, "top_p must be in (0, 1], got 1.5"),
    ({"settings": {"max_new_tokens": 4, "top_k": -1}}, "top_k must be in 0..50, got -1"),
    ({"settings": {"max_new_tokens": 4, "min_p": 0.1}}, "unknown sampling setting 'min_p' (settings are "
                                                          "max_new_tokens, temperature, top_p, top_k)"),
])
def test_a_malformed_generate_request_is_refused_naming_its_first_fault(change, message):
    request = {key: value for key, value in {**GOOD, **change}.items() if value is not None}
    refused = refusal(check_generate, request, 50, 32)
    assert (refused.status, refused.message) == (400, message)


def test_a_well_formed_generate_request_is_read_as_given():
    prompts, group_size, seeds, settings = check_generate(GOOD, 50, 32)
    assert (prompts, group_size, seeds) == ([[1, 2, 3], [4]], 4, [7, 8])
    assert settings == SamplingSettings(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0)
    assert check_generate({**GOOD, "settings": {"max_new_tokens": 29}}, 50, 32)[3].max_new_tokens == 29


SPEC = {"a.weight": ([2, 3], "float32"), "b.weight": ([4], "float32")}


def part(**tensors) -> bytes:
    return save({name: tensor.contiguous() for name, tensor in tensors.items()})


@pytest.mark.parametrize("tensors, message", [
    ({"c.weight": torch.zeros(4)}, "unknown tensor 'c.weight': the served model has no weight of that name"),
    ({"a.weight": torch.zeros(3, 2)}, "tensor 'a.weight' has shape [3, 2], the served model's is [2, 3]"),
    ({"a.weight": torch.zeros(2, 3, dtype=torch.float16)}, "tensor 'a.weight' is float16, the server takes float32"),
    ({"b.weight": torch.tensor([0.0, float("nan"), 1.0, 2.0])}, "tensor 'b.weight' has NaN or infinite values"),
    ({"b.weight": torch.tensor([0.0, float("inf"), 1.0, 2.0])}, "tensor 'b.weight' has NaN or infinite values"),
    ({"b.weight": torch.tensor([0.0, 1.0, 2.0, -float("inf")])}, "tensor 'b.weight' has NaN or infinite values"),
    ({"b.weight": torch.tensor([float("nan")] * 4)}, "tensor 'b.weight' has NaN or infinite values"),
])
def test_a_weight_part_is_checked_tensor_by_tensor(tensors, message):
    push = WeightPush(SPEC, "t")
    refused = refusal(push.add, 0, part(**tensors))
    assert (refused.status, refused.message) == (400, message)
    assert push.tensors == {}


def test_a_push_is_complete_only_with_every_tensor_once_and_its_parts_in_order():
    push = WeightPush(SPEC, "t")
    assert refusal(push.add, 1, part(**{"a.weight": torch.ones(2, 3)})).message == (
        "weight part 1 arrived, part 0 was expected (a push starts at part 0 and sends its parts in order)")
    assert refusal(push.add, 0, b"not safetensors").message.startswith("weight part 0 is not a safetensors file (")
    push.add(0, part(**{"a.weight": torch.ones(2, 3)}))
    assert refusal(push.complete).message == "the push ended without 1 of the model's tensors: 'b.weight'"
    assert refusal(push.add, 1, part(**{"a.weight": torch.ones(2, 3)})).message == (
        "tensor 'a.weight' was sent twice in one push")
    push.add(1, part(**{"b.weight": torch.arange(4.0)}))
    assert set(push.complete()) == {"a.weight", "b.weight"} and push.complete()["b.weight"].tolist() == [0, 1, 2, 3]
    assert refusal(WeightPush(SPEC, "t").add, 0, b"\0" * (push.limit + 2**20 + 1)).status == 413


# --- the HTTP server in front of a fake engine --------------------------------------------------------------


HELD = 1000


class FakeEngine:
    max_model_len = 32

    def __init__(self):
        self.loaded, self.fail, self.calls = [], False, []
        self.hold, self.entered = threading.Event(), threading.Event()
        self.hold.set()

    def generate(self, prompt_ids, group_size, seeds, settings):
        self.calls.append(list(seeds))
        if seeds[0] == HELD:  # a test's request that waits in the engine until the test lets it go
            self.entered.set()
            self.hold.wait(120)
        if self.fail:
            raise RuntimeError("out of KV cache blocks\nsecond line")
        return [[seed % 50] * settings.max_new_tokens for seed in seeds for _ in range(group_size)], \
            [[-0.5] * settings.max_new_tokens for _ in seeds for _ in range(group_size)]

    def load_named(self, weights):
        self.loaded.append({name: tensor.clone() for name, tensor in weights})  # vLLM copies into its own, too


def start(engine, served, limits, clock=None) -> tuple:
    server = make_server(engine, served, "127.0.0.1", 0, limits, clock=clock or Clock())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def stop(server) -> None:
    server.shutdown()
    server.intake.close()
    server.server_close()


@pytest.fixture
def fake(tmp_path):
    engine = FakeEngine()
    engine.clock = Clock()  # the leases' clock, moved by hand: no test waits for a lease to lapse
    server, address = start(engine, Served("fake", "f" * 16, SPEC, 50, "float32"),
                            Limits("open-sesame-key-16", 60.0, 5.0, 8, tmp_path, max_request_tokens=1000), engine.clock)
    yield engine, f"http://{address}"
    stop(server)


@pytest.fixture
def keyless(tmp_path):
    """A server without an API key, whose engine the tests hold; requests of other clients than the lease holder
    drawn in slices of 10 tokens (one prompt of group 2, 1 token and 4 new ones), 50 tokens of them at most."""
    engine = FakeEngine()
    server, address = start(engine, Served("fake", "f" * 16, SPEC, 50, "float32"),
                            Limits(None, 60.0, 5.0, 8, tmp_path, max_request_tokens=1000, max_server_tokens=50,
                                   slice_tokens=10))
    yield engine, f"http://{address}", server.serving.turns
    engine.hold.set()
    stop(server)


def read_all(connection) -> str:
    """Everything the server sends until it closes the connection (waiting far longer than the server's 5 s read
    timeout: a busy machine may wake its timer late, and this must not race it)."""
    connection.settimeout(120)
    chunks = []
    while chunk := connection.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def call(url, path, body=None, headers=None, key="open-sesame-key-16") -> tuple[int, dict]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = urllib.request.Request(url + path, data=data, headers={**auth, **(headers or {})})
    try:
        with urllib.request.urlopen(sent, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        assert text.count("\n") == 0, text  # one JSON line
        return error.code, json.loads(text)


def test_the_api_key_is_required_for_every_path(fake):
    _, url = fake
    for path, body in (("/health", None), ("/generate", GOOD), ("/lease", {"holder": HOLDER, "secret": SECRET})):
        assert call(url, path, body, key=None)[0] == 401
        status, answer = call(url, path, body, key="wrong")
        assert status == 401 and answer == {"error": "missing or wrong API key (send the header Authorization: Bearer "
                                                     "KEY; the trainer reads KEY from AUTO_RESEARCH_API_KEY)"}
    assert call(url, "/health")[0] == 200


def test_pushes_need_the_lease_a_dead_holders_lease_lapses_and_weights_go_in_only_whole(fake):
    engine, url = fake
    status, lease = call(url, "/lease", {"holder": HOLDER, "secret": SECRET})
    assert status == 200 and lease["seconds"] == 60.0
    status, answer = call(url, "/lease", {"holder": {**HOLDER, "run": "/runs/two"}, "secret": OTHER_SECRET})
    assert status == 409 and "host node-a, PID 111, run folder /runs/one" in answer["error"]
    whole = [part(**{"a.weight": torch.ones(2, 3)}), part(**{"b.weight": torch.ones(4)})]
    assert call(url, "/weights?part=0&last=0", whole[0])[0] == 409  # no lease header: refused
    held = {"X-Lease": lease["lease"]}
    assert call(url, "/weights?part=0&last=0", whole[0], held) == (200, {"received": 1})
    assert call(url, "/weights?part=1&last=1", part(**{"b.weight": torch.ones(3)}), held)[0] == 400
    assert engine.loaded == [] and call(url, "/health")[1]["weights_version"] == 0  # dropped whole, nothing in
    assert call(url, "/weights?part=0&last=0", whole[0], held)[0] == 200
    status, answer = call(url, "/weights?part=1&last=1", whole[1], held)
    assert status == 200 and answer["weights_version"] == 1 and set(engine.loaded[0]) == {"a.weight", "b.weight"}
    engine.clock.now += 61  # the holder stops renewing (SIGKILL): its lease lapses, another trainer may take it
    assert call(url, "/health")[1]["lease"] == {"held": False}
    status, other = call(url, "/lease", {"holder": {**HOLDER, "run": "/runs/two"}, "secret": OTHER_SECRET})
    assert status == 200
    assert call(url, "/weights?part=0&last=1", whole[0], held)[0] == 409  # the old holder's token is dead
    assert call(url, "/lease/release", {}, {"X-Lease": other["lease"]}) == (200, {})


def test_a_slow_client_blocks_nobody_and_gets_408(fake):
    _, url = fake
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer open-sesame-key-16\r\n"
                     b"Content-Length: 100\r\n\r\n")
        assert call(url, "/generate", GOOD)[0] == 200
        slow.setblocking(False)
        with pytest.raises(BlockingIOError):  # answered while the slow client still owes its body and waits
            slow.recv(1)
        slow.setblocking(True)
        answer = read_all(slow)
    assert answer.startswith("HTTP/1.0 408") and '{"error": "the body did not arrive within 5 s"}' in answer


def raw(url: str, head: bytes) -> str:
    """What the server answers to bytes sent as they are (headers no client library would send)."""
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as connection:
        connection.sendall(head)
        return read_all(connection)


def test_missing_or_oversized_bodies_and_an_engine_failure_are_one_line_answers(fake):
    engine, url = fake
    auth = b"Authorization: Bearer open-sesame-key-16\r\n"
    assert raw(url, b"POST /generate HTTP/1.1\r\n" + auth + b"\r\n").startswith("HTTP/1.0 411")
    answer = raw(url, b"POST /generate HTTP/1.1\r\n" + auth + b"Content-Length: 999999999999\r\n\r\n")
    assert answer.startswith("HTTP/1.0 413") and "over this path's limit of 67108864 bytes" in answer
    assert call(url, "/generate", b"{not json") == (400, {"error": "the body is not JSON (Expecting property name "
                                                                   "enclosed in double quotes: line 1 column 2 (char 1))"})
    assert call(url, "/nowhere", GOOD) == (404, {"error": "no such path /nowhere"})
    engine.fail = True
    assert call(url, "/generate", GOOD) == (500, {"error": "the engine failed: RuntimeError: out of KV cache blocks"})
    engine.fail = False
    assert call(url, "/generate", GOOD)[0] == 200  # still up


def test_malformed_lengths_deep_nesting_and_mistyped_claims_are_400_lines_and_change_nothing(fake):
    engine, url = fake
    auth = b"POST /lease HTTP/1.1\r\nAuthorization: Bearer open-sesame-key-16\r\n"
    for length, shown in ((b"\xc2\xb2", "Â²"), (b"\xb2", "²"), (b"+5", "+5"), (b"0x10", "0x10"), (b"1_0", "1_0")):
        answer = raw(url, auth + b"Content-Length: " + length + b"\r\n\r\n{}")
        assert answer.startswith("HTTP/1.0 400") and json.loads(answer.split("\r\n\r\n", 1)[1]) == {
            "error": f"Content-Length must be a decimal number of bytes, got {shown!r}"}, answer
    deep = b"[" * 30_000 + b"]" * 30_000  # under /lease's 64 KiB
    for path in ("/generate", "/lease", "/weights/shared"):
        assert call(url, path, deep) == (400, {"error": "the body nests too deep (JSON arrays and objects within each "
                                                        "other, far beyond what any request of this server holds)"})
    assert call(url, "/lease", {"holder": {**HOLDER, "host": True}, "secret": SECRET}) == (
        400, {"error": "'host' must be text, got true"})
    assert engine.calls == [] and engine.loaded == []  # the engine was never asked
    assert call(url, "/health")[1]["lease"] == {"held": False} and call(url, "/health")[1]["weights_version"] == 0


def test_a_request_over_the_token_bound_is_413_before_the_engine_sees_it(fake):
    engine, url = fake
    big = {**GOOD, "prompt_ids": [[1] * 20] * 5, "seeds": [1] * 5, "settings": {"max_new_tokens": 10},
           "group_size": 8}  # 5 prompts × 8 × (20 + 10) = 1200 tokens
    assert call(url, "/generate", big) == (413, {"error": (
        "this request asks for 1200 tokens (over its prompts, group size × (prompt + max_new_tokens)), over the "
        "server's bound of 1000 a request: send it in parts, or raise rollout-serve's --max-request-tokens")})
    assert engine.calls == [] and call(url, "/health")[1]["max_request_tokens"] == 1000
    fits = {**big, "prompt_ids": [[1] * 20] * 4, "seeds": [1] * 4, "group_size": 8}  # 960 tokens
    assert call(url, "/generate", fits)[0] == 200 and engine.calls == [[1] * 4]


def another_clients_request(url: str, engine: FakeEngine) -> tuple:
    """A client without the lease asks for 3 prompts (3 slices of 10 tokens), the first held in the engine: its
    thread and where its answer will be."""
    engine.hold.clear()
    answers = []
    request = {"prompt_ids": [[1], [2], [3]], "group_size": 2, "seeds": [HELD, 5, 6], "settings": {"max_new_tokens": 4}}
    thread = threading.Thread(target=lambda: answers.append(call(url, "/generate", request, key=None)))
    thread.start()
    assert engine.entered.wait(120)
    return thread, answers


def wait_for_holder(turns) -> None:
    """Until the lease holder's request waits for the engine (bounded: every loop here is)."""
    for _ in range(12000):
        if turns.waiting_first:
            return
        threading.Event().wait(0.01)
    pytest.fail("the lease holder's request never reached the engine's queue")


def test_the_lease_holders_requests_go_before_another_clients_slices_and_are_never_refused_for_them(keyless):
    engine, url, turns = keyless
    status, lease = call(url, "/lease", {"holder": HOLDER, "secret": SECRET}, key=None)
    assert status == 200
    assert call(url, "/health", key=None)[1]["lease"] == {"held": True, "holder": {"host": "node-a"}}  # no PID, folder
    other, answers = another_clients_request(url, engine)
    # 30 tokens in hand: another 30 from a client without the lease go over the bound of 50...
    request = {"prompt_ids": [[1], [2], [3]], "group_size": 2, "seeds": [1, 2, 3], "settings": {"max_new_tokens": 4}}
    assert call(url, "/generate", request, key=None) == (429, {"error": (
        "the server has 30 tokens of other clients' requests in hand; 30 more would go over its bound of 50 "
        "(rollout-serve --max-server-tokens): try again when they are answered")})
    # ...the holder's 48 go in, and before the other client's next slice.
    mine = {"prompt_ids": [[4] * 20], "group_size": 2, "seeds": [7], "settings": {"max_new_tokens": 4}}
    held = []
    holder = threading.Thread(target=lambda: held.append(call(url, "/generate", mine, {"X-Lease": lease["lease"]},
                                                              key=None)))
    holder.start()
    wait_for_holder(turns)
    engine.hold.set()
    holder.join(120)
    other.join(120)
    assert engine.calls == [[HELD], [7], [5], [6]]
    assert held[0] == (200, {"completions": [[7] * 4] * 2, "logprobs": [[-0.5] * 4] * 2, "weights_version": 0,
                             "instance": call(url, "/health", key=None)[1]["instance"]})
    status, answer = answers[0]  # the slices put together: what one draw of the whole request gives
    assert status == 200 and answer["completions"] == [[HELD % 50] * 4] * 2 + [[5] * 4] * 2 + [[6] * 4] * 2


def test_weights_pushed_between_another_clients_slices_void_its_answer(keyless):
    engine, url, turns = keyless
    lease = {"X-Lease": call(url, "/lease", {"holder": HOLDER, "secret": SECRET}, key=None)[1]["lease"]}
    other, answers = another_clients_request(url, engine)
    push = threading.Thread(target=lambda: call(url, "/weights?part=0&last=1", part(
        **{"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4)}), lease, key=None))
    push.start()
    wait_for_holder(turns)
    engine.hold.set()
    push.join(120)
    other.join(120)
    assert len(engine.loaded) == 1 and engine.calls == [[HELD]]  # the push went in after the first slice
    assert answers == [(409, {"error": "the lease holder pushed new weights while this request was drawn (in slices, "
                                       "between its requests): its samples would come from two versions; send it "
                                       "again"})]


def test_loopback_is_told_apart_from_wider_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")


# --- weights through shared memory: the trainer's client against the real HTTP server, on one host -------------


@pytest.fixture
def policy(tmp_path, monkeypatch):
    """The embedded model, a server for its architecture in front of a fake engine (shared buffers in a folder of
    the test's own), and a way to start a trainer's client against it."""
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.rollout.guard import weight_spec
    from auto_research.engine.rollout.server import fingerprint
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.tiny import build_model, build_tokenizer

    monkeypatch.setenv("AUTO_RESEARCH_API_KEY", "open-sesame-key-16")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    spec = weight_spec(pushed_weights(model, torch.float32))
    engine, folder, clock = FakeEngine(), tmp_path / "shm", Clock()
    folder.mkdir()
    server, address = start(engine, Served("embedded", fingerprint(model.config, tokenizer), spec,
                                           model.config.vocab_size, "float32"),
                            Limits("open-sesame-key-16", 60.0, 5.0, 8, folder, slice_tokens=10),
                            clock)

    def trainer(shared: bool = True, run: str = "run") -> ServerSampler:
        return ServerSampler(model, tokenizer, SamplingSettings(4), address, "embedded", World(), tmp_path / run,
                                 shared=shared)

    def weights() -> dict:
        return {name: tensor.clone() for name, tensor in pushed_weights(model, torch.float32)}

    def version() -> int:
        return call(f"http://{address}", "/health")[1]["weights_version"]

    yield {"engine": engine, "model": model, "url": f"http://{address}", "folder": folder, "server": server,
           "trainer": trainer, "weights": weights, "version": version, "spec": spec, "clock": clock}
    stop(server)


def same(got: dict, expected: dict) -> bool:
    return set(got) == set(expected) and all(torch.equal(got[name], expected[name]) for name in expected)


def test_a_trainer_on_the_servers_host_pushes_through_shared_memory_what_http_pushes(policy):
    engine, folder = policy["engine"], policy["folder"]
    fast = policy["trainer"]()
    assert fast.transfer == "shared memory" and len(list(folder.iterdir())) == 1
    assert len(engine.loaded) == 1 and same(engine.loaded[0], policy["weights"]())  # the push at the run's start
    with torch.no_grad():  # an optimizer step
        for parameter in policy["model"].parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    fast.load_weights(policy["model"])
    stepped = policy["weights"]()
    assert same(engine.loaded[1], stepped) and not same(engine.loaded[1], engine.loaded[0])
    assert policy["version"]() == 2 and fast.weight_sync_seconds > 0
    fast.close()
    assert list(folder.iterdir()) == []  # the lease released: its buffer is gone
    slow = policy["trainer"](shared=False)
    assert slow.transfer == "HTTP" and policy["version"]() == 3
    assert same(engine.loaded[2], stepped)  # HTTP hands the engine the very tensors shared memory did
    slow.close()


def test_a_bad_push_through_shared_memory_is_refused_and_the_engine_keeps_its_weights(policy):
    from auto_research.errors import RolloutEngineError

    engine, url, model = policy["engine"], policy["url"], policy["model"]
    trainer = policy["trainer"]()
    good = policy["weights"]()
    first = next(model.parameters())
    kept = first.detach().clone()
    with torch.no_grad():
        first.view(-1)[3] = float("inf")
    with pytest.raises(RolloutEngineError) as caught:
        trainer.load_weights(model)
    assert str(caught.value).startswith(f"--rollout-server {url.removeprefix('http://')} refused /weights/shared: tensor ")
    assert str(caught.value).endswith("has NaN or infinite values") and "\n" not in str(caught.value)
    assert len(engine.loaded) == 1 and same(engine.loaded[0], good) and policy["version"]() == 1
    names, lease = sorted(policy["spec"]), {"X-Lease": trainer.lease}
    nonce = trainer.link.nonce
    for body, headers, status, message in (
            ({"nonce": "0" * 64, "names": names}, lease, 400, "the nonce is not the one in this lease's shared buffer: "
             "the trainer does not see the server's file (another host?); push the weights over HTTP"),
            ({"nonce": nonce, "names": names[1:]}, lease, 400,
             f"the push ended without 1 of the model's tensors: {names[0]!r}"),
            ({"nonce": nonce, "names": names + ["model.extra.weight"]}, lease, 400,
             "unknown tensor 'model.extra.weight': the served model has no weight of that name"),
            ({"nonce": nonce, "names": names + names[:1]}, lease, 400,
             f"tensor {names[0]!r} was sent twice in one push"),
            ({"nonce": nonce}, lease, 400, 'a shared push is {"nonce": "...", "names": [every tensor written]}'),
            ({"nonce": nonce, "names": names}, {}, 409, "this request does not carry the server's lease (it is held by "
             f"host {socket.gethostname()}, PID {os.getpid()}, run folder {policy['folder'].parent / 'run'}); "
             "weights are taken only from the trainer holding it")):
        assert call(url, "/weights/shared", body, headers) == (status, {"error": message})
    assert len(engine.loaded) == 1 and policy["version"]() == 1  # nothing went in, the version did not move
    with torch.no_grad():
        first.copy_(kept)
    trainer.load_weights(model)  # the next good push goes in
    assert same(engine.loaded[1], good) and policy["version"]() == 2
    trainer.close()


def test_a_trainer_that_does_not_see_the_servers_buffer_pushes_over_http(policy, monkeypatch, tmp_path):
    """Another host: the offered path is not there, or a file of that name is another server's."""
    from auto_research.engine.rollout.transfer import SharedBuffer

    offer = SharedBuffer.offer
    monkeypatch.setattr(SharedBuffer, "offer", lambda self: {**offer(self), "path": str(tmp_path / "nowhere")})
    elsewhere = policy["trainer"]()
    assert elsewhere.transfer == "HTTP" and type(elsewhere.link).__name__ == "HttpLink" and policy["version"]() == 1
    assert same(policy["engine"].loaded[0], policy["weights"]())
    elsewhere.close()
    other = SharedBuffer(policy["spec"], "another server's", tmp_path)
    monkeypatch.setattr(SharedBuffer, "offer", lambda self: {**offer(self), "path": str(other.path)})
    namesake = policy["trainer"]()
    assert namesake.transfer == "HTTP" and policy["version"]() == 2
    namesake.close()
    other.close()
    monkeypatch.setattr(SharedBuffer, "offer", offer)

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # /dev/shm too small for the weights: no buffer is offered
    crowded = policy["trainer"]()
    assert crowded.transfer == "HTTP" and policy["version"]() == 3 and list(policy["folder"].iterdir()) == []
    crowded.close()


def test_a_buffer_goes_with_its_lease_and_its_server(policy):
    from auto_research.engine.rollout.transfer import PREFIX, sweep

    folder, url = policy["folder"], policy["url"]
    holder = policy["trainer"]()
    lapsed = Path(holder.link.path)
    holder._stop.set()  # the holder stops renewing (SIGKILLed): its lease lapses, and its buffer with it
    policy["clock"].now += 61
    assert call(url, "/lease/renew", {}, {"X-Lease": holder.lease})[0] == 409
    assert not lapsed.exists()
    first = policy["trainer"](run="again")
    resumed = policy["trainer"](run="again")  # --resume of the same run takes the lease, with a fresh buffer
    assert not Path(first.link.path).exists() and Path(resumed.link.path).exists()
    stop(policy["server"])
    assert list(folder.iterdir()) == []  # the server stopped: nothing left
    dead, live = folder / f"{PREFIX}4194305-0a1b", folder / f"{PREFIX}{os.getpid()}-0a1b"
    dead.write_bytes(b"left by a server SIGKILLed")
    live.write_bytes(b"a running server's")
    assert sweep(folder) == [dead] and live.exists()  # what the next server started on the host does


def test_a_trainers_requests_go_whole_and_are_split_only_to_fit_the_servers_bound(policy):
    """The trainer's requests carry its lease, so the server draws them whole (another client's would go in slices
    of 10 tokens here); split by the trainer to fit --max-request-tokens, they draw what one request draws."""
    engine = policy["engine"]
    trainer = policy["trainer"](shared=False)
    prompt_ids, seeds = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], [11, 12, 13, 14]
    whole = trainer.generate(prompt_ids, 2, seeds)  # 2 × (3 + 4) + 2 × (2 + 4) + 2 × (1 + 4) + 2 × (4 + 4) = 52
    assert engine.calls == [seeds]
    trainer.max_request_tokens = 26  # what /health said, were the server started so
    assert trainer.generate(prompt_ids, 2, seeds) == whole and engine.calls == [seeds, [11, 12], [13, 14]]
    trainer.close()


def test_the_runs_lease_secret_is_private_kept_and_made_anew_when_others_could_read_it(tmp_path):
    from auto_research.engine.rollout.client import run_secret

    secret = run_secret(tmp_path / "run")
    path = tmp_path / "run" / ".lease-secret"
    assert len(secret) == 64 and path.read_text() == secret and path.stat().st_mode & 0o777 == 0o600
    assert run_secret(tmp_path / "run") == secret  # what --resume presents
    path.chmod(0o644)
    anew = run_secret(tmp_path / "run")
    assert anew != secret and path.read_text() == anew and path.stat().st_mode & 0o777 == 0o600


def test_a_push_without_the_lease_is_refused_without_its_body_being_kept(fake, monkeypatch):
    """The lease is checked before a push's body is read into memory: a client without it has its body read and
    dropped a MiB at a time (so that it still gets the 409), never held."""
    from auto_research.engine.rollout import server as module

    engine, url = fake
    kept = []
    monkeypatch.setattr(module.Handler, "_body", lambda self, limit, head=None: kept.append(limit) or b"")
    body = b"x" * (8 * 2**20)
    answer = raw(url, b"POST /weights?part=0&last=1 HTTP/1.1\r\nAuthorization: Bearer open-sesame-key-16\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert answer.startswith("HTTP/1.0 409") and kept == [] and engine.loaded == []


def test_large_bodies_of_clients_without_the_lease_wait_for_a_slot_then_get_503(tmp_path):
    """One slot for bodies over a MiB: while a client without the lease sends one (slowly, within the read
    timeout), another's waits for the read timeout, then gets 503; memory stays bounded however many connect."""
    engine = FakeEngine()
    server, address = start(engine, Served("fake", "f" * 16, SPEC, 50, "float32"),
                            Limits(None, 60.0, 5.0, 8, tmp_path, large_bodies=1))
    head = b"POST /generate HTTP/1.1\r\nContent-Length: " + str(2 * 2**20).encode() + b"\r\n\r\n"
    done = threading.Event()

    def trickle(connection):  # a KiB every 0.2 s: never idle for the 5 s read timeout, never done
        while not done.wait(0.2):
            try:
                connection.sendall(b"1" * 1024)
            except OSError:
                return

    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as slow:
            slow.sendall(head)
            threading.Thread(target=trickle, args=(slow,), daemon=True).start()
            deadline = time.time() + 60  # until the slow one holds the slot
            while server.serving.large._value and time.time() < deadline:
                time.sleep(0.05)
            answer = raw(f"http://{address}", head)  # its body unsent: the slot is waited for before any is read
            done.set()
        assert answer.startswith("HTTP/1.0 503") and "requests of over 1048576 bytes" in answer
    finally:
        done.set()
        stop(server)
