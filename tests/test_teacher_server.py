"""A served teacher: a rollout server's ``POST /logprobs`` (builtin and vLLM engines) and its client
(``engine/rollout/teacher.py``): the trainer's own log-probs, 4xx lines for bad requests, the API key without a
lease, and a server killed mid-call as one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout.builtin import BuiltinEngine, sample
from auto_research.engine.rollout.teacher import ServedTeacher
from auto_research.engine.tiny import build_model, build_tokenizer
from auto_research.errors import RolloutEngineError, UserError

PROMPTS = ["1+2=", "Q: what is 33+4?", "x", "7*8="]
KEY = "teacher-secret-5d2e8b"
BOUND = 600
"""The test server's --max-request-tokens: the client splits what is larger."""


def serve(model, tokenizer, api_key=None, engine=None):
    """``engine`` (a builtin one over ``model`` by default) behind the real HTTP server, in this process."""
    from auto_research.engine.rollout.guard import weight_spec
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.rollout.server import Limits, Served, fingerprint, make_server, vocabulary

    served = Served("teacher", fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, torch.float32)),
                    model.config.vocab_size, "float32", vocabulary=vocabulary(tokenizer))
    server = make_server(engine or BuiltinEngine(model, tokenizer), served, "127.0.0.1", 0,
                         Limits(api_key, shared_folder=None, max_request_tokens=BOUND))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def teacher():
    """The embedded model, sharpened (so that its log-probs are far from uniform), served with an API key."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=3).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    server, address = serve(model, tokenizer, KEY)
    yield model, tokenizer, address
    server.shutdown()
    server.server_close()


def _rollout(model, tokenizer, group_size=4, prompts=PROMPTS):
    return sample(model, tokenizer, prompts, group_size, 12, seeds=[5, 6, 7, 8][: len(prompts)])


def _rows(rollout):
    """Each row's prompt ids and completion ids."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.sequences[:, :rollout.prompt_length],
                                                                rollout.prompt_mask)]
    return prompts, rollout.token_lists()


def _local(model, rollout, group_size):
    """The trainer's teacher log-probs (``signals.teacher.teacher_signal``: ``token_logprobs`` at temperature 1, no
    gradient) of each row's completion tokens."""
    with torch.no_grad():
        values = token_logprobs(model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0,
                                group_size=group_size)
    return [row[: len(ids)] for row, ids in zip(values.tolist(), rollout.token_lists())]


def test_served_log_probs_are_the_trainers_own_exactly_in_groups_and_within_1e_5_in_any_order(teacher):
    model, tokenizer, address = teacher
    student = build_model(tokenizer, seed=0)
    rollout = _rollout(student, tokenizer)  # another model's samples, as a student's
    prompts, completions = _rows(rollout)
    assert sum(map(len, completions)) > 3 * len(completions)
    client = ServedTeacher(address, tokenizer, api_key=KEY)
    served = client.logprobs(prompts, completions)
    # One request (under the bound), groups of 4 rows with one prompt: the trainer's own forward, bit for bit.
    assert served == _local(model, rollout, 4)
    assert (client.weights_version, len(client.instance)) == (0, 16)
    # Any order (no groups to share a prompt, the plain forward), or split into requests under the bound: 1e-5.
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = client.logprobs([prompts[i] for i in order], [completions[i] for i in order])
    big = _rollout(student, tokenizer, group_size=16)
    big_prompts, big_completions = _rows(big)
    assert sum(map(len, big_prompts)) + sum(map(len, big_completions)) > BOUND  # two requests at least
    for got, expected in ((shuffled, [served[i] for i in order]), (client.logprobs(big_prompts, big_completions),
                                                                    _local(model, big, 16))):
        difference = max(abs(a - b) for row, other in zip(got, expected) for a, b in zip(row, other))
        assert difference <= 1e-5, difference
    assert all(len(row) == len(ids) for row, ids in zip(served, completions)) and max(map(max, served)) <= 0


