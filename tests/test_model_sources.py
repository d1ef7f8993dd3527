"""Where --model comes from, failing fast: a near-miss name lists the packaged models; a hub id with no way to the
hub is one line within seconds (not the hub client's minute of retries), or the cached copy when there is one."""

from __future__ import annotations

import os
import socket
import time

import pytest

from auto_research.engine import sources
from auto_research.errors import UserError


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The hub's address is a local port nothing listens on (no network, simulated), its cache an empty folder."""
    from huggingface_hub import constants

    with socket.socket() as probe:  # bound and kept for the test, never listened on: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)  # restored after the test
        sources.hub_unreachable.cache_clear()
        yield port
        sources.hub_unreachable.cache_clear()


@pytest.mark.parametrize("name, expected", [
    ("smollm2-135m", "--model smollm2-135m: no such model folder, file or hub id; did you mean smollm2-135m-instruct? "
                     "(packaged models: smollm2-135m-instruct"),
    ("SmolLM2-135M-instruct", "did you mean smollm2-135m-instruct?"),
    ("./no/such/model", "--model ./no/such/model: no such model folder, file or hub id; packaged models: "
                        "smollm2-135m-instruct"),
])
def test_a_name_that_is_nothing_lists_the_packaged_models(name, expected):
    with pytest.raises(UserError) as error:
        sources.check_model_source(name, offline=False)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_hub_id_without_a_connection_is_one_line_at_once(no_hub, sums_jsonl, tmp_path, capsys):
    """Through the command line: exit 2 and the one line, long before the hub client's retries would have ended
    (over a minute measured without the probe; the bound here is generous)."""
    from auto_research.cli import main

    started = time.monotonic()
    code = main(["post-train", "--model", "nobody-here/no-such-model", "--dataset", str(sums_jsonl), "--steps", "1",
                 "--output-dir", str(tmp_path / "out")])
    assert time.monotonic() - started < 20
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0] == ("auto-research: error: --model nobody-here/no-such-model: not a local folder or in the hub's "
                        f"cache, and the model hub cannot be reached (127.0.0.1:{no_hub}: Connection refused); give "
                        "a local folder or a packaged model (smollm2-135m-instruct, smollm2-135m-instruct-tools)")
    assert not (tmp_path / "out").exists()


def test_a_cached_hub_id_reads_the_cache_when_the_hub_cannot_be_reached(no_hub, tmp_path, monkeypatch):
    """--offline (or HF_HUB_OFFLINE) with the model in the hub's cache is fine; so is no connection, and then the
    process reads the cache only (HF_HUB_OFFLINE for it and its children) instead of retrying the hub."""
    from huggingface_hub import constants

    with pytest.raises(UserError, match="hub ids need a connection \\(offline\\)"):
        sources.check_model_source("owner/model", offline=True)
    snapshot = tmp_path / "hub" / "models--owner--model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    sources.check_model_source("owner/model", offline=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test
    sources.check_model_source("owner/model", offline=False)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
