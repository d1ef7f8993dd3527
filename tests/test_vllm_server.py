"""--vllm-mode server, for real on the CPU: ``auto-research vllm-serve`` on 127.0.0.1 started by the test, one
training process and torchrun (DDP, FSDP2) sampling from it with the weights pushed after every step; and the
trainer's refusals (no server, another model, bad settings) in one line."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from safetensors.torch import load_file

from auto_research.engine.tiny import build_model, build_tokenizer
from conftest import run_cli

ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            max_position_embeddings=64)  # 32 per head: a size vLLM-CPU serves


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served-model")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, **ARCH).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(served_model):
    """``auto-research vllm-serve`` on a free port; its address once it says it is serving."""
    process = subprocess.Popen([sys.executable, "-m", "auto_research", "vllm-serve", "--model", str(served_model),
                                "--port", "0", "--vllm-memory", "0.02", "--offline"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    deadline, seen = time.time() + 240, []
    address = None
    while address is None and time.time() < deadline and process.poll() is None:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith("serving "):
            address = line.split("http://")[1].split()[0]
    if address is None:
        process.kill()
        pytest.fail("the server did not start:\n" + "".join(seen[-30:]))
    yield address
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


RUN = ["post-train", "--dataset", "DATA", "--model", "MODEL", "--prompts-per-step", "4", "--group-size", "4",
       "--max-new-tokens", "4", "--evaluation-examples", "4", "--learning-rate", "3e-3", "--offline", "--no-progress",
       "--seed", "3", "--sampler", "vllm", "--vllm-mode", "server", "--temperature", "1.0", "--device", "cpu",
       "--threads", "1", "--micro-batch-size", "4", "--eval-every", "0"]
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


def _torchrun(args, cwd):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "auto_research", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_one_and_two_processes_sample_from_the_server_with_fresh_weights_every_step(served_model, sums_jsonl,
                                                                                    tmp_path, server):
    """20 steps at a learning rate that moves the policy: every step's mismatch stays at the fp32 level of step 1
    (a server left with stale weights drifts at once), with 1 process, and with 2 under DDP and FSDP2; the
    two-process runs draw the same samples as one process (per-request seeds) and end with its weights. Each run
    finds the server holding the previous run's final weights: step 1's mismatch shows that the weights pushed
    at a run's start (a --resume's too) are the ones sampled from. (LoRA's merged push is the colocated one,
    tests/test_vllm.py.)"""
    one = run_cli(*_args(served_model, sums_jsonl, tmp_path / "one", server, *TWENTY), cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    rows = _rows(tmp_path / "one")
    assert len(rows) == 20 and rows[-1]["kl"] > 10 * max(abs(rows[0]["kl"]), 1e-6)  # the policy moved
    assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in rows), [r["rollout_logprob_diff_max"] for r in rows]
    assert all(row["weight_sync_seconds"] > 0 for row in rows)
    expected = _final(tmp_path / "one")
    for name, extra in (("ddp", ()), ("fsdp", ("--fsdp",))):
        two = _torchrun(_args(served_model, sums_jsonl, tmp_path / name, server, *TWENTY, *extra), cwd=tmp_path)
        assert two.returncode == 0, (name, two.stderr[-3000:])
        got_rows = _rows(tmp_path / name)
        assert len(got_rows) == 20
        assert all(row["rollout_logprob_diff_max"] < 1e-4 for row in got_rows), (name, [
            r["rollout_logprob_diff_max"] for r in got_rows])
        for a, b in zip(rows, got_rows):
            assert a["reward_mean"] == b["reward_mean"] and a["completion_length"] == b["completion_length"]
        got = _final(tmp_path / name)
        assert max(float((got[key] - expected[key]).abs().max()) for key in expected) <= 1e-5, name


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

    assert error("--vllm-mode", "server") == ("--vllm-mode server needs --vllm-server HOST:PORT (start a server with "
                                              "auto-research vllm-serve --model M --port 8000)")
    assert error("--vllm-mode", "server", "--vllm-server", "localhost") == (
        "--vllm-server 'localhost': expected HOST:PORT, e.g. 127.0.0.1:8000")
    assert error("--vllm-server", "127.0.0.1:8000") == "--vllm-server is for --vllm-mode server"
    # Nothing listens on a port just freed.
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = probe.server_address[1]
    probe.server_close()
    line = error("--vllm-mode", "server", "--vllm-server", f"127.0.0.1:{port}")
    assert line.startswith(f"--vllm-server 127.0.0.1:{port}: no vLLM server answers there (")
    assert line.endswith(f"start one with auto-research vllm-serve --model {served_model} --port {port}")
    fake = FakeServer()
    try:
        line = error("--vllm-mode", "server", "--vllm-server", fake.address)
    finally:
        fake.close()
    assert line == (f"--vllm-server {fake.address} serves 'someone-else/model', another model than --model "
                    f"{served_model} (a different architecture or tokenizer)")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("metrics.jsonl"))


def test_vllm_serve_refusals_are_one_line(tiny_model_dir, capsys):
    from auto_research.cli import main

    def error(*args) -> str:
        assert main(["vllm-serve", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    assert error("--port", "70000") == "--port must be in 0..65535, got 70000"
    assert error("--vllm-memory", "0") == "--vllm-memory must be in (0, 1], got 0.0"
    # tiny_model_dir has 16 per head: refused before any engine starts.
    line = error("--model", str(tiny_model_dir), "--offline", "--device", "cpu")
    assert "vLLM's CPU attention serves head sizes 32, 64" in line and "has 16 (32 over 2 heads)" in line


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
