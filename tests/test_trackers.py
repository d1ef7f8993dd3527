"""--report-to (issue 17): every tracker, offline, gets the scalars of metrics.jsonl, the run's config and the
completion tables; it is read back from each tracker's own store. Bad names and missing extras are one line."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import struct
import subprocess
import sys

import pytest

from auto_research.cli import main


def _wandb_records(path):
    """The records of a wandb offline run file (a LevelDB-style log of 32 KiB blocks holding protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pieces, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:  # the padding at a block's end
            position += left
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def _history(records) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            by_step.setdefault(int(items.get("_step", record.history.step.num)), {}).update(items)
    return by_step


def test_every_tracker_gets_the_scalars_the_config_and_the_completion_tables(tiny_model_dir, sums_jsonl, tmp_path,
                                                                            monkeypatch):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wbc"),
           "WANDB_CACHE_DIR": str(tmp_path / "wbcache"), "TRACKIO_DIR": str(tmp_path / "trackio"),
           "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    env.pop("WANDB_PROJECT", None)
    args = [sys.executable, "-m", "auto_research", "post-train", "--model", str(tiny_model_dir), "--dataset",
            str(sums_jsonl), "--steps", "4", "--prompts-per-step", "2", "--max-new-tokens", "3", "--evaluation-examples",
            "4", "--eval-every", "2", "--log-completions", "2", "--offline", "--no-progress", "--seed", "5",
            "--report-to", "tensorboard,wandb,trackio,mlflow", "--tracker-project", "demo", "--output-dir",
            str(tmp_path / "runs")]
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "rloo-sums-seed5"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    evaluations = json.loads((run_dir / "metrics.json").read_text())["history"]
    rewards = {row["step"]: row["reward_mean"] for row in rows}
    assert sorted(rewards) == [1, 2, 3, 4] and [row["step"] for row in completions] == [0, 0, 2, 2, 4, 4]
    accuracy = {int(row["step"]): row["accuracy"] for row in evaluations}
    ids = json.loads((run_dir / "trackers.json").read_text())

    # TensorBoard: the event file under the run folder.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/reward_mean")} == pytest.approx(rewards, abs=1e-6)
    assert {e.step: e.value for e in events.Scalars("eval/accuracy")} == pytest.approx({0: events.Scalars(
        "eval/accuracy")[0].value, **accuracy}, abs=1e-6)
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("eval/completions/text_summary")}
    assert sorted(texts) == [0, 2, 4] and completions[-1]["prompt"] in texts[4]
    assert '"seed": 5' in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()

    # wandb: the offline run file, record by record.
    [run_file] = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _wandb_records(run_file)
    [run] = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "demo" and run.display_name == "rloo-sums-seed5" and run.run_id == ids["id"]
    assert config["seed"] == 5 and config["algorithm"] == "rloo" and config["steps"] == 4
    history = _history(records)
    assert {step: history[step]["train/reward_mean"] for step in rewards} == pytest.approx(rewards, abs=1e-9)
    assert {step: history[step]["eval/accuracy"] for step in accuracy} == pytest.approx(accuracy, abs=1e-9)
    tables = sorted(run_file.parent.glob("files/media/table/eval/completions_*.table.json"))
    assert len(tables) == 3
    last = json.loads(max(tables, key=lambda path: int(path.name.split("_")[1])).read_text())
    columns = last["columns"]
    assert [dict(zip(columns, row)) for row in last["data"]] == [
        {key: value for key, value in row.items() if key != "step"} for row in completions[-2:]]

    # trackio: its local SQLite store.
    store = sqlite3.connect(tmp_path / "trackio" / "demo.db")
    logged = [(step, json.loads(blob)) for step, blob in store.execute("SELECT step, metrics FROM metrics")]
    trackio_rewards = {step: metrics["train/reward_mean"] for step, metrics in logged if "train/reward_mean" in metrics}
    assert trackio_rewards == pytest.approx(rewards, abs=1e-9)
    table_steps = [step for step, metrics in logged if "eval/completions" in metrics]
    assert table_steps == [0, 2, 4]
    [(name, trackio_config)] = list(store.execute("SELECT run_name, config FROM configs"))
    assert name == f"rloo-sums-seed5-{ids['id']}" and json.loads(trackio_config)["seed"] == 5

    # MLflow: the file store, through its client.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    mlflow_run = client.get_run(ids["mlflow"])
    assert mlflow_run.info.run_name == "rloo-sums-seed5" and mlflow_run.info.status == "FINISHED"
    assert json.loads(mlflow_run.data.params["seed"]) == 5
    history = {metric.step: metric.value for metric in client.get_metric_history(ids["mlflow"], "train/reward_mean")}
    assert history == pytest.approx(rewards, abs=1e-9)
    artifacts = [item.path for item in client.list_artifacts(ids["mlflow"], "completions")]
    assert artifacts == ["completions/step_000000.json", "completions/step_000002.json",
                         "completions/step_000004.json"]


