"""The main job starts from the same model on every machine: the package ships arithmetic-generate's warm start,
and every run records where it computed (issue 51)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from auto_research.cli import main
from auto_research.train import warm_start

TASK = "arithmetic-generate"
MEASURE = """
import json, torch
from auto_research.data.tasks import arithmetic_task
from auto_research.engine.models import load_policy
from auto_research.train.evaluation import greedy_accuracy
from auto_research.train.warm_start import shipped_path
torch.backends.mkldnn.enabled = False
model, tokenizer = load_policy(str(shipped_path("arithmetic-generate")), "cpu", None, offline=True)
print(json.dumps([torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                  greedy_accuracy(model, tokenizer, arithmetic_task())]))
"""


def test_the_main_job_starts_from_the_shipped_model_whatever_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTO_RESEARCH_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(warm_start, "build_warm_start", lambda *a, **k: pytest.fail("the shipped model was rebuilt"))
    from auto_research.data.tasks import arithmetic_task

    folder = warm_start.ensure_warm_started(arithmetic_task(), progress=False, log=lambda line: None)
    assert folder == warm_start.SHIPPED / f"{TASK}-qwen2-tiny-v{warm_start.RECIPE_VERSION}"
    assert (folder / "model.safetensors").stat().st_size < 2_000_000
    record = warm_start.warm_start_record(folder)
    assert record["warm_start"] == warm_start.WARM_START and record["recipe_version"] == warm_start.RECIPE_VERSION
    assert record["made_on"]["cpu"] and record["made_on"]["kernel_capability"]
    assert not (tmp_path / "empty-cache").exists()  # nothing trained, nothing written


def test_the_shipped_model_scores_what_it_recorded_under_other_kernels_too():
    """Greedy decoding of fixed weights flips a token only on a near-tie: the recorded held-out accuracy (made on one
    CPU) holds within 0.03 here at the default kernels and with AVX2 vector kernels, AVX2 MKL, oneDNN off and one
    thread."""
    recorded = warm_start.warm_start_record(warm_start.shipped_path(TASK))["history"][-1]["held_out_accuracy"]
    assert recorded == pytest.approx(0.712)
    from auto_research.data.tasks import arithmetic_task
    from auto_research.engine.models import load_policy
    from auto_research.train.evaluation import greedy_accuracy

    model, tokenizer = load_policy(str(warm_start.shipped_path(TASK)), "cpu", None, offline=True)
    here = greedy_accuracy(model, tokenizer, arithmetic_task())
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    capability, threads, capped = json.loads(done.stdout.strip().splitlines()[-1])
    assert (capability, threads) == ("AVX2", 1)  # the caps took effect
    assert abs(here - recorded) <= 0.03 and abs(capped - recorded) <= 0.03, (recorded, here, capped)


def test_metrics_and_report_record_the_machine(tmp_path):
    assert main(["post-train", "--dataset", TASK, "--steps", "1", "--prompts-per-step", "2", "--evaluation-examples",
                 "4", "--eval-every", "0", "--offline", "--no-progress", "--threads", "1",
                 "--output-dir", str(tmp_path)]) == 0
    run = next(tmp_path.iterdir())
    machine = json.loads((run / "metrics.json").read_text())["machine"]
    import torch

    assert machine["kernel_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["threads"] == 1 and machine["dtype"] == "float32" and machine["device"] == "cpu"
    assert machine["versions"]["torch"] == torch.__version__ and machine["versions"]["numpy"]
    assert machine["cpu"] and machine["cpu"] != "unknown"
    report = (run / "report.md").read_text()
    assert "## Machine" in report and f"- kernel capability: {machine['kernel_capability']}" in report


@pytest.mark.parametrize("schedule", [(), ("--max-staleness", "1")], ids=["synchronous", "in-flight-K1"])
def test_repeats_at_one_thread_are_identical_while_they_contend_for_the_cores(tmp_path, schedule):
    """The main job (shortened), synchronous and with a batch drawn in flight (K = 1, the rollout thread computing
    beside the trainer): three copies at --threads 1 started together, so that they contend for this machine's
    cores, give the same rows to the bit. Copies at two threads that contend for two cores can differ in the last
    bits from step 3: that is not promised (docs/benchmarks.md, "Repeats"), nor tested here, where the suite's
    other worker contends with any run."""
    command = [sys.executable, "-m", "auto_research", "post-train", "--dataset", TASK, "--steps", "30",
               "--eval-every", "0", "--evaluation-examples", "20", "--offline", "--no-progress", "--threads", "1",
               *schedule]
    contended = [subprocess.Popen([*command, "--output-dir", str(tmp_path / str(index))], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for index in range(3)]
    for run in contended:
        assert run.wait(timeout=900) == 0, run.stderr.read()[-2000:]
    rows = [_rows(tmp_path / str(index)) for index in range(3)]
    assert len(rows[0]) == 30 and rows[0][-1]["loss"] != rows[0][0]["loss"]
    assert rows[1] == rows[0] and rows[2] == rows[0]


def _rows(output) -> list[dict]:
    """A run's rows without its clocks."""
    clocks = ("seconds", "time_", "tokens_per_second")
    lines = (next(output.iterdir()) / "metrics.jsonl").read_text().splitlines()
    return [{key: value for key, value in json.loads(line).items() if not any(clock in key for clock in clocks)}
            for line in lines]
