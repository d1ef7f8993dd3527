"""The run folder and its checkpoints, as files: what is there, whether it verifies, whether a run may
start or resume there. Light (no torch): these checks run before anything heavy is loaded.

Checkpoints: weights, optimizer, RNG states, step and config, written atomically (checkpoint.py).

Layout: ``<run>/checkpoints/step-000100/`` holding the model
(``save_pretrained``, safetensors) and tokenizer, ``optimizer.safetensors`` +
``optimizer.json`` (tensors and the rest of the optimizer state), ``rng.safetensors``
(torch generator states), ``trainer_state.json`` (step, config, NumPy RNG
state, algorithm state, evaluation history) and, written last,
``manifest.json`` (size and sha256 of every other file). A checkpoint is
staged in a temporary folder and renamed into place, so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one; the
manifest catches what happens to the files afterwards (a truncated copy, a bad
disk), and ``--resume`` falls back to the newest checkpoint that verifies.
Loading reads safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from auto_research.errors import UserError
from auto_research.files import atomic_write_json, sha256_of

PREFIX = "step-"
MANIFEST = "manifest.json"
# Settings that may differ between a run and its resumption (the last three trade memory for time and change no
# number: a run that ran out of memory may resume with them).
RESUMABLE_DIFFERENCES = {"resume", "overwrite", "progress", "device", "threads", "output_dir", "report_to",
                         "tracker_project", "log_completions", "offload_reference", "gradient_checkpointing",
                         "checkpoint_mlp", "verbose"}


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit()
             and (path / "trainer_state.json").is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def write_manifest(folder: Path) -> None:
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST)
    atomic_write_json(folder / MANIFEST, {str(path.relative_to(folder)): {"bytes": path.stat().st_size,
                                                                          "sha256": sha256_of(path)} for path in files})


def checkpoint_problem(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted (naming the bad file), or None when it verifies."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing (the checkpoint is incomplete)"
    except (OSError, ValueError) as error:
        return f"{folder / MANIFEST} is unreadable ({error})"
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {expected['bytes']} were written (truncated?)"
        if sha256_of(path) != expected["sha256"]:
            return f"{path} does not match its checksum (corrupted)"
    return None


def verified_checkpoint(run_dir: Path, log) -> Path:
    """The newest checkpoint whose files verify; a warning for each newer one that does not.

    With none that verifies, a UserError names the newest one's bad file.
    """
    found = checkpoint_dirs(run_dir)
    root = Path(run_dir) / "checkpoints"
    if root.exists() and not root.is_dir():
        raise UserError(f"--resume: {root} is a file, not a folder of checkpoints")
    if not found:
        raise UserError(f"--resume: no valid checkpoint in {root}")
    problems = []
    for folder in reversed(found):
        problem = checkpoint_problem(folder)
        if problem is None:
            if problems:
                log(f"warning: --resume skips {len(problems)} damaged checkpoint(s): {problems[0]}; "
                    f"resuming from {folder.name}")
            return folder
        problems.append(problem)
    raise UserError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'} verifies: {problems[0]}")


def resumable_checkpoint(config, log, world_size: int = 1) -> Path:
    """The checkpoint ``--resume`` continues from, after checking that the run's settings are unchanged
    and that it runs on as many processes as before (the only way the resumed run stays exact)."""
    folder = verified_checkpoint(config.run_dir, log)
    state = json.loads((folder / "trainer_state.json").read_text())
    saved = state["config"]
    if state.get("world_size", 1) != world_size:
        raise UserError(f"--resume: the run in {config.run_dir} ran on {state.get('world_size', 1)} process(es), this "
                        f"command on {world_size}: gradients summed in another order would not continue it exactly; "
                        f"resume with the same number, or start a new run from the weights with --model {folder}")
    current = config.to_json()
    differing = sorted(key for key in current if key not in RESUMABLE_DIFFERENCES and key in saved
                       and saved[key] != current[key])
    if differing:
        raise UserError(f"--resume: the run in {config.run_dir} was started with different settings: "
                        + ", ".join(f"{key} (was {saved.get(key)!r}, now {current[key]!r})" for key in differing))
    return folder


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.json", "report.md", "curves.png", "tensorboard",
               "completions.jsonl")


def check_run_folder(config) -> None:
    """Refuse to start a fresh run where an earlier one is, unless --overwrite says so.

    Without this, a command run again without --resume would delete the
    earlier run's checkpoints without a word.
    """
    if config.resume or config.overwrite:
        return
    found = [name for name in RUN_OUTPUTS if (config.run_dir / name).exists()]
    if found:
        steps = checkpoint_dirs(config.run_dir)
        held = f"checkpoints up to {steps[-1].name}" if steps else ", ".join(found)
        raise UserError(f"{config.run_dir} holds an earlier run ({held}): continue it with --resume, "
                        "or start afresh with --overwrite (which deletes it)")


def clear_run_folder(run_dir: Path) -> None:
    """Delete an earlier run's outputs (--overwrite), so none of them is taken for the new run's."""
    for name in RUN_OUTPUTS:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


