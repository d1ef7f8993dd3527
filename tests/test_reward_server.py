"""--reward-url against a real HTTP server on 127.0.0.1, started by the test: slow answers, a 500, a malformed
body, a dropped connection, a server that stays down."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from auto_research.data.types import Example
from auto_research.errors import RewardError
from auto_research.rewards.remote import RemoteReward


class Server:
    """Answers each POST by the next behaviour in ``plan`` (the last one repeats): ok, slow, 500, garbage, drop."""

    def __init__(self, plan):
        self.plan, self.requests = list(plan), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                behaviour = outer.plan.pop(0) if len(outer.plan) > 1 else outer.plan[0]
                if behaviour == "drop":
                    self.connection.close()
                    return
                if behaviour == "slow":
                    time.sleep(5.0)
                if behaviour == "500":
                    self.send_error(500, "boom")
                    return
                text = "not json" if behaviour == "garbage" else json.dumps(
                    [float(len(c)) if c != "?" else None for c in body["completions"]])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(text.encode())

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                """A "slow" answer's client has given up by the time it is written (BrokenPipeError): that is the
                plan, and socketserver's traceback would land in whichever test the worker runs 5 s later."""

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(*plan):
        servers.append(Server(plan))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


EXAMPLES = [Example("1+1=", "2", fields={"prompt": "1+1=", "answer": "2", "level": 1}),
            Example("2+2=", "4", fields={"prompt": "2+2=", "answer": "4", "level": 3})]


def test_a_batch_is_one_post_with_prompts_completions_and_columns(serve):
    server = serve("ok")
    assert RemoteReward(server.url)(["1+1=", "2+2="], ["22", "?"], EXAMPLES) == [2.0, None]
    assert server.requests == [{"prompts": ["1+1=", "2+2="], "completions": ["22", "?"],
                                "columns": {"answer": ["2", "4"], "level": [1, 3]}}]


@pytest.mark.parametrize("plan", [("slow", "ok"), ("500", "ok"), ("drop", "ok"), ("500", "drop", "ok")])
def test_transient_failures_are_retried(serve, plan):
    server = serve(*plan)
    reward = RemoteReward(server.url, timeout=2.0, retries=3, backoff=0.01)
    assert reward(["1+1=", "2+2="], ["22", "4444"], EXAMPLES) == [2.0, 4.0]
    assert len(server.requests) == len(plan)


def test_large_batches_go_as_several_requests(serve):
    server = serve("ok")
    examples = EXAMPLES * 5
    values = RemoteReward(server.url, batch_size=3, concurrency=2)(["p"] * 10, ["a" * i for i in range(10)], examples)
    assert values == [float(i) for i in range(10)] and len(server.requests) == 4


def test_a_malformed_answer_or_a_server_that_stays_down_is_one_line(serve):
    server = serve("garbage")
    with pytest.raises(RewardError, match="the answer is not JSON"):
        RemoteReward(server.url, retries=0)(["1+1="], ["2"], EXAMPLES[:1])
    server = serve("500")
    with pytest.raises(RewardError, match=r"HTTP 500 .* after 3 attempt\(s\)"):
        RemoteReward(server.url, retries=2, backoff=0.01)(["1+1="], ["2"], EXAMPLES[:1])


def test_a_run_against_a_down_server_exits_2_in_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    import socket

    from auto_research.cli import main

    with socket.socket() as probe:  # a port bound and kept, never listened on: no other process can take it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--steps", "2",
                     "--prompts-per-step", "2", "--max-new-tokens", "3", "--offline", "--no-progress",
                     "--output-dir", str(tmp_path), "--reward-url", f"http://127.0.0.1:{port}/score"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}/score" in lines[0] and "evaluation before training" in lines[0]
    assert main(["post-train", "--dataset", str(sums_jsonl), "--model", str(tiny_model_dir), "--reward-url",
                 "localhost:9", "--output-dir", str(tmp_path)]) == 2
    assert "expected http://HOST:PORT/PATH" in capsys.readouterr().err