def _post(address, body, key=KEY, path="/logprobs"):
    """(status, JSON answer) of one raw request."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{address}{path}", data, headers), timeout=60) as a:
            return a.status, json.loads(a.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        assert "\n" not in text, text  # one JSON line
        return error.code, json.loads(text)["error"]


def test_malformed_or_oversized_requests_are_a_4xx_line_and_the_server_goes_on(teacher):
    model, tokenizer, address = teacher
    vocab = model.config.vocab_size
    good = {"prompt_ids": [[5, 6, 7]], "completion_ids": [[8, 9]]}
    cases = [
        (b"{not json", 400, "not JSON"),
        ([1, 2], 400, "a /logprobs request is"),
        ({**good, "temperature": 0.5}, 400, "nothing else"),
        ({"prompt_ids": [[5]]}, 400, "a /logprobs request is"),
        ({"prompt_ids": "5 6", "completion_ids": [[8]]}, 400, "lists of 1..4096 rows"),
        ({"prompt_ids": [[5], [6]], "completion_ids": [[8]]}, 400, "as many of each"),
        ({"prompt_ids": [], "completion_ids": []}, 400, "lists of 1..4096 rows"),
        ({"prompt_ids": [[5, "6"]], "completion_ids": [[8]]}, 400, "prompt 0 has token id '6'"),
        ({"prompt_ids": [[5]], "completion_ids": [[8, True]]}, 400, "completion 0 has token id True"),
        ({"prompt_ids": [[5]], "completion_ids": [[8.0]]}, 400, "completion 0 has token id 8.0"),
        ({"prompt_ids": [[5]], "completion_ids": [[vocab]]}, 400, f"outside the vocabulary 0..{vocab - 1}"),
        ({"prompt_ids": [[-1]], "completion_ids": [[8]]}, 400, "prompt 0 has token id -1"),
        ({"prompt_ids": [[5]], "completion_ids": [[]]}, 400, "completion 0 is empty"),
        ({"prompt_ids": [[5] * 40], "completion_ids": [[8] * 25]}, 400, "65 tokens (prompt + completion), over the "
                                                                       "64 a row that this server scores"),
        ({"prompt_ids": [[5] * 50] * 12, "completion_ids": [[8] * 10] * 12}, 413, f"server's bound of {BOUND}"),
    ]
    for body, status, words in cases:
        got, error = _post(address, body)
        assert got == status and words in error, (body if isinstance(body, bytes) else str(body)[:80], got, error)
    assert _post(address, good)[0] == 200
    client = ServedTeacher(address, tokenizer, api_key=KEY)
    with pytest.raises(RolloutEngineError, match=r"refused /logprobs: completion 0 has token id") as refused:
        client.logprobs([[5]], [[vocab + 3]])
    assert "\n" not in str(refused.value)


def test_the_api_key_is_needed_and_no_lease_even_while_a_trainer_holds_it(teacher):
    model, tokenizer, address = teacher
    body = {"prompt_ids": [[5, 6]], "completion_ids": [[7, 8, 9]]}
    assert _post(address, body, key=None)[0] == 401
    assert _post(address, body, key="x" * 16)[0] == 401
    with pytest.raises(UserError, match="wants an API key"):
        ServedTeacher(address, tokenizer, api_key=None)
    with pytest.raises(UserError, match="refused this API key"):
        ServedTeacher(address, tokenizer, api_key="y" * 20)
    status, lease = _post(address, {"holder": {"host": "h", "pid": 1, "run": "/r"}, "secret": "s" * 64}, path="/lease")
    assert status == 200
    try:
        status, answer = _post(address, body)  # no lease carried: answered all the same
        assert status == 200 and len(answer["logprobs"][0]) == 3 and answer["weights_version"] == 0
    finally:
        request = urllib.request.Request(f"http://{address}/lease/release", b"{}",
                                         {"Authorization": f"Bearer {KEY}", "X-Lease": lease["lease"]})
        urllib.request.urlopen(request, timeout=60).close()


def test_a_teacher_with_another_tokenizer_is_refused_at_once(teacher):
    _, tokenizer, address = teacher

    class Other:
        def get_vocab(self):
            return {**tokenizer.get_vocab(), "<extra>": 10_000}

    with pytest.raises(UserError, match="whose tokenizer is not the policy's"):
        ServedTeacher(address, Other(), api_key=KEY)
    with pytest.raises(UserError, match="no rollout server answers there"):
        ServedTeacher("127.0.0.1:9", tokenizer, api_key=KEY)


SLOW_SERVER = """
import sys, time
import torch
from auto_research.engine.rollout.builtin import BuiltinEngine
from auto_research.engine.tiny import build_model, build_tokenizer
sys.path.insert(0, sys.argv[1])
from test_teacher_server import serve

