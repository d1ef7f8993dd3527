"""GSM8K download against a small HTTP server on 127.0.0.1 that the test starts."""

from __future__ import annotations

import hashlib
import http.server
import threading

import pytest

from auto_research.cli import main
from auto_research.errors import UserError
from auto_research.data.gsm8k import GSM8K_SHA256, ensure_gsm8k


@pytest.fixture(scope="module")
def server(shared_data):
    """Serves /good/<file> (the official bytes), /tampered/<file> (one byte changed)
    and /dropped/<file> (announces the full length, sends half, closes)."""
    payloads = {name: (shared_data / "gsm8k" / name).read_bytes() for name in GSM8K_SHA256}
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server API)
            requests.append(self.path)
            mode, _, name = self.path.strip("/").partition("/")
            if name not in payloads:
                self.send_error(404)
                return
            body = payloads[name]
            if mode == "tampered":
                body = body[:100] + (b"X" if body[100:101] != b"X" else b"Y") + body[101:]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if mode == "dropped":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests
    httpd.shutdown()
    httpd.server_close()


def test_download_checks_sha256_and_writes_both_files(server, tmp_path):
    url, _ = server
    directory = ensure_gsm8k(tmp_path, offline=False, base_url=f"{url}/good")
    for name, expected in GSM8K_SHA256.items():
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == expected
    assert sorted(path.name for path in directory.iterdir()) == ["test.jsonl", "train.jsonl"]


def test_present_files_are_not_downloaded_again(server, tmp_path):
    url, requests = server
    ensure_gsm8k(tmp_path, offline=False, base_url=f"{url}/good")
    before = len(requests)
    ensure_gsm8k(tmp_path, offline=False, base_url=f"{url}/good")
    assert len(requests) == before


def test_sha256_mismatch_keeps_nothing(server, tmp_path):
    url, _ = server
    with pytest.raises(UserError, match=r"has sha256 [0-9a-f]{64}, expected 17f347dc.*nothing was kept"):
        ensure_gsm8k(tmp_path, offline=False, base_url=f"{url}/tampered")
    assert list((tmp_path / "gsm8k").iterdir()) == []


def test_dropped_connection_keeps_nothing(server, tmp_path):
    url, _ = server
    with pytest.raises(UserError, match="broke off after .* bytes; nothing was kept"):
        ensure_gsm8k(tmp_path, offline=False, base_url=f"{url}/dropped")
    assert list((tmp_path / "gsm8k").iterdir()) == []


def test_unreachable_server_is_one_clear_error(tmp_path, capsys):
    # Port 9 on loopback: nothing listens there, so the connection is refused at once.
    code = main(["data", "gsm8k", "--dataset-dir", str(tmp_path), "--base-url", "http://127.0.0.1:9"])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1
    assert "download of http://127.0.0.1:9/train.jsonl failed" in error
    assert list((tmp_path / "gsm8k").iterdir()) == []


def test_data_command_and_online_post_train_download(server, tmp_path, capsys, monkeypatch):
    url, _ = server
    assert main(["data", "gsm8k", "--dataset-dir", str(tmp_path / "a"), "--base-url", f"{url}/good"]) == 0
    assert "downloaded" in capsys.readouterr().out
    # Without --offline, post-train fetches what is missing (here from the mirror named by the environment).
    monkeypatch.setenv("AUTO_RESEARCH_GSM8K_URL", f"{url}/good")
    code = main(["post-train", "--dataset", "gsm8k-candidate", "--steps", "300", "--dataset-dir", str(tmp_path / "b"),
                 "--output-dir", str(tmp_path / "out")])
    assert code == 0
    assert "0.8281" in capsys.readouterr().out
    assert (tmp_path / "b" / "gsm8k" / "test.jsonl").is_file()
