"""Checkpoints: weights, optimizer, RNG states, step and config, written atomically.

Layout: ``<run>/checkpoints/step-000100/`` holding the model
(``save_pretrained``, safetensors) and tokenizer, ``optimizer.safetensors`` +
``optimizer.json`` (tensors and the rest of the optimizer state), ``rng.safetensors``
(torch generator states) and ``trainer_state.json`` (step, config, NumPy RNG
state, algorithm state, evaluation history). A checkpoint is staged in a
temporary folder and renamed into place, so a kill at any moment leaves either
the previous checkpoint or the new one, never half of one. Loading reads
safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from auto_research.errors import UserError
from auto_research.files import atomic_write_json

PREFIX = "step-"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if path.name.startswith(PREFIX) and path.name[len(PREFIX):].isdigit()
             and (path / "trainer_state.json").is_file()]
    return sorted(found, key=lambda path: int(path.name[len(PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path:
    found = checkpoint_dirs(run_dir)
    if not found:
        raise UserError(f"--resume: no valid checkpoint in {Path(run_dir) / 'checkpoints'}")
    return found[-1]


def capture_rng(numpy_rng) -> dict:
    """Every random state a step consumes: torch (CPU and CUDA) and the prompt sampler's."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{index}"] = cuda_state
    return {"tensors": state, "numpy": numpy_rng.bit_generator.state}


def restore_rng(captured: dict, numpy_rng) -> None:
    torch.set_rng_state(captured["tensors"]["torch"])
    cuda = [captured["tensors"][key] for key in sorted(captured["tensors"]) if key.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    numpy_rng.bit_generator.state = captured["numpy"]


def _optimizer_to_files(optimizer) -> tuple[dict, dict]:
    """Split the optimizer state into tensors (safetensors) and plain values (JSON)."""
    state_dict = optimizer.state_dict()
    tensors, plain_state = {}, {}
    for parameter, values in state_dict["state"].items():
        plain_state[str(parameter)] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{parameter}.{key}"] = value.detach().cpu().contiguous()
            else:
                plain_state[str(parameter)][key] = value
    return tensors, {"state": plain_state, "param_groups": state_dict["param_groups"]}


def _optimizer_from_files(tensors: dict, plain: dict) -> dict:
    state = {}
    for parameter, values in plain["state"].items():
        state[int(parameter)] = dict(values)
    for name, tensor in tensors.items():
        parameter, key = name.split(".", 1)
        state.setdefault(int(parameter), {})[key] = tensor
    return {"state": state, "param_groups": plain["param_groups"]}


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, rng: dict, trainer_state: dict, keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{PREFIX}{step:06d}"
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        tensors, plain = _optimizer_to_files(optimizer)
        save_file(tensors, str(staging / "optimizer.safetensors"))
        atomic_write_json(staging / "optimizer.json", plain)
        save_file({key: value.contiguous() for key, value in rng["tensors"].items()}, str(staging / "rng.safetensors"))
        atomic_write_json(staging / "trainer_state.json", {**trainer_state, "step": step, "numpy_rng": rng["numpy"]})
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


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, dict]:
    """Load weights and optimizer state in place; return (trainer_state, rng)."""
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing means a different model.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"--resume: checkpoint {path} does not match the model ({len(missing)} missing, {len(unexpected)} unexpected tensors)")
    optimizer.load_state_dict(_optimizer_from_files(load_file(str(path / "optimizer.safetensors")),
                                                    json.loads((path / "optimizer.json").read_text())))
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng = {"tensors": load_file(str(path / "rng.safetensors")), "numpy": trainer_state["numpy_rng"]}
    return trainer_state, rng
