"""The rollout server's control surface against real processes on 127.0.0.1 (``rollout-serve --engine builtin``):
a live trainer's lease cannot be taken, nor its weights replaced, by another process that names the trainer's
host, PID and run folder; a run SIGKILLed and resumed takes its own lease back with its run's secret and ends as
the undisturbed run did; an API key from a file or the environment works on both sides, and one that is not 16 to
256 printable ASCII characters, or a file others may read, is refused at the start in one line."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import kill_after_checkpoint

TIMES = ("step_seconds", "tokens_per_second", "weight_sync_seconds")
KEY = "k3y-for-these-tests~7f2c9a"  # printable ASCII, 16 to 256 characters: what every HTTP client sends as it is
REWARDS = """
import os, pathlib, time

CALLS = [0]


def checksum(prompts, completions, rows):
    # At its second call (the lease held, steps still to push), tell the test and wait for its word (bounded).
    CALLS[0] += 1
    folder = os.environ.get("PAUSE_DIR")
    if folder and CALLS[0] == 2:
        pathlib.Path(folder, "paused").touch()
        deadline = time.monotonic() + 300
        while not pathlib.Path(folder, "go").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the test never said go on")
            time.sleep(0.05)
    hold = os.environ.get("HOLD_AFTER")
    if hold and pathlib.Path(hold).is_dir():
        time.sleep(300)  # once that checkpoint is written, here until the test's SIGKILL: the run cannot end first
    return [float(sum(map(ord, c)) % 5) for c in completions]
"""
ATTACKER = """
import json, socket, sys, urllib.error, urllib.request

import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from auto_research.engine.rollout.remote import pushed_weights

address, run, model = sys.argv[1:4]


def call(path, body=None, headers=None, kind="application/json"):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = urllib.request.Request(f"http://{address}{path}", data=data,
                                  headers={"Content-Type": kind, **(headers or {})})
    try:
        with urllib.request.urlopen(sent, timeout=120) as answer:
            return [answer.status, json.loads(answer.read())]
    except urllib.error.HTTPError as error:
        return [error.code, json.loads(error.read())]


found = {"health": call("/health")[1]}
holder = {"host": socket.gethostname(), "pid": 4242, "run": run}  # everything the trainer's claim names
found["takeover"] = call("/lease", {"holder": holder, "secret": "0" * 64})
found["no secret"] = call("/lease", {"holder": holder})
zeros = save({name: torch.zeros_like(tensor).contiguous()
              for name, tensor in pushed_weights(AutoModelForCausalLM.from_pretrained(model), torch.float32)})
found["push, guessed lease"] = call("/weights?part=0&last=1", zeros, {"X-Lease": "0" * 32}, "application/octet-stream")
found["push, no lease"] = call("/weights?part=0&last=1", zeros, None, "application/octet-stream")
found["shared push"] = call("/weights/shared", {"nonce": "0" * 64, "names": []}, {"X-Lease": "0" * 32})
found["release"] = call("/lease/release", {}, {"X-Lease": "0" * 32})
found["health after"] = call("/health")[1]
print(json.dumps(found))
"""


class Server:
    """``rollout-serve --engine builtin`` on 127.0.0.1, a free port; its stderr kept (read as it comes, so the
    pipe never fills)."""

    def __init__(self, *extra: str, env: dict):
        command = [sys.executable, "-m", "auto_research", "rollout-serve", "--engine", "builtin", "--host",
                   "127.0.0.1", "--port", "0", "--offline", "--threads", "1", "--device", "cpu", *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=env)
        self.lines: list[str] = []
        ready: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        try:
            line = ready.get(timeout=300)
        except queue.Empty:
            line = None
        if line is None:
            self.stop()
            pytest.fail("the server did not start:\n" + "".join(self.lines[-20:]))
        self.address = line.split("http://")[1].split()[0]

    def _read(self, ready: queue.Queue) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            if line.startswith("serving "):
                ready.put(line)
        ready.put(None)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=60)


def _environment(workdir: Path, **extra) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "AUTO_RESEARCH_API_KEY"}
    path = os.pathsep.join(filter(None, [str(workdir), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def _args(model, data, output, address, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "4", "--prompts-per-step", "4",
            "--group-size", "4", "--max-new-tokens", "4", "--learning-rate", "1e-2", "--evaluation-examples", "4",
            "--eval-every", "0", "--temperature", "1.0", "--offline", "--device", "cpu", "--no-progress",
            "--threads", "1", "--reward", "pause_rewards:checksum", "--checkpoint-every", "2", "--sampler", "builtin",
            "--rollout-mode", "server", "--rollout-server", address, "--output-dir", str(output), *extra]


def _rows(output: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures."""
    rows = [json.loads(line) for line in (next(output.iterdir()) / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in row.items() if not key.startswith("time_") and key not in TIMES}
            for row in rows]


