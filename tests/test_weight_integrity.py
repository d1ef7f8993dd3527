"""The rollout side's weights are the trainer's, or the run stops before it trains on what they drew: a slot of the
shared-memory buffer changed after the trainer's copy is refused (its checksum), a sampler whose draws are far from
the policy's stops the run (``--max-rollout-mismatch``), and ``--rollout-mode process``'s rollout process lives and
dies with its trainer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from auto_research.cli import main
from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.tiny import build_model, build_tokenizer
from test_builtin_server import start_builtin_server, stop


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)


def health(address: str) -> dict:
    from urllib.request import urlopen

    with urlopen(f"http://{address}/health", timeout=10) as answer:
        return json.loads(answer.read())


# --- 1. the shared buffer's checksums ---------------------------------------------------------------------------


def test_a_slot_written_after_the_trainers_copy_is_refused_and_the_engine_keeps_its_weights(tmp_path, no_key,
                                                                                           monkeypatch):
    """Another process of the same user zeroes the embedding's slot (the output layer's too: they are tied, and the
    server loads that one slot under both names) between the trainer's copy and its push
    (finite values: the NaN check alone let this through): the push is refused in one line naming the tensor and
    the file, the engine keeps the weights it had, the version does not move, and the next push goes in."""
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.rollout.transfer import SharedWriter
    from auto_research.errors import RolloutEngineError

    folder = tmp_path / "shm"
    folder.mkdir()
    server, engine = start_builtin_server(shared_folder=folder)
    address = f"127.0.0.1:{server.server_address[1]}"
    tokenizer = build_tokenizer()
    trained = build_model(tokenizer, seed=1)
    try:
        client = ServerSampler(trained, tokenizer, SamplingSettings(4), address, "embedded", World(), tmp_path / "run",
                               engine="builtin")
        assert client.transfer == "shared memory" and health(address)["weights_version"] == 1
        served = {name: tensor.clone() for name, tensor in engine.parameters.items()}
        with torch.no_grad():  # an optimizer step
            for parameter in trained.parameters():
                parameter.add_(0.01)
        name = "model.embed_tokens.weight"
        _, offset, shape, _ = next(slot for slot in server.intake.shared.slots if slot[0] == name)
        commit = SharedWriter.commit

        def scribbled(writer):  # after every copy and its checksum, before the push is posted
            with open(writer.path, "r+b") as file:
                file.seek(offset)
                file.write(bytes(4 * shape[0] * shape[1]))
            return commit(writer)

        monkeypatch.setattr(SharedWriter, "commit", scribbled)
        with pytest.raises(RolloutEngineError) as caught:
            client.load_weights(trained)
        assert str(caught.value) == (
            f"--rollout-server {address} refused /weights/shared: tensor {name!r} in the shared buffer is not what "
            f"the trainer wrote (its checksum differs: another process wrote to {client.link.path}); the engine "
            "keeps its weights")
        assert all(torch.equal(engine.parameters[key], served[key]) for key in served)
        assert health(address)["weights_version"] == 1
        monkeypatch.setattr(SharedWriter, "commit", commit)
        client.load_weights(trained)
        assert all(torch.equal(engine.parameters[key], tensor) for key, tensor in trained.named_parameters())
        assert health(address)["weights_version"] == 2
        client.close()
    finally:
        stop(server)


def test_a_shared_push_must_carry_one_checksum_per_tensor(tmp_path):
    from auto_research.engine.rollout.guard import Refused, weight_spec
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.rollout.transfer import SharedBuffer, checksum

    model = build_model(build_tokenizer(), seed=0)
    buffer = SharedBuffer(weight_spec(pushed_weights(model, torch.float32)), "lease", tmp_path)
    try:
        names = sorted(buffer.spec)
        right = [checksum(buffer.views[name]) for name in names]
        assert buffer.take({"nonce": buffer.nonce, "names": names, "checksums": right}) is buffer.views
        malformed = 'a shared push carries "checksums": one per name, each slot\'s as the trainer wrote it'
        for checksums, message in ((None, malformed), (right[1:], malformed), ([*right[:-1], 7], malformed),
                                   (["0" * 16, *right[1:]], f"tensor {names[0]!r} in the shared buffer is not what "
                                    f"the trainer wrote (its checksum differs: another process wrote to "
                                    f"{buffer.path}); the engine keeps its weights")):
            body = {"nonce": buffer.nonce, "names": names, **({} if checksums is None else {"checksums": checksums})}
            with pytest.raises(Refused) as caught:
                buffer.take(body)
            assert (caught.value.status, caught.value.message) == (400, message)
    finally:
        buffer.close()


def test_a_tied_weight_is_written_once_and_loaded_from_its_sources_slot(tmp_path):
    from auto_research.engine.rollout.guard import Refused, weight_spec
    from auto_research.engine.rollout.remote import pushed_weights, tied_weights
    from auto_research.engine.rollout.transfer import SharedBuffer, SharedWriter

    model = build_model(build_tokenizer(), seed=0)
    buffer = SharedBuffer(weight_spec(pushed_weights(model, torch.float32)), "lease", tmp_path)
    try:
        writer = SharedWriter(buffer.offer(), tied_weights(model))
        for name, tensor in pushed_weights(model, torch.float32):
            writer.write(name, tensor)
        body = json.loads(writer.commit())
        assert body["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
        assert "lm_head.weight" not in body["names"] and len(body["names"]) == len(buffer.spec) - 1
        views = buffer.take(body)
        assert list(views) == list(buffer.spec)
        assert views["lm_head.weight"] is views["model.embed_tokens.weight"]
        assert torch.equal(views["lm_head.weight"], model.lm_head.weight)
        for changed, message in (
                ({"names": [*body["names"], "lm_head.weight"], "checksums": [*body["checksums"], "0"]},
                 "tensor 'lm_head.weight' was sent twice in one push"),
                ({"tied": {"lm_head.weight": "model.norm.weight"}},
                 "'lm_head.weight' cannot repeat 'model.norm.weight' (another shape or dtype, a later weight, or "
                 "itself a repeat)")):
            with pytest.raises(Refused) as caught:
                buffer.take({**body, **changed})
            assert (caught.value.status, caught.value.message) == (400, message)
        older = SharedWriter({**buffer.offer(), "ties": False}, tied_weights(model))  # a server without ties
        for name, tensor in pushed_weights(model, torch.float32):
            older.write(name, tensor)
        assert "tied" not in json.loads(older.commit())
        older.close()
        writer.close()
    finally:
        buffer.close()


def test_a_writer_closed_by_another_thread_refuses_the_rest_of_its_push(tmp_path):
    """A fleet leaves a server (its heartbeat) from one thread while that server's push writes from another: the
    writes after the close are refused in one line (a write into the unmapped buffer would crash the process)."""
    from auto_research.engine.rollout.guard import weight_spec
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.rollout.transfer import SharedBuffer, SharedWriter
    from auto_research.errors import RolloutEngineError

    model = build_model(build_tokenizer(), seed=0)
    weights = dict(pushed_weights(model, torch.float32))
    buffer = SharedBuffer(weight_spec(weights.items()), "lease", tmp_path)
    try:
        writer = SharedWriter(buffer.offer())
        first, second = sorted(buffer.spec)[:2]
        writer.write(first, weights[first])
        assert torch.equal(buffer.views[first], weights[first])
        writer.close()
        writer.close()  # the fleet's leave and the run's close may both come
        with pytest.raises(RolloutEngineError, match="the push was abandoned: the server left the pool or the run "
                                                     "closed"):
            writer.write(second, weights[second])
    finally:
        buffer.close()


# --- 2. --max-rollout-mismatch ----------------------------------------------------------------------------------


def _server_run(tiny_model_dir, sums_jsonl, output, address, *flags) -> int:
    return main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "4",
                 "--prompts-per-step", "2", "--max-new-tokens", "3", "--evaluation-examples", "4", "--eval-every", "0",
                 "--checkpoint-every", "1", "--offline", "--device", "cpu", "--no-progress", "--output-dir",
                 str(output), "--rollout-mode", "server", "--rollout-server", address, *flags])


def test_a_sampler_whose_weights_went_wrong_stops_the_run_before_it_trains_on_its_draws(
        tiny_model_dir, sums_jsonl, tmp_path, no_key, capsys):
    """The server's output layer turns to finite garbage from the push after step 2 on (weights that every check of
    a push passes; the tiny random policy is near-uniform, the garbage draws a few tokens almost surely). Step 3
    stops the run in one line naming the figure, the bound and the flag, keeping step 2's checkpoint and metrics,
    before the update; the same run against a sound server goes on."""
    from transformers import AutoModelForCausalLM

    server, engine = start_builtin_server(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    address = f"127.0.0.1:{server.server_address[1]}"
    loaded, pushes = engine.load_named, []

    def load_then_break(weights) -> None:
        loaded(weights)
        pushes.append(None)
        if broken and len(pushes) >= 3:
            garbage = engine.parameters["lm_head.weight"]
            garbage.copy_(torch.randn(garbage.shape, generator=torch.Generator().manual_seed(0)) * 30)

    engine.load_named = load_then_break
    try:
        broken = False
        assert _server_run(tiny_model_dir, sums_jsonl, tmp_path / "sound", address) == 0
        rows = [json.loads(line) for line in (tmp_path / "sound" / "rloo-sums-seed42" / "metrics.jsonl").open()]
        assert len(rows) == 4 and all(row["rollout_logprob_diff_mean"] < 1e-4 for row in rows)
        capsys.readouterr()
        broken, pushes[:] = True, []
        assert _server_run(tiny_model_dir, sums_jsonl, tmp_path / "broken", address) == 2
    finally:
        stop(server)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    run = tmp_path / "broken" / "rloo-sums-seed42"
    found = re.fullmatch(
        r"auto-research: error: step 3: the sampler's log-probs are (\S+) nats a token from the trainer's on its "
        r"samples \(rollout_logprob_diff_mean; the largest \S+\), above --max-rollout-mismatch 1: they were not "
        r"drawn by the policy being trained \(its weights went wrong on the rollout side, or another process changed "
        r"them\), so the step was not trained on them; the last good checkpoint is "
        + re.escape(str(run / "checkpoints" / "step-000002"))
        + r" \(restart the server, then continue with the same command and --resume\)", line)
    assert found and float(found.group(1)) > 1, line
    assert [json.loads(row)["step"] for row in (run / "metrics.jsonl").open()] == [1, 2]
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert len(pushes) == 3  # no push after step 3: it did not train


def test_a_step_stopped_by_the_bound_leaves_the_policy_as_it_was(tiny_model_dir, sums_jsonl, tmp_path, no_key, capsys):
    """The check runs before the update: a bound no sampler in another process can meet stops step 1 with the
    policy's weights as they were loaded."""
    from transformers import AutoModelForCausalLM

    from auto_research.config.generation import GenerationConfig
    from auto_research.errors import RolloutEngineError
    from auto_research.train.trainer import Trainer

    server, _ = start_builtin_server(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        config = GenerationConfig(model=str(tiny_model_dir), dataset=str(sums_jsonl), steps=2, prompts_per_step=2,
                                  max_new_tokens=3, evaluation_examples=4, eval_every=0, offline=True, device="cpu",
                                  progress=False, output_dir=tmp_path, vllm_mode="server", vllm_server=address,
                                  max_rollout_mismatch=1e-30)
        trainer = Trainer.build(config, log=lambda line: None)
        before = {name: tensor.clone() for name, tensor in trainer.components.policy.state_dict().items()}
        with pytest.raises(RolloutEngineError) as caught:
            trainer.step(1)
        trainer.close()
    finally:
        stop(server)
    assert str(caught.value).startswith("step 1: the sampler's log-probs are ")
    assert "above --max-rollout-mismatch 1e-30:" in str(caught.value)
    after = trainer.components.policy.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_the_bound_is_a_positive_finite_number(tmp_path, capsys, value):
    assert main(["post-train", "--dataset", "arithmetic-generate", "--output-dir", str(tmp_path / "out"),
                 "--max-rollout-mismatch", value]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"auto-research: error: --max-rollout-mismatch must be a finite number > 0, got {float(value)}"]
    assert not (tmp_path / "out").exists()


# --- 3 and 4. --rollout-mode process: the rollout process and its trainer ----------------------------------------


def test_a_server_that_dies_while_it_answers_is_a_failed_request_not_a_traceback():
    """Killed mid-answer, a server leaves its client an answer shorter than its Content-Length (``IncompleteRead``,
    seen when a rollout server was SIGKILLed during a draw): retried, then ``RequestFailed`` like a refused one."""
    import socket
    import threading

    from auto_research.http import RequestFailed, request

    listener = socket.create_server(("127.0.0.1", 0))
    answered = []

    def answer_half() -> None:
        for _ in range(3):
            connection, _ = listener.accept()
            with connection:
                request = b""  # the whole request, headers and body ("{}"): closed with bytes unread, a socket
                while not request.endswith(b"\r\n\r\n{}"):  # resets its peer (ECONNRESET, not IncompleteRead)
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
                answered.append(None)

    threading.Thread(target=answer_half, daemon=True).start()
    with listener, pytest.raises(RequestFailed) as caught:
        request(f"http://127.0.0.1:{listener.getsockname()[1]}/generate", b"{}", "application/json", 10.0, 2, 0.01)
    assert (caught.value.attempts, caught.value.status, len(answered)) == (3, None, 3)
    assert caught.value.failure == "IncompleteRead(1 bytes read, 99 more expected)"


def _alive(pid: int) -> bool:
    """A process that runs (or is stopped); a zombie nobody has reaped yet counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _rollout_process(trainer: int) -> int | None:
    """The trainer's child that runs rollout-serve, once there is one."""
    for task in Path(f"/proc/{trainer}/task").glob("*"):
        try:
            children = [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                if b"rollout-serve" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:
                pass
    return None


def _wait_for(condition, seconds: float, what: str, run: subprocess.Popen | None = None, log: Path | None = None):
    """``condition()``'s first true value, polled; the test fails naming ``what`` after ``seconds``, or at once when
    ``run`` ended first (with the end of its ``log``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run is not None and run.poll() is not None:
            pytest.fail(f"the run ended (status {run.returncode}) before {what}: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    tail = f": {log.read_text()[-2000:]}" if log is not None else ""
    pytest.fail(f"{what} did not happen within {seconds:g} s{tail}{_stacks(run)}")


def _stacks(run: subprocess.Popen | None) -> str:
    """Where a hung run and its children are (py-spy's dump of every thread), when py-spy is installed: a run that
    hangs once in many says nothing else."""
    import shutil

    if run is None or shutil.which("py-spy") is None:
        return ""
    children = Path(f"/proc/{run.pid}/task/{run.pid}/children")
    pids = [run.pid, *(int(pid) for pid in (children.read_text().split() if children.exists() else []))]
    texts = []
    for pid in pids:
        for look in (1, 2):  # twice, 5 s apart: a thread that moved is slow, one that did not is stuck
            try:
                dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True,
                                      text=True, timeout=60)
                texts.append(f"\n--- py-spy dump {look} of {pid} ({_cpu_times(pid)}):\n{dump.stdout[-6000:]}"
                             f"{dump.stderr[-500:]}")
            except (OSError, subprocess.TimeoutExpired) as error:
                texts.append(f"\n--- py-spy dump of {pid} failed: {error}")
            if look == 1:
                time.sleep(5)
    try:  # the processes' TCP connections, and every socket on their listening ports (SYN-RECV too)
        lines = subprocess.run(["ss", "-tanpo"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        theirs = [line for line in lines if any(f"pid={pid}," in line for pid in pids)]
        ports = {line.split()[3].rpartition(":")[2] for line in theirs if line.startswith("LISTEN")}
        texts.append("\n--- their TCP sockets (ss -tanpo):\n" + "\n".join(
            line for line in lines if line in theirs or any(f":{port} " in line for port in ports)))
    except (OSError, subprocess.TimeoutExpired, IndexError) as error:
        texts.append(f"\n--- ss failed: {error}")
    return "".join(texts)


def _cpu_times(pid: int) -> str:
    """A process's state and each thread's CPU seconds (user + system), from /proc: a thread that spins, one that
    waits, and a process stopped or in the D state tell apart."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = []
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            threads.append(f"{task.name}: {(int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK'):.2f} s "
                           f"{fields[0]}")
        return f"state {state}; threads " + ", ".join(threads)
    except (OSError, IndexError, ValueError) as error:
        return f"/proc unreadable: {error}"


def _buffers(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"auto-research-weights-{pid}-*"))


@pytest.fixture
def process_run(tiny_model_dir, sums_jsonl, tmp_path):
    """A --rollout-mode process run in a session of its own, handed over once its rollout process holds a shared
    buffer: (the trainer's Popen, the rollout process's PID, the run folder, the trainer's stderr file). Whatever of
    the session is left at the end is SIGKILLed."""
    env = {key: value for key, value in os.environ.items() if key != "AUTO_RESEARCH_API_KEY"}
    env["OMP_NUM_THREADS"] = "1"
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "auto_research", "post-train", "--model", str(tiny_model_dir), "--dataset",
             str(sums_jsonl), "--steps", "100000", "--prompts-per-step", "2", "--max-new-tokens", "3",
             "--evaluation-examples", "4", "--eval-every", "0", "--checkpoint-every", "1", "--offline", "--device",
             "cpu", "--no-progress", "--threads", "1", "--rollout-mode", "process", "--output-dir",
             str(tmp_path / "out")], env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    child = None
    try:
        child = _wait_for(lambda: _rollout_process(trainer.pid), 240, "the rollout process's start", trainer, log)
        _wait_for(lambda: _buffers(child), 240, "the rollout process's shared buffer", trainer, log)
        yield trainer, child, tmp_path / "out" / "rloo-sums-seed42", log
    finally:
        try:
            os.killpg(trainer.pid, signal.SIGKILL)  # the session this test started: the trainer's and its child's
        except ProcessLookupError:
            pass
        trainer.wait()
        if child is not None:  # a test that failed: what its SIGKILLed rollout process could not remove
            _wait_for(lambda: not _alive(child), 60, "the rollout process's end")
            for path in _buffers(child):
                path.unlink(missing_ok=True)


def test_the_rollout_process_ends_with_its_sigkilled_trainer_and_removes_its_buffer(process_run):
    trainer, child, _, _ = process_run
    assert _alive(child) and len(_buffers(child)) == 1
    trainer.kill()
    trainer.wait()
    _wait_for(lambda: not _alive(child), 120, "the orphaned rollout process's exit")
    assert _buffers(child) == []  # it stopped cleanly: its shared-memory file went with it


def test_a_rollout_process_that_dies_is_named_in_its_trainers_line(process_run):
    """Not "restart the server": the user started none; the run's --resume starts a new rollout process."""
    trainer, child, run, log = process_run
    # Any checkpoint, not step 1's: two are kept, so step 1's is gone by step 3, and this run makes about 25 steps
    # a second, faster than the 0.1 s between two looks. Waiting for step 1's was the test's hang once in many runs.
    _wait_for(lambda: any((run / "checkpoints").glob("step-*")), 240, "a checkpoint", trainer, log)
    os.kill(child, signal.SIGKILL)
    assert trainer.wait(timeout=240) == 2, log.read_text()[-2000:]
    err = log.read_text()
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert _buffers(child) == []  # killed, it could not remove its shared buffer: its trainer did
    assert re.fullmatch(
        rf"auto-research: error: --rollout-mode process: this run's rollout process \(PID {child}\) was killed by "
        rf"SIGKILL; the last good checkpoint is {re.escape(str(run / 'checkpoints'))}/step-\d{{6}} \(continue with "
        r"the same command and --resume\)", line), line