class Slow(BuiltinEngine):
    def logprobs(self, prompts, completions):
        print("scoring", flush=True)
        time.sleep(60)

tokenizer = build_tokenizer()
model = build_model(tokenizer, seed=0)
server, address = serve(model, tokenizer, engine=Slow(model, tokenizer))
print(address, flush=True)
time.sleep(600)
"""


def test_a_server_killed_mid_call_is_a_rolloutengineerror_in_one_line(monkeypatch):
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    process = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, os.path.dirname(__file__)], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        address = process.stdout.readline().strip()
        client = ServedTeacher(address, build_tokenizer(), timeout=30, retries=2)
        failures = []

        def call():
            try:
                client.logprobs([[5, 6]], [[7]])
            except RolloutEngineError as error:
                failures.append(error)

        caller = threading.Thread(target=call)
        caller.start()
        assert process.stdout.readline().strip() == "scoring"
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGKILL)
        caller.join(30)
        assert not caller.is_alive() and time.monotonic() - started < 10
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    (failure,) = failures
    assert "\n" not in str(failure), failure
    assert str(failure).startswith(f"--teacher-model {address}: /logprobs failed ("), failure
    assert "after 3 attempt(s)); the server is gone or failing" in str(failure)


def test_a_vllm_teacher_scores_as_the_builtin_one_within_1e_4(tmp_path):
    """vLLM's prompt log-probs (fp32 on the CPU) against the trainer's forward of the same model: 1e-4, the bound
    test_vllm.py sets for vLLM's sampled log-probs against the trainer's (measured about 1e-5 there: other
    kernels, another order of sums), and the numbers must be temperature 1's whatever the engine's logprobs mode."""
    pytest.importorskip("vllm")
    from test_vllm_server import ARCH, Server

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, **ARCH).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    server = Server(tmp_path, env={"AUTO_RESEARCH_API_KEY": KEY})
    server.start()
    try:
        rollout = _rollout(model, tokenizer)
        prompts, completions = _rows(rollout)
        served = ServedTeacher(server.address, tokenizer, api_key=KEY).logprobs(prompts, completions)
        # vLLM draws a token after the row, within max_model_len (64): a row of 63 is the longest it scores.
        client = ServedTeacher(server.address, tokenizer, api_key=KEY)
        longest = client.logprobs([[5] * 40], [[6] * 23])
        with pytest.raises(RolloutEngineError, match="64 tokens .prompt . completion., over the 63 a row"):
            client.logprobs([[5] * 40], [[6] * 24])
    finally:
        server.stop()
    expected = _local(model, rollout, 4)
    difference = max(abs(a - b) for row, other in zip(served, expected) for a, b in zip(row, other))
    print(f"vLLM against the trainer's log-probs: largest difference {difference:.2e}")
    assert difference <= 1e-4, difference
    assert len(longest[0]) == 23


class _FailsAfterOne(BuiltinEngine):
    """A teacher's engine that scores one batch, then fails every call (a server whose engine broke mid-run)."""

    calls = 0

    def logprobs(self, prompts, completions):
        type(self).calls += 1
        if type(self).calls > 1:
            raise RuntimeError("the teacher's engine broke")
        return super().logprobs(prompts, completions)


def _teacher_served_well_and_broken(tmp_path, monkeypatch):
    """A teacher model saved to a folder, and two servers of it: one as it is, one whose engine fails after its first
    answer; (the folder, (server, address), (broken server, its address))."""
    from transformers import AutoModelForCausalLM

    from test_distillation import _other_model

    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    folder = _other_model(tmp_path / "teacher")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), build_tokenizer()
    _FailsAfterOne.calls = 0
    return folder, serve(model, tokenizer), serve(model, tokenizer, engine=_FailsAfterOne(model, tokenizer))


