"""The run folder and its checkpoints, as files: what is there, whether it verifies, whether a run may start or
resume there. Light (no torch): these checks run before anything heavy is loaded.

Layout: ``<run>/checkpoints/step-000100/`` holding the model (``save_pretrained``) and tokenizer,
``optimizer.safetensors`` + ``optimizer.json``, ``rng.safetensors``, ``trainer_state.json`` (step, config, NumPy
RNG state, algorithm state, evaluation history) and, written last, ``manifest.json`` (size and sha256 of every other
file, and a sha256 of that list). A checkpoint is staged and renamed into place (checkpoint.py), so a kill leaves
the previous checkpoint or the new one, never half of one; the manifest catches later damage (a truncated copy, a
bad disk, an edit), and ``--resume`` falls back to the newest checkpoint that verifies (``checkpoint_problem``).
The hashes carry no key: they catch damage, not a forger who can write the folder. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from auto_research.algorithms.registry import REGISTRY
from auto_research.engine.safetensors_header import safetensors_problem
from auto_research.errors import UserError, is_decimal
from auto_research.files import atomic_write_json, sha256_of
from auto_research.engine.trainer_state import saved_problem
from auto_research.user_code import resolved_settings

PREFIX = "step-"
MANIFEST = "manifest.json"
CORE = ("trainer_state.json", "rng.safetensors", "optimizer.safetensors", "optimizer.json")
"""The files every checkpoint holds, whatever the run (``required_files`` adds the rest)."""
# Settings a resumed run may change: the folder's handling, where it computes, how long it runs (the learning rate
# follows the new --steps), how often it evaluates and saves, where its figures go and what is shown; three that trade
# memory for time and change no number; max_rollout_mismatch (a run stopped by it may resume with another).
RESUMABLE_DIFFERENCES = {"resume", "overwrite", "progress", "device", "threads", "output_dir", "report_to",
                         "tracker_project", "log_completions", "offload_reference", "gradient_checkpointing",
                         "checkpoint_mlp", "steps", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every",
                         "max_rollout_mismatch", "verbose"}


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.name.startswith(PREFIX) and is_decimal(path.name[len(PREFIX):])
             and (path / "trainer_state.json").is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def _digest(files: dict) -> str:
    """The manifest's checksum of its own file list: an entry removed or edited by hand shows."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST)
    listed = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": sha256_of(path)} for path in files}
    atomic_write_json(folder / MANIFEST, {"files": listed, "sha256": _digest(listed)})


def _is_entry(name, entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
            and not Path(name).is_absolute() and ".." not in Path(name).parts)