def _final(output: Path) -> dict:
    return load_file(str(sorted((next(output.iterdir()) / "checkpoints").iterdir())[-1] / "model.safetensors"))


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"the trainer never paused (exit {process.poll()})"


def test_another_process_cannot_take_a_live_trainers_lease_nor_push_weights_and_a_resume_takes_its_own(
        tiny_model_dir, sums_jsonl, tmp_path):
    """A trainer paused mid-run (in its reward function, its lease held, steps still to push) while another
    process names its host and run folder to take the lease, pushes all-zero weights with a guessed lease and
    without one, and tries to release it: every request a 4xx, the served weights untouched, and the trainer
    ends with exit 0 and the numbers of a run nobody disturbed (here a run SIGKILLed after step 2 and resumed,
    which takes over the lease its dead process left by its run folder's secret)."""
    (tmp_path / "pause_rewards.py").write_text(REWARDS)
    (tmp_path / "attacker.py").write_text(ATTACKER)
    server = Server("--model", str(tiny_model_dir), "--lease-seconds", "600", env=_environment(tmp_path))
    try:
        pause = tmp_path / "pause"
        pause.mkdir()
        trainer = subprocess.Popen([sys.executable, "-m", "auto_research",
                                    *_args(tiny_model_dir, sums_jsonl, tmp_path / "attacked", server.address)],
                                   cwd=tmp_path, env=_environment(tmp_path, PAUSE_DIR=str(pause)),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for(pause / "paused", trainer)
        run = next((tmp_path / "attacked").iterdir()).resolve()
        attack = subprocess.run([sys.executable, str(tmp_path / "attacker.py"), server.address, str(run),
                                 str(tiny_model_dir)], cwd=tmp_path, env=_environment(tmp_path), capture_output=True,
                                text=True, timeout=300)
        (pause / "go").touch()
        out, err = trainer.communicate(timeout=300)
        assert attack.returncode == 0, attack.stderr[-3000:]
        assert trainer.returncode == 0 and "Traceback" not in err, err[-3000:]
        _check_refused(json.loads(attack.stdout), trainer.pid, run)
        assert f"lease taken by host {socket.gethostname()}, PID {trainer.pid}, run folder {run}" in "".join(
            server.lines)  # the server's own log names the holder in full

        undisturbed = tmp_path / "undisturbed"
        args = _args(tiny_model_dir, sums_jsonl, undisturbed, server.address)
        env = _environment(tmp_path)
        second = undisturbed / "rloo-sums-seed42" / "checkpoints" / "step-000002"
        # held in its next reward call once step 2's checkpoint is written: under load a 4-step run once ended (and
        # gave its lease back) between the test's look at the folder and its SIGKILL
        kill_after_checkpoint(args, {**env, "HOLD_AFTER": str(second)}, second)
        assert json.loads(_health(server.address))["lease"]["held"]  # the dead process's lease, live for 600 s
        resumed = subprocess.run([sys.executable, "-m", "auto_research", *args, "--resume"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert _rows(undisturbed) == _rows(tmp_path / "attacked")
        expected, got = _final(tmp_path / "attacked"), _final(undisturbed)
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        assert not json.loads(_health(server.address))["lease"]["held"]  # given back at the run's end
    finally:
        server.stop()


def _check_refused(found: dict, pid: int, run: Path) -> None:
    """Every request of the attacker a 4xx, nothing of the holder shown but its host, the weights unchanged."""
    assert found["health"]["lease"] == {"held": True, "holder": {"host": socket.gethostname()}}  # no PID, no folder
    status, answer = found["takeover"]
    assert status == 409 and answer["error"].startswith(
        f"this server serves another trainer (host {socket.gethostname()}); stop that run (the server's log names "
        "its PID and run folder), or wait")
    assert str(pid) not in answer["error"] and str(run) not in answer["error"]
    assert found["no secret"] == [400, {"error": "a lease claim carries the run's secret: 32..256 ASCII characters "
                                                 "(the trainer keeps it in its run folder)"}]
    for name in ("push, guessed lease", "push, no lease", "shared push", "release"):
        status, answer = found[name]
        assert status == 409 and answer["error"].startswith("this request does not carry the server's lease (it is "
                                                            f"held by host {socket.gethostname()})"), name
    assert found["health after"]["weights_version"] == found["health"]["weights_version"]  # nothing went in
    assert found["health after"]["lease"]["held"]


def _health(address: str, headers: dict | None = None) -> str:
    from urllib.request import Request, urlopen

    with urlopen(Request(f"http://{address}/health", headers=headers or {}), timeout=60) as answer:
        return answer.read().decode()


def test_a_key_from_a_file_works_on_both_sides_and_the_flag_that_showed_it_is_refused(tmp_path, monkeypatch,
                                                                                        capsys):
    """``rollout-serve --api-key-file`` (mode 0600) and the trainer's AUTO_RESEARCH_API_KEY: the key as curl sends
    it works, a wrong one is named as wrong; ``--api-key`` (which the process list showed) and a file other users
    may read are refused at the start in one line, exit status 2."""
    from auto_research.cli import main
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.tiny import build_model, build_tokenizer
    from auto_research.errors import UserError
    from auto_research.http import authorization

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)

    def refused(*args) -> str:
        assert main(["rollout-serve", "--engine", "builtin", "--port", "0", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0].removeprefix("auto-research: error: ")

    gone = ("--api-key is refused: the process list shows a flag's value to every user of this machine; put the key "
            "in a file only you can read (chmod 600) and give --api-key-file FILE, or set AUTO_RESEARCH_API_KEY")
    assert refused("--api-key", KEY) == gone
    assert refused(f"--api-key={KEY}") == gone
    assert refused("--api-key-file", str(key_file), "--api-key", KEY) == gone
    shared = tmp_path / "shared-key"
    shared.write_text(KEY)
    shared.chmod(0o644)
    assert refused("--api-key-file", str(shared)) == (f"--api-key-file {shared} may be read by other users (mode "
                                                      f"0644): make it its owner's alone (chmod 600 {shared})")
    assert refused("--api-key-file", str(tmp_path / "none")).startswith(f"cannot read --api-key-file {tmp_path}/none")
    server = Server("--api-key-file", str(key_file), env=_environment(tmp_path))
    try:
        assert not any("warning" in line for line in server.lines)
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as raw:  # as curl sends it
            raw.sendall(b"GET /health HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
            assert raw.makefile("rb").readline().startswith(b"HTTP/1.0 200")
        health = json.loads(_health(server.address, {"Authorization": authorization(KEY)}))
        assert health["model"] == "embedded" and health["lease"] == {"held": False}
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=1)
        monkeypatch.setenv("AUTO_RESEARCH_API_KEY", KEY)
        client = ServerSampler(model, tokenizer, SamplingSettings(4), server.address, "embedded", World(),
                               tmp_path / "run", engine="builtin")
        assert len(client.sample(["1+2=", "x"], 2, [5, 6]).completions) == 4
        # Behind the key, /health names the holder in full: every client there knows the key.
        assert json.loads(_health(server.address, {"Authorization": authorization(KEY)}))["lease"]["holder"] == {
            "host": socket.gethostname(), "pid": os.getpid(), "run": str((tmp_path / "run").resolve())}
        client.close()
        monkeypatch.setenv("AUTO_RESEARCH_API_KEY", KEY[:-1])
        with pytest.raises(UserError) as caught:
            ServerSampler(model, tokenizer, SamplingSettings(4), server.address, "embedded", World(), tmp_path / "run",
                          engine="builtin")
        assert str(caught.value) == (f"--rollout-server {server.address} refused this API key: set "
                                     "AUTO_RESEARCH_API_KEY to the key the server was started with")
        monkeypatch.delenv("AUTO_RESEARCH_API_KEY")
        with pytest.raises(UserError) as caught:
            ServerSampler(model, tokenizer, SamplingSettings(4), server.address, "embedded", World(), tmp_path / "run",
                          engine="builtin")
        assert str(caught.value) == (f"--rollout-server {server.address} wants an API key: set AUTO_RESEARCH_API_KEY "
                                     "to the key the server was started with")
    finally:
        server.stop()


RULE = "an API key is 16 to 256 printable ASCII characters (letters, digits, punctuation, inner spaces)"


@pytest.mark.parametrize("key, message", [
    ("my-secret-key-€-2024", f"holds a character beyond ASCII (U+20AC) at character 15: {RULE}"),
    ("ключ-🔑-clé-and-more", f"holds a character beyond ASCII (U+043A) at character 1: {RULE}"),
    ("a-long-enough-key\nb", f"holds a control character (a line break, a tab?) at character 18: {RULE}"),
    ("a-long-enough-key\t", f"holds a control character (a line break, a tab?) at character 18: {RULE}"),
    (" a-long-enough-key", "begins or ends with a space, which HTTP drops from a header: remove it"),
    ("sesame", f"is 6 characters long: {RULE}"),
    ("k" * 257, f"is 257 characters long: {RULE}"),
    ("a-long-enough-key\udcff", f"holds a byte that is not UTF-8 text at character 18: {RULE}"),  # os.environ's
])
def test_a_key_that_is_not_printable_ascii_of_16_to_256_is_refused_at_the_start_on_both_sides(
        key, message, monkeypatch, capsys, tmp_path):
    from auto_research.cli import main
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.tiny import build_model, build_tokenizer
    from auto_research.errors import UserError

    def refused(*args) -> str:
        assert main(["rollout-serve", "--engine", "builtin", "--port", "0", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_bytes(key.encode("utf-8", "surrogateescape"))
    key_file.chmod(0o600)
    assert refused("--api-key-file", str(key_file)) == f"auto-research: error: --api-key-file {key_file} {message}"
    monkeypatch.setenv("AUTO_RESEARCH_API_KEY", key)
    assert refused() == f"auto-research: error: AUTO_RESEARCH_API_KEY {message}"
    tokenizer = build_tokenizer()
    with pytest.raises(UserError) as caught:  # before any request: nothing listens there
        ServerSampler(build_model(tokenizer, seed=0), tokenizer, SamplingSettings(4), "127.0.0.1:9", "embedded",
                      World(), tmp_path / "run", engine="builtin")
    assert str(caught.value) == f"AUTO_RESEARCH_API_KEY {message}"
    if "€" in key:  # the trainer's command: one line, exit status 2 (it said "wants an API key" of a key it had)
        assert main(["post-train", "--dataset", "arithmetic-generate", "--steps", "1", "--offline", "--sampler",
                     "builtin", "--rollout-mode", "server", "--rollout-server", "127.0.0.1:9", "--no-progress",
                     "--output-dir", str(tmp_path / "out")]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line == f"auto-research: error: AUTO_RESEARCH_API_KEY {message}"


def test_the_servers_bounds_are_checked_at_its_start(capsys):
    from auto_research.cli import main

    for args, message in ((["--max-request-tokens", "0"], "--max-request-tokens must be a positive integer, got 0"),
                          (["--max-server-tokens", "-1"], "--max-server-tokens must be a positive integer, got -1"),
                          (["--max-request-tokens", "100", "--max-server-tokens", "99"],
                           "--max-server-tokens 99 is below --max-request-tokens 100: a request allowed alone could "
                           "never go in")):
        assert main(["rollout-serve", "--engine", "builtin", *args]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"auto-research: error: {message}"]
