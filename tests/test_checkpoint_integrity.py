"""Checkpoints that cannot be trusted, full disks, failed runs, config files and --resume's changed settings
(issue 38, cases 3, 8, 11, 12 and 14; issue 37, item 4): each damaged checkpoint is skipped for the previous good
one with one line, and the resumed run ends where the uninterrupted one did; with none good, one line and exit 2."""

from __future__ import annotations

import errno
import json
import math
import shutil
import sys

import pytest

from auto_research.cli import main
from auto_research.engine import checkpoint
from auto_research.engine.run_folder import MANIFEST, checkpoint_problem, write_manifest

RUN = "rloo-sums-seed42"


def _args(model, data, output, *flags) -> list[str]:
    """A 3-step run with a checkpoint each step (flags given after win), at a constant learning rate (no warmup): a
    rate that does not depend on the total, so that a run extended by --resume --steps is one longer run."""
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "3", "--prompts-per-step", "2",
            "--max-new-tokens", "3", "--evaluation-examples", "4", "--eval-every", "0", "--checkpoint-every", "1",
            "--warmup-steps", "0", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(output), *flags]


def _weights(run_dir, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def _error_lines(capsys) -> list[str]:
    """stderr's lines that are not the run's log (a warning or the error), after checking it holds no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.strip().splitlines() if line.startswith(("auto-research:", "warning:"))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(6)))
    return path


@pytest.fixture(scope="module")
def finished(tiny_model_dir, data, tmp_path_factory):
    """A 3-step run's output folder (checkpoints 2 and 3 kept), made once; tests damage copies of it."""
    output = tmp_path_factory.mktemp("finished")
    assert main(_args(tiny_model_dir, data, output)) == 0
    return output


@pytest.fixture
def copy(finished, tmp_path):
    """A copy of the finished run's output folder, its run folder, and the checkpoints' folder."""
    output = tmp_path / "copy"
    shutil.copytree(finished, output)
    return output, output / RUN / "checkpoints"


# --- what verifying a checkpoint catches ---------------------------------------------------------------------


def _flip_a_float(folder) -> None:
    """One float of the weights changed, the file's size kept (the tensor data follows the header)."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def _empty_manifest_and_flip(folder) -> None:
    (folder / MANIFEST).write_text("{}")
    _flip_a_float(folder)


def _drop_entry(folder) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["optimizer.json"]
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _garbage_header(folder) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\x00garbage" + data[16:])
    write_manifest(folder)  # consistent: the manifest alone would pass it


def _state(folder, **changes) -> None:
    path = folder / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    write_manifest(folder)


DAMAGE = {
    "emptied manifest, a float changed": (_empty_manifest_and_flip, "is not in manifest.json (the manifest was edited"),
    "an entry removed": (_drop_entry, "manifest.json does not match its own checksum"),
    "a garbage header, manifest consistent": (_garbage_header, "model.safetensors has a safetensors header that is "
                                                               "not JSON"),
    "step NaN": (lambda folder: _state(folder, step=math.nan), "trainer_state.json: 'step' is NaN, not a step number"),
}


@pytest.mark.parametrize("damage, message", DAMAGE.values(), ids=list(DAMAGE))
def test_a_damaged_checkpoint_is_skipped_and_the_resumed_run_ends_as_the_whole_one(tiny_model_dir, data, finished,
                                                                                  copy, capsys, damage, message):
    output, checkpoints = copy
    damage(checkpoints / "step-000003")
    assert message in checkpoint_problem(checkpoints / "step-000003")
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, output, "--resume")) == 0
    lines = _error_lines(capsys)
    skipped = [line for line in lines if "--resume skips" in line]
    assert len(skipped) == 1 and message in skipped[0] and skipped[0].endswith("resuming from step-000002"), lines
    assert checkpoint_problem(checkpoints / "step-000003") is None  # step 3 done again, and written whole
    assert _largest_difference(_weights(output / RUN, 3), _weights(finished / RUN, 3)) == 0.0


@pytest.mark.parametrize("damage, message", [
    # An entry removed and the manifest's own checksum made to agree: the file on disk it no longer lists shows.
    (lambda folder: (_drop_entry(folder), _rechecksum(folder)), "optimizer.json is not in manifest.json"),
    # A file the checkpoint needs removed, with its entry, consistently: what must be there is known apart.
    (lambda folder: ((folder / "rng.safetensors").unlink(), write_manifest(folder)),
     "rng.safetensors is not in manifest.json (the checkpoint is incomplete)"),
    (lambda folder: ((folder / "model.safetensors").unlink(), write_manifest(folder)),
     "model.safetensors is not in manifest.json (the checkpoint is incomplete)"),
    (lambda folder: _state(folder, updates="3"), "'updates' is \"3\", not a count"),
    (lambda folder: _state(folder, step=2), "holds step 2, and its folder is step 3"),
    (lambda folder: _state(folder, numpy_rng={"bit_generator": "PCG64"}), "'numpy_rng' is"),
    (lambda folder: _state(folder, totals={"seconds": math.inf}), "'totals' is"),
    (lambda folder: ((folder / "optimizer.json").write_text("{"), write_manifest(folder)), "optimizer.json is not readable JSON"),
    (lambda folder: _json(folder / "optimizer.json", lambda plain: plain["param_groups"][0].update(weight_decay=math.nan)),
     "optimizer.json gives a parameter group weight_decay = nan"),
    (lambda folder: _json(folder / "optimizer.json", lambda plain: plain.update(param_groups=5)),
     "optimizer.json is not an optimizer state"),
    # The data cut short behind a header that still promises it all.
    (lambda folder: ((folder / "optimizer.safetensors").write_bytes((folder / "optimizer.safetensors").read_bytes()
                                                                    [:-4]), write_manifest(folder)),
     "optimizer.safetensors holds"),
    (lambda folder: ((folder / "stray.bin").write_bytes(b"x")), "stray.bin is not in manifest.json"),
])
def test_verifying_names_what_is_wrong(copy, damage, message):
    _, checkpoints = copy
    assert checkpoint_problem(checkpoints / "step-000003") is None
    damage(checkpoints / "step-000003")
    problem = checkpoint_problem(checkpoints / "step-000003")
    assert problem is not None and message in problem, problem


def _json(path, change) -> None:
    """A JSON file of a checkpoint changed in place, and the manifest written again to agree."""
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))
    write_manifest(path.parent)


def _rechecksum(folder) -> None:
    from auto_research.engine.run_folder import _digest

    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["sha256"] = _digest(manifest["files"])
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_from_before_its_own_checksum_still_verifies(copy):
    _, checkpoints = copy
    folder = checkpoints / "step-000003"
    (folder / MANIFEST).write_text(json.dumps(json.loads((folder / MANIFEST).read_text())["files"]))
    assert checkpoint_problem(folder) is None


def test_with_no_good_checkpoint_resume_is_one_line(tiny_model_dir, data, copy, capsys):
    output, checkpoints = copy
    _garbage_header(checkpoints / "step-000002")
    _state(checkpoints / "step-000003", step=math.nan)
    assert main(_args(tiny_model_dir, data, output, "--resume")) == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("auto-research: error: --resume: no checkpoint in")
    assert "step-000003/trainer_state.json: 'step' is NaN" in lines[0]


# --- a full disk, a failed run --------------------------------------------------------------------------------


def test_a_full_disk_mid_checkpoint_is_one_line_and_the_run_resumes_exactly(tiny_model_dir, data, finished, tmp_path,
                                                                            monkeypatch, capsys):
    from safetensors import SafetensorError

    real, calls = checkpoint.save_file, []

    def full_at_the_third_checkpoint(tensors, path, *args, **kwargs):
        calls.append(path)  # two files a checkpoint: the optimizer's tensors, then the random states
        if len(calls) == 5:  # safetensors' own words for ENOSPC
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", full_at_the_third_checkpoint)
    assert main(_args(tiny_model_dir, data, tmp_path)) == 2
    lines = _error_lines(capsys)
    run_dir = tmp_path / RUN
    assert len(lines) == 1 and lines[0] == (
        f"auto-research: error: cannot write to {run_dir}: No space left on device (errno {errno.ENOSPC}); the last "
        f"good checkpoint is {run_dir / 'checkpoints' / 'step-000002'}")
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert all(checkpoint_problem(run_dir / "checkpoints" / name) is None for name in ("step-000001", "step-000002"))
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert main(_args(tiny_model_dir, data, tmp_path, "--resume")) == 0
    assert _largest_difference(_weights(run_dir, 3), _weights(finished / RUN, 3)) == 0.0


def test_a_safetensors_write_error_is_the_oserror_it_wraps():
    from safetensors import SafetensorError

    error = checkpoint._as_os_error(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    assert (error.errno, error.strerror) == (errno.EFBIG, "File too large")
    assert checkpoint._as_os_error(SafetensorError("odd")).errno == errno.EIO


INTERRUPTS = '''
calls = 0

def interrupt_on_call(n):
    def reward(prompts, completions, rows):
        global calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt  # a second Ctrl-C: stops at once, saving nothing
        return [float(len(c)) for c in completions]
    return reward

at_step_2 = interrupt_on_call(3)   # call 1: the evaluation before training; 2: step 1; 3: step 2
before_anything = interrupt_on_call(1)
'''


def test_a_failed_run_keeps_a_folder_that_holds_metrics(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    (tmp_path / "interrupts.py").write_text(INTERRUPTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("interrupts", None)
    # No checkpoint before step 100: at step 2 the folder holds step 1's metrics and nothing resumable.
    assert main(_args(tiny_model_dir, data, tmp_path / "out", "--reward", "interrupts:at_step_2",
                      "--checkpoint-every", "100")) == 130
    run_dir = tmp_path / "out" / RUN
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run_dir / "checkpoints").exists()
    # Started again, it is named as an earlier run, and --resume says there is nothing to resume.
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, tmp_path / "out")) == 2
    assert "holds an earlier run that stopped before its first checkpoint (metrics.jsonl" in capsys.readouterr().err
    assert main(_args(tiny_model_dir, data, tmp_path / "out", "--resume")) == 2
    assert "stopped before its first checkpoint: start afresh with --overwrite" in capsys.readouterr().err
    # A run stopped before it wrote anything still leaves no folder.
    sys.modules.pop("interrupts", None)
    assert main(_args(tiny_model_dir, data, tmp_path / "none", "--reward", "interrupts:before_anything")) == 130
    assert not (tmp_path / "none").exists()


# --- config files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, message", [
    ("run.yaml", b"steps: 2\nseed: 1\nsteps: 900\n", "'steps' is given twice (lines 1 and 3); keep one"),
    ("run.yaml", b"learning_rate: 0.1\nlearning-rate: 0.2\n",
     "'learning_rate' and 'learning-rate' both set learning-rate (lines 1 and 2); keep one"),
    ("run.yaml", b"report-to: {a: 1, a: 2}\n", "'a' is given twice (line 1); keep one"),
    ("run.json", b'{"steps": 2,\n "steps": 900}\n', "'steps' is given twice (lines 1 and 2); keep one"),
    ("run.json", b'{"learning_rate": 0.1,\n "learning-rate": 0.2}\n',
     "'learning_rate' and 'learning-rate' both set learning-rate (lines 1 and 2); keep one"),
    ("run.yaml", b"steps: 2\n# caf\xe9\n", "not UTF-8 text (byte 0xe9 on line 2); save it as UTF-8"),
    ("run.json", b'{"steps": "\xff"}', "not UTF-8 text (byte 0xff on line 1); save it as UTF-8"),
])
def test_a_config_file_with_a_repeated_key_or_not_utf8_is_one_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["post-train", "--config", str(path), "--output-dir", str(tmp_path / "runs")]) == 2
    assert _error_lines(capsys) == [f"auto-research: error: --config {path}: {message}"]
    assert not (tmp_path / "runs").exists()


def test_a_config_file_may_start_with_a_byte_order_mark_and_use_yaml_merges(tmp_path):
    from auto_research.config.files import read_config_file
    from auto_research.config.generation import GenerationConfig

    path = tmp_path / "run.yaml"
    path.write_bytes("\ufeff<<: {steps: 3, seed: 5}\nsteps: 2\n".encode())  # the merged steps overridden
    assert read_config_file(path, [GenerationConfig]) == {"steps": 2, "seed": 5}


# --- --resume with settings that do not change what the run is --------------------------------------------------


def test_resume_extends_a_finished_run_to_the_weights_of_one_longer_run(tiny_model_dir, data, finished, copy, tmp_path,
                                                                       capsys):
    assert main(_args(tiny_model_dir, data, tmp_path / "five", "--steps", "5")) == 0
    output, _ = copy  # the finished 3-step run, extended, with the other settings a resumption may change changed too
    capsys.readouterr()
    assert main(_args(tiny_model_dir, data, output, "--steps", "5", "--resume", "--eval-every", "2",
                      "--checkpoint-every", "2", "--keep-checkpoints", "3", "--log-completions", "2")) == 0
    assert f"resumed from {output / RUN / 'checkpoints' / 'step-000003'} (step 3)" in capsys.readouterr().err
    assert _largest_difference(_weights(output / RUN, 5), _weights(tmp_path / "five" / RUN, 5)) <= 1e-6
    rows = [json.loads(line) for line in (output / RUN / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert json.loads((output / RUN / "metrics.json").read_text())["training"]["steps"] == 5
    assert "steps: 5\n" in (output / RUN / "config.yaml").read_text()
    assert sorted(path.name for path in (output / RUN / "checkpoints").iterdir()) == [
        "step-000003", "step-000004", "step-000005"]  # every 2 steps and at the end, 3 kept
    # Below the last checkpoint: one line; any other setting changed: refused as before.
    assert main(_args(tiny_model_dir, data, output, "--steps", "4", "--resume")) == 2
    assert _error_lines(capsys) == [f"auto-research: error: --resume --steps 4: the run in {output / RUN} has a "
                                    "checkpoint at step 5 already (a run is not shortened below its last checkpoint): "
                                    "give --steps 5 or more"]
    assert main(_args(tiny_model_dir, data, output, "--steps", "5", "--resume", "--temperature", "0.5")) == 2
    assert "started with different settings: temperature (was 1.0, now 0.5)" in capsys.readouterr().err


def test_a_schedule_over_the_total_follows_the_new_total_from_the_resumed_step(tiny_model_dir, data, tmp_path):
    cosine = ("--lr-schedule", "cosine", "--warmup-steps", "1", "--learning-rate", "1e-3")
    assert main(_args(tiny_model_dir, data, tmp_path, *cosine, "--steps", "2")) == 0
    assert main(_args(tiny_model_dir, data, tmp_path, *cosine, "--steps", "5", "--resume")) == 0
    rates = [json.loads(line)["learning_rate"] for line in (tmp_path / RUN / "metrics.jsonl").read_text().splitlines()]
    # Step 1 warms up; step 2 starts the decay over 2 - 1 updates; from step 3 on it decays over 5 - 1, as a 5-step
    # run would: at update u (step u + 1), progress (u - 1) / 4.
    assert rates == pytest.approx([1e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 4)), 5e-4,
                                   1e-3 * 0.5 * (1 + math.cos(3 * math.pi / 4))], rel=1e-12)