def _listed_files(folder: Path) -> tuple[dict, str | None]:
    """The files the manifest lists (name → bytes and sha256), or why the manifest itself cannot be trusted."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}, f"{path} is missing (the checkpoint is incomplete)"
    except (OSError, ValueError) as error:
        return {}, f"{path} is unreadable ({error})"
    if isinstance(manifest, dict) and set(manifest) == {"files", "sha256"}:
        files = manifest["files"]
        if not isinstance(files, dict) or manifest["sha256"] != _digest(files):
            return {}, f"{path} does not match its own checksum (an entry was removed or edited)"
    else:
        files = manifest  # written before the manifest had a checksum of its own: checked by what must be there
    if not isinstance(files, dict) or not all(_is_entry(name, entry) for name, entry in files.items()):
        return {}, f"{path} is not a list of files with their sizes and sha256"
    return files, None


def _file_problem(folder: Path, files: dict) -> str | None:
    """A file on disk that the manifest does not list, or a listed one missing, cut short or changed."""
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        # Hidden names are a file manager's, never a checkpoint's (a staging folder lives beside, not inside).
        if path.is_file() and name != MANIFEST and not path.name.startswith(".") and name not in files:
            return f"{path} is not in {MANIFEST} (the manifest was edited, or the file added since)"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {expected['bytes']} were written (truncated?)"
        if sha256_of(path) != expected["sha256"]:
            return f"{path} does not match its checksum (corrupted)"
    return None


def required_files(state: dict) -> list[str]:
    """What a checkpoint with this trainer state must hold for --resume to load it: the loop's and optimizer's
    state, the weights (the adapter's with LoRA), the critic's for an algorithm with one, the batches in flight."""
    config = state["config"]
    weights = "adapter_model.safetensors" if config.get("lora_r") else "model.safetensors"
    needed = [*CORE, weights]
    if REGISTRY.get(config.get("algorithm")) is not None and REGISTRY[config["algorithm"]].needs_critic:
        needed += [f"critic/{name}" for name in ("model.safetensors", "optimizer.safetensors", "optimizer.json")]
    if state.get("in_flight") is not None:
        needed.append("in_flight.safetensors")
    return needed


def _content_problem(folder: Path, files: dict) -> str | None:
    """Whether the listed files hold what resuming reads: every required file, a trainer state of the right
    kinds for this step, safetensors headers that describe their files, JSON that parses."""
    for name in CORE:
        if name not in files:
            return f"{folder / name} is not in {MANIFEST} (the checkpoint is incomplete)"
    path = folder / "trainer_state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{path} is unreadable ({error})"
    problem = saved_problem(state, int(folder.name[len(PREFIX):]))
    if problem is not None:
        return f"{path}: {problem}"
    for name in required_files(state):
        if name not in files:
            return f"{folder / name} is not in {MANIFEST} (the checkpoint is incomplete)"
    for name in sorted(files):
        problem = (safetensors_problem(folder / name) if name.endswith(".safetensors")
                   else _json_problem(folder / name) if name.endswith(".json") else None)
        if problem is not None:
            return f"{folder / name} {problem}"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"is not readable JSON ({error})"
    return _optimizer_problem(payload) if path.name == "optimizer.json" else None


def _finite(value) -> bool:
    """Numbers finite, in lists too (AdamW's betas); anything else passes (a group's flags, names)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return all(_finite(item) for item in value) if isinstance(value, list) else True


def _optimizer_problem(plain) -> str | None:
    """The optimizer's plain state as ``checkpoint._optimizer_to_files`` writes it: loading takes its parameter
    groups' settings (a NaN weight decay would be trained with)."""
    groups = plain.get("param_groups") if isinstance(plain, dict) else None
    if not (isinstance(plain, dict) and isinstance(plain.get("state"), dict)
            and all(isinstance(values, dict) for values in plain["state"].values()) and isinstance(groups, list)
            and all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups)):
        return "is not an optimizer state (a mapping of states and a list of parameter groups)"
    for group in groups:
        for key, value in group.items():
            if not _finite(value):
                return f"gives a parameter group {key} = {value}"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted (naming the bad file), or None when it verifies: the
    manifest and its own checksum, every file on disk listed and matching, every file resuming needs there, and
    what those files hold readable as the kinds resuming expects."""
    files, problem = _listed_files(folder)
    return problem or _file_problem(folder, files) or _content_problem(folder, files)


def verified_checkpoint(run_dir: Path, log) -> Path:
    """The newest checkpoint whose files verify, with a warning for the newer ones that do not; with none, a
    UserError names the newest one's bad file."""
    found = checkpoint_dirs(run_dir)
    root = Path(run_dir) / "checkpoints"
    if root.exists() and not root.is_dir():
        raise UserError(f"--resume: {root} is a file, not a folder of checkpoints")
    if not found:
        hint = " (the run there stopped before its first checkpoint: start afresh with --overwrite)" \
            if run_outputs(run_dir) else ""
        raise UserError(f"--resume: no valid checkpoint in {root}{hint}")
    problems = []
    for folder in reversed(found):
        problem = checkpoint_problem(folder)
        if problem is None:
            if problems:
                log(f"warning: --resume skips {len(problems)} damaged checkpoint(s): {problems[0]}; "
                    f"resuming from {folder.name}")
            return folder
        problems.append(problem)
    raise UserError(f"--resume: no checkpoint in {root} verifies: {problems[0]}")


def differing_keys(saved: dict, current: dict) -> list[str]:
    """The settings (``to_json`` keys) in which a run's saved settings and this command's differ, beyond those a
    resumed run may change."""
    return [key for key in sorted(current)
            if key not in RESUMABLE_DIFFERENCES and key in saved and saved[key] != current[key]]