def test_a_run_with_a_served_teacher_trains_as_with_the_same_teacher_loaded_and_stops_in_one_line_when_it_fails(
        tiny_model_dir, tmp_path, monkeypatch):
    """--teacher-model http://HOST:PORT: the server's log-probs in place of the local forward give the run that
    loads the same teacher (every figure within 1e-5, the same rewards); a teacher server that fails (after the
    client's retries) stops the run in one line naming it and what was kept, never a zero term."""
    from test_distillation import _compared, _rows as run_rows

    folder, (server, address), (broken, broken_address) = _teacher_served_well_and_broken(tmp_path, monkeypatch)
    try:
        loaded = run_rows(tmp_path, "loaded", tiny_model_dir, teacher_model=str(folder), steps=3)
        served = run_rows(tmp_path, "served", tiny_model_dir, teacher_model=f"http://{address}", steps=3)
        with pytest.raises(UserError) as stopped:
            run_rows(tmp_path, "broken", tiny_model_dir, teacher_model=f"http://{broken_address}", steps=3,
                     checkpoint_every=1)
    finally:
        for each in (server, broken):
            each.shutdown()
            each.server_close()
    assert [row["reward_mean"] for row in served] == [row["reward_mean"] for row in loaded]
    assert served[0]["teacher_tokens"] > 0 and abs(served[0]["teacher_reverse_kl"]) > 1e-3  # a term of its own
    for got, expected in zip(served, loaded):
        for key, value in {**_compared(expected), "teacher_reverse_kl": expected["teacher_reverse_kl"]}.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # Step 2: the teacher answers no row, so no sample of the step can be scored: one line naming the teacher's
    # failure and the checkpoint kept.
    line = str(stopped.value)
    assert "\n" not in line and line.startswith(
        f"no sample of step 2 could be scored: --teacher-model {broken_address}: /logprobs failed ("), line
    assert "; the server is gone or failing for all 8 completions; saved the last good step (1) in " in line, line
    assert line.endswith("step-000001"), line


