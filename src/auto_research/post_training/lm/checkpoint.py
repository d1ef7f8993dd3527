"""Checkpoints: weights, optimizer, RNG states, step and config, written atomically.

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

torch is imported inside the functions that need it, so that the run-folder
checks (an earlier run, a checkpoint to resume) run before it is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from auto_research.errors import UserError
from auto_research.files import atomic_write_json, make_tree_shareable

PREFIX = "step-"
MANIFEST = "manifest.json"
# Settings that may differ between a run and its resumption.
RESUMABLE_DIFFERENCES = {"resume", "overwrite", "progress", "device", "threads", "output_dir", "report_to"}


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit()
             and (path / "trainer_state.json").is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != MANIFEST)
    atomic_write_json(folder / MANIFEST, {str(path.relative_to(folder)): {"bytes": path.stat().st_size,
                                                                          "sha256": _sha256(path)} for path in files})


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
        if _sha256(path) != expected["sha256"]:
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


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "metrics.json", "report.md", "curves.png", "tensorboard")


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


def capture_rng(numpy_rng) -> dict:
    """Every random state a step consumes: torch (CPU and CUDA) and the prompt sampler's."""
    import torch

    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{index}"] = cuda_state
    return {"tensors": state, "numpy": numpy_rng.bit_generator.state}


def restore_rng(captured: dict, numpy_rng) -> None:
    import torch

    torch.set_rng_state(captured["tensors"]["torch"])
    cuda = [captured["tensors"][key] for key in sorted(captured["tensors"]) if key.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    numpy_rng.bit_generator.state = captured["numpy"]


def _optimizer_to_files(state_dict: dict) -> tuple[dict, dict]:
    """Split an optimizer state keyed by parameter name into tensors (safetensors) and plain values (JSON)."""
    import torch

    tensors, plain_state = {}, {}
    for parameter, values in state_dict["state"].items():
        plain_state[str(parameter)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{parameter}/{key}"] = value.detach().cpu().contiguous()
            else:
                plain_state[str(parameter)][key] = value
    return tensors, {"keys": "names", "state": plain_state, "param_groups": state_dict["param_groups"]}


def _optimizer_from_files(tensors: dict, plain: dict) -> dict:
    """The optimizer state as saved: keyed by parameter name (or, from checkpoints before names, by index)."""
    by_name = plain.get("keys") == "names"
    separator = "/" if by_name else "."
    key_of = str if by_name else int
    state = {}
    for parameter, values in plain["state"].items():
        state[key_of(parameter)] = dict(values)
    for name, tensor in tensors.items():
        parameter, key = name.rsplit(separator, 1) if by_name else name.split(separator, 1)
        state.setdefault(key_of(parameter), {})[key] = tensor
    return {"state": state, "param_groups": plain["param_groups"]}


def _save_model(model, folder: Path, state: dict | None, optimizer_state: dict) -> None:
    from safetensors.torch import save_file

    if hasattr(model, "peft_config"):  # LoRA: the trained adapter only (not the frozen reference copy)
        extra = {} if state is None else {"state_dict": state}  # FSDP: the gathered whole weights
        model.save_pretrained(folder, safe_serialization=True, selected_adapters=["default"], **extra)
    elif state is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, state_dict=state)
    tensors, plain = _optimizer_to_files(optimizer_state)
    save_file(tensors, str(folder / "optimizer.safetensors"))
    atomic_write_json(folder / "optimizer.json", plain)


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, rng: dict, trainer_state: dict,
                    keep: int, critic=None, critic_optimizer_state: dict | None = None, model_state: dict | None = None,
                    critic_state: dict | None = None) -> Path:
    """Write one checkpoint (rank 0 only). ``model_state``: the whole weights when the model holds
    shards (FSDP); ``optimizer_state``: the whole optimizer state keyed by parameter name."""
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is not a folder any more (something replaced it while the run was live): stopped "
                        "without writing; no checkpoint of this run is left there")
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{PREFIX}{step:06d}"
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
    try:
        _save_model(model, staging, model_state, optimizer_state)
        tokenizer.save_pretrained(staging)
        if critic is not None:
            (staging / "critic").mkdir()
            _save_model(critic, staging / "critic", critic_state, critic_optimizer_state)
        save_file({key: value.contiguous() for key, value in rng["tensors"].items()}, str(staging / "rng.safetensors"))
        atomic_write_json(staging / "trainer_state.json", {**trainer_state, "step": step, "numpy_rng": rng["numpy"]})
        write_manifest(staging)
        make_tree_shareable(staging)
        if target.exists():
            trash = root / f".{target.name}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(target, trash)
            os.replace(staging, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_weights(folder: Path, model) -> None:
    """The checkpoint's weights into a whole (not yet wrapped or sharded) model."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing means a different model.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"--resume: checkpoint {folder} does not match the model ({len(missing)} missing, {len(unexpected)} unexpected tensors)")


def read_optimizer_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    return _optimizer_from_files(load_file(str(folder / "optimizer.safetensors")),
                                 json.loads((folder / "optimizer.json").read_text()))


def read_trainer_state(path: Path) -> tuple[dict, dict]:
    """(trainer_state, rng) of a checkpoint."""
    from safetensors.torch import load_file

    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng = {"tensors": load_file(str(path / "rng.safetensors")), "numpy": trainer_state["numpy_rng"]}
    return trainer_state, rng