def differing_settings(saved: dict, current: dict) -> list[str]:
    """'key (was a, now b)' for each of ``differing_keys``."""
    return [f"{key} (was {saved.get(key)!r}, now {current[key]!r})" for key in differing_keys(saved, current)]


def _as_given(flag: str | None, key: str, value) -> str:
    """A saved setting as the flag that gives it (``--warmup-steps 2``), for the line that says how to resume."""
    if flag is None:
        return f"{key} {value!r}"
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return f"{flag} {value}"
    return f"{flag} as it was, {value!r}"


def saved_settings(folder: Path) -> dict:
    """A checkpoint's settings, flat (``GenerationConfig.to_json``), its user code as recorded since (user_code.py)."""
    config = json.loads((Path(folder) / "trainer_state.json").read_text())["config"]
    return {**config, **resolved_settings(config)}


def resumable_checkpoint(run_dir: Path, settings: dict, log, world_size: int = 1, keep=(), flags=None) -> Path:
    """The checkpoint ``--resume`` continues from in ``run_dir``, after checking that this command's flat settings
    are the saved ones but for ``RESUMABLE_DIFFERENCES`` and ``keep`` (derived: the saved values are kept), on as
    many processes as before (else not exact). ``flags`` maps a setting to its flag, for the line that says how."""
    folder = verified_checkpoint(run_dir, log)
    state = json.loads((folder / "trainer_state.json").read_text())
    saved = saved_settings(folder)
    settings = {**settings, **{key: saved[key] for key in keep if key in saved}}
    if state.get("world_size", 1) != world_size:
        raise UserError(f"--resume: the run in {run_dir} ran on {state.get('world_size', 1)} process(es), this "
                        f"command on {world_size}: gradients summed in another order would not continue it exactly; "
                        f"resume with the same number, or start a new run from the weights with --model {folder}")
    differing = differing_keys(saved, settings)
    if differing:
        raise UserError(f"--resume: the run in {run_dir} was started with different settings: "
                        f"{', '.join(differing_settings(saved, settings))}; resume with its own "
                        f"({', '.join(_as_given((flags or {}).get(key), key, saved[key]) for key in differing)}), "
                        "or start a new run (--overwrite, or another --run-name)")
    if settings["steps"] < state["step"]:
        raise UserError(f"--resume --steps {settings['steps']}: the run in {run_dir} has a checkpoint at step "
                        f"{state['step']} already (a run is not shortened below its last checkpoint): give --steps "
                        f"{state['step']} or more")
    return folder


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.json", "report.md", "curves.png", "tensorboard",
               "completions.jsonl")


def run_outputs(run_dir: Path) -> list[str]:
    """The names of RUN_OUTPUTS that hold something in ``run_dir`` (an empty file or folder holds nothing): an
    earlier run that a fresh one would overwrite, and what a failed run keeps rather than deleting its folder."""
    paths = {name: Path(run_dir) / name for name in RUN_OUTPUTS}
    return [name for name, path in paths.items()
            if (path.is_dir() and any(path.iterdir())) or (path.is_file() and path.stat().st_size > 0)]


def check_run_folder(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run where an earlier one is, unless --overwrite says so (else a command run again
    without --resume would delete the earlier run's checkpoints without a word)."""
    if resume or overwrite:
        return
    found = run_outputs(run_dir)
    if found:
        steps = checkpoint_dirs(run_dir)
        if not steps and "metrics.json" in found:  # finished, its checkpoints removed (compare --drop-checkpoints)
            raise UserError(f"{run_dir} holds a finished run without its checkpoints ({', '.join(found)}): "
                            "compare --resume reads it as it is; or start afresh with --overwrite (which deletes it)")
        if not steps:
            raise UserError(f"{run_dir} holds an earlier run that stopped before its first checkpoint "
                            f"({', '.join(found)}): start afresh with --overwrite (which deletes it)")
        raise UserError(f"{run_dir} holds an earlier run (checkpoints up to {steps[-1].name}): continue it "
                        "with --resume, or start afresh with --overwrite (which deletes it)")


def clear_run_folder(run_dir: Path) -> None:
    """Delete an earlier run's outputs (--overwrite), so none of them is taken for the new run's."""
    for name in RUN_OUTPUTS:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