@pytest.mark.parametrize("value, message", [
    ("wandbb", "--report-to: unknown tracker 'wandbb' (did you mean wandb?); choose none or a comma-separated list "
               "of tensorboard, wandb, trackio, mlflow"),
    ("tensorboard,none", "--report-to: none cannot be listed with a tracker"),
])
def test_an_unknown_tracker_is_one_line(value, message, tiny_model_dir, sums_jsonl, tmp_path, capsys):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--report-to", value,
                 "--offline", "--output-dir", str(tmp_path / "runs")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"auto-research: error: {message}"]
    assert not (tmp_path / "runs").exists()


def test_a_missing_extra_says_how_to_install_it(tiny_model_dir, sums_jsonl, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--report-to",
                 "tensorboard,trackio", "--offline", "--output-dir", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err.strip() == ("auto-research: error: --report-to trackio needs the trackio package: "
                                               "pip install 'auto-research[trackio]' (or pip install trackio)")


def test_an_mlflow_store_that_mlflow_refuses_is_refused_before_the_run(tiny_model_dir, sums_jsonl, tmp_path, capsys,
                                                                       monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--report-to", "mlflow",
                 "--offline", "--output-dir", str(tmp_path / "runs")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1
    assert error.startswith("auto-research: error: --report-to mlflow: MLflow cannot open its tracking store (")
    assert "MLFLOW_TRACKING_URI" in error and not (tmp_path / "runs").exists()


def test_a_resumed_run_continues_its_tracker_runs_and_a_fresh_one_starts_new_ones(tmp_path):
    from auto_research.report.trackers import Trackers

    first = Trackers(("tensorboard",), tmp_path, "demo", {"seed": 1}, resumed=False)
    first.scalars({"train/loss": 1.0}, 1)
    first.close()
    saved = json.loads((tmp_path / "trackers.json").read_text())
    again = Trackers(("tensorboard",), tmp_path, "demo", {"seed": 1}, resumed=True)
    again.close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == saved
    fresh = Trackers(("tensorboard",), tmp_path, "demo", {"seed": 1}, resumed=False)
    fresh.close()
    assert json.loads((tmp_path / "trackers.json").read_text())["id"] != saved["id"]


def test_a_tracker_that_fails_mid_run_is_reported_once_and_dropped(tmp_path):
    from auto_research.report.trackers import Trackers

    warnings = []
    trackers = Trackers(("tensorboard",), tmp_path, "demo", {}, resumed=False, warn=warnings.append)
    trackers.open["tensorboard"].writer.close()
    trackers.open["tensorboard"].scalars = lambda values, step: 1 / 0
    trackers.scalars({"train/loss": 1.0}, 1)
    trackers.scalars({"train/loss": 0.5}, 2)
    assert warnings == ["warning: --report-to tensorboard failed (ZeroDivisionError: division by zero); it gets nothing "
                        "more this run (metrics.jsonl has every figure)"]
    assert trackers.open == {}
