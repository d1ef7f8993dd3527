"""The rollout server's guard without vLLM: the lease (one trainer per server), the checks of /generate and of a
weight push, and the HTTP server in front of a fake engine (API key, a slow client, an engine failure, a lapsed
lease). The same refusals against the real engine, with its draws unchanged, are in tests/test_vllm_server.py."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save

from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.guard import Leases, Refused, WeightPush, check_generate
from auto_research.engine.rollout.server import Limits, Served, is_loopback, make_server

HOLDER = {"host": "node-a", "pid": 111, "run": "/runs/one"}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def refusal(call, *args) -> Refused:
    with pytest.raises(Refused) as caught:
        call(*args)
    return caught.value


def test_one_lease_at_a_time_taken_back_by_the_same_run_and_freed_when_its_holder_stops_renewing():
    clock = Clock()
    leases = Leases(60.0, clock)
    token = leases.claim(HOLDER)
    other = refusal(leases.claim, {"host": "node-b", "pid": 222, "run": "/runs/two"})
    assert other.status == 409
    assert other.message == ("this server serves another trainer (host node-a, PID 111, run folder /runs/one); stop "
                             "that run (kill 111 on node-a), or wait: its lease lapses 60 s after it stops renewing "
                             "it, or start another server")
    clock.now += 50
    leases.check(token)  # a push or a heartbeat renews it: 50 s later it still has 60 s to go
    clock.now += 59
    assert refusal(leases.claim, {"host": "node-b", "pid": 222, "run": "/runs/two"}).message.endswith(
        "its lease lapses 1 s after it stops renewing it, or start another server")
    # --resume of the same run (same host and folder, a new process) takes it over at once; the old token is dead.
    resumed = leases.claim({**HOLDER, "pid": 333})
    assert resumed != token and leases.status() == {"held": True, "holder": {**HOLDER, "pid": 333}}
    assert refusal(leases.check, token).status == 409
    # The holder dies: 60 s after its last renewal anyone may take the server.
    clock.now += 60
    assert leases.status() == {"held": False}
    taken = leases.claim({"host": "node-b", "pid": 222, "run": "/runs/two"})
    assert refusal(leases.check, resumed).message == (
        "this request does not carry the server's lease (it is held by host node-b, PID 222, run folder /runs/two); "
        "weights are taken only from the trainer holding it")
    leases.release(taken)
    assert leases.status() == {"held": False}
    assert refusal(leases.claim, {"host": "node-b"}).message == (
        "a lease claim needs the holder's host, pid and run folder; 'pid' is missing")


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


class FakeEngine:
    max_model_len = 32

    def __init__(self):
        self.loaded, self.fail = [], False

    def generate(self, prompt_ids, group_size, seeds, settings):
        if self.fail:
            raise RuntimeError("out of KV cache blocks\nsecond line")
        return [[seed % 50] * settings.max_new_tokens for seed in seeds for _ in range(group_size)], \
            [[-0.5] * settings.max_new_tokens for _ in seeds for _ in range(group_size)]

    def load_named(self, weights):
        self.loaded.append(dict(weights))


@pytest.fixture
def fake():
    engine = FakeEngine()
    served = Served("fake", "f" * 16, SPEC, 50, "float32")
    server = make_server(engine, served, "127.0.0.1", 0, Limits("sesame", 0.6, 2.0, 8))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield engine, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def read_all(connection) -> str:
    """Everything the server sends until it closes the connection."""
    connection.settimeout(5)
    chunks = []
    while chunk := connection.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks).decode()


def call(url, path, body=None, headers=None, key="sesame") -> tuple[int, dict]:
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
    for path, body in (("/health", None), ("/generate", GOOD), ("/lease", {"holder": HOLDER})):
        assert call(url, path, body, key=None)[0] == 401
        status, answer = call(url, path, body, key="wrong")
        assert status == 401 and answer == {"error": "missing or wrong API key (send the header Authorization: Bearer "
                                                     "KEY; the trainer reads KEY from AUTO_RESEARCH_API_KEY)"}
    assert call(url, "/health")[0] == 200


def test_pushes_need_the_lease_a_dead_holders_lease_lapses_and_weights_go_in_only_whole(fake):
    engine, url = fake
    status, lease = call(url, "/lease", {"holder": HOLDER})
    assert status == 200 and lease["seconds"] == 0.6
    status, answer = call(url, "/lease", {"holder": {**HOLDER, "run": "/runs/two"}})
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
    time.sleep(0.8)  # the holder stops renewing (SIGKILL): its lease lapses, another trainer may take the server
    assert call(url, "/health")[1]["lease"] == {"held": False}
    status, other = call(url, "/lease", {"holder": {**HOLDER, "run": "/runs/two"}})
    assert status == 200
    assert call(url, "/weights?part=0&last=1", whole[0], held)[0] == 409  # the old holder's token is dead
    assert call(url, "/lease/release", {}, {"X-Lease": other["lease"]}) == (200, {})


def test_a_slow_client_blocks_nobody_and_gets_408(fake):
    _, url = fake
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\nContent-Length: 100\r\n\r\n")
        assert call(url, "/generate", GOOD)[0] == 200
        slow.setblocking(False)
        with pytest.raises(BlockingIOError):  # answered while the slow client still owes its body and waits
            slow.recv(1)
        slow.setblocking(True)
        answer = read_all(slow)
    assert answer.startswith("HTTP/1.0 408") and '{"error": "the body did not arrive within 2 s"}' in answer


def test_missing_or_oversized_bodies_and_an_engine_failure_are_one_line_answers(fake):
    engine, url = fake
    port = int(url.rsplit(":", 1)[1])

    def raw(head: bytes) -> str:
        with socket.create_connection(("127.0.0.1", port)) as connection:
            connection.sendall(head)
            return read_all(connection)

    auth = b"Authorization: Bearer sesame\r\n"
    assert raw(b"POST /generate HTTP/1.1\r\n" + auth + b"\r\n").startswith("HTTP/1.0 411")
    answer = raw(b"POST /generate HTTP/1.1\r\n" + auth + b"Content-Length: 999999999999\r\n\r\n")
    assert answer.startswith("HTTP/1.0 413") and "over this path's limit of 67108864 bytes" in answer
    assert call(url, "/generate", b"{not json") == (400, {"error": "the body is not JSON (Expecting property name "
                                                                   "enclosed in double quotes: line 1 column 2 (char 1))"})
    assert call(url, "/nowhere", GOOD) == (404, {"error": "no such path /nowhere"})
    engine.fail = True
    assert call(url, "/generate", GOOD) == (500, {"error": "the engine failed: RuntimeError: out of KV cache blocks"})
    engine.fail = False
    assert call(url, "/generate", GOOD)[0] == 200  # still up


def test_loopback_is_told_apart_from_wider_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