def _taught_rows(count: int, teachers: tuple[str, ...]) -> list[dict]:
    """Sums whose ``teacher`` column names each row's teacher in turn."""
    return [{"prompt": f"{i % 7}+{i // 7}=", "answer": str(i % 7 + i // 7), "teacher": teachers[i % len(teachers)]}
            for i in range(count)]


def test_several_teachers_score_their_own_rows_and_one_that_fails_leaves_its_rows_unscored(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """--teacher-model NAME=SOURCE twice, a ``teacher`` column naming each row's: each row is scored by its own
    teacher (tokens per teacher), and a teacher whose server breaks after its first answer leaves its rows unscored,
    with its cause counted, while the run goes on with the other teacher's rows."""
    from auto_research import post_train

    _, (good, good_address), (broken, broken_address) = _teacher_served_well_and_broken(tmp_path, monkeypatch)
    rows = _taught_rows(40, ("good", "good", "broken"))
    try:
        post_train(rows, model=str(tiny_model_dir), teacher_model=[f"good=http://{good_address}",
                                                                   f"broken=http://{broken_address}"],
                   group_size=2, prompts_per_step=6, steps=3, max_new_tokens=3, output_dir=str(tmp_path / "run"),
                   offline=True, device="cpu", progress=False, threads=1, eval_every=0, evaluation_examples=4,
                   log=lambda text: None)
    finally:
        for each in (good, broken):
            each.shutdown()
            each.server_close()
    (folder,) = (tmp_path / "run").iterdir()
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    first, later = steps[0], steps[1:]
    assert first["unscored_samples"] == 0 and first["teacher/good/tokens"] > 0 and first["teacher/broken/tokens"] > 0
    assert first["teacher_tokens"] == first["teacher/good/tokens"] + first["teacher/broken/tokens"]
    unscored = sum(row["unscored_samples"] for row in later)
    assert unscored > 0 and all(row["teacher/broken/tokens"] == 0 for row in later)
    assert all(row["teacher/good/tokens"] == row["teacher_tokens"] > 0 for row in later)


def test_a_row_naming_no_teacher_of_several_is_refused_in_one_line(tiny_model_dir, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in _taught_rows(8, ("a", "b", "c"))))
    result = subprocess.run([sys.executable, "-m", "auto_research", "post-train", "--dataset", str(rows), "--model",
                             str(tiny_model_dir), "--teacher-model", f"a={tiny_model_dir}", "--teacher-model",
                             f"b={tiny_model_dir}", "--offline", "--device", "cpu", "--output-dir",
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "auto-research: error: rows: training row 3 names teacher 'c', and several --teacher-model entries need one "
        "of a, b in it"), result.stderr
    assert not (tmp_path / "runs").exists()


class _Gated(BuiltinEngine):
    """A teacher's engine that counts its calls and, once ``gate`` (a run's checkpoints folder) holds checkpoint 2
    or later, holds every call until ``released``: that run cannot score the batch of step 5 (drawn after step 3's
    weights) before the test kills it, whatever the machine's speed."""

    calls = 0
    gate = None
    released = threading.Event()

    def logprobs(self, prompts, completions):
        type(self).calls += 1
        if self.gate is not None and any(path.name >= "step-000002" for path in self.gate.glob("step-*")):
            self.released.wait(300)
        return super().logprobs(prompts, completions)


def test_a_run_in_flight_with_a_served_teacher_resumes_after_sigkill_to_the_same_rows(tiny_model_dir, tmp_path):
    """--max-staleness 1 and a served teacher: SIGKILL after checkpoint 2, then --resume, gives the uninterrupted
    run's rows; the checkpoint holds the teachers' scores of the batch drawn ahead, so the resumed run asks the
    teacher for the later batches only (one request a batch)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import kill_after_checkpoint
    from test_distillation import _other_model

    folder = _other_model(tmp_path / "teacher")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), build_tokenizer()
    server, address = serve(model, tokenizer, engine=_Gated(model, tokenizer))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in _taught_rows(40, ("t",))))
    env = {key: value for key, value in os.environ.items() if key != "AUTO_RESEARCH_API_KEY"}

    def args(name: str) -> list[str]:
        return ["post-train", "--dataset", str(rows), "--model", str(tiny_model_dir), "--teacher-model",
                f"http://{address}", "--max-staleness", "1", "--steps", "5", "--checkpoint-every", "1",
                "--group-size", "2", "--prompts-per-step", "4", "--max-new-tokens", "3", "--threads", "1",
                "--eval-every", "0", "--evaluation-examples", "4", "--offline", "--device", "cpu", "--no-progress",
                "--output-dir", str(tmp_path / name)]

    try:
        whole = subprocess.run([sys.executable, "-m", "auto_research", *args("whole")], env=env, capture_output=True,
                               text=True, timeout=300)
        assert whole.returncode == 0, whole.stderr
        (run,) = (tmp_path / "whole").iterdir()
        _Gated.gate = tmp_path / "killed" / run.name / "checkpoints"
        try:
            kill_after_checkpoint(args("killed"), env, _Gated.gate / "step-000002")
        finally:
            _Gated.gate = None
            _Gated.released.set()
        (checkpoint,) = sorted((tmp_path / "killed" / run.name / "checkpoints").glob("step-*"))[-1:]
        saved = load_file(str(checkpoint / "in_flight.safetensors"))
        assert any(key.endswith("/outside/teacher") for key in saved), sorted(saved)
        assert len((tmp_path / "killed" / run.name / "metrics.jsonl").read_text().splitlines()) < 5  # killed mid-run
        _Gated.calls = 0
        resumed = subprocess.run([sys.executable, "-m", "auto_research", *args("killed"), "--resume"], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        # Resumed after step c (2 or 3: checkpoint 4 would need step 5's batch, held above), with step c + 1's batch
        # and its scores saved: the teacher is asked for steps c + 2 … 5 alone.
        assert _Gated.calls == 5 - (int(checkpoint.name.removeprefix("step-")) + 1), (checkpoint.name, _Gated.calls)
    finally:
        server.shutdown()
        server.server_close()

    def figures(name: str) -> list[dict]:
        lines = (tmp_path / name / run.name / "metrics.jsonl").read_text().splitlines()
        return [{key: value for key, value in json.loads(line).items() if not key.startswith(("time_", "step_seconds",
                                                                                               "tokens_per_second"))}
                for line in lines]

    assert len(figures("whole")) == 5 and figures("killed") == figures("whole")
