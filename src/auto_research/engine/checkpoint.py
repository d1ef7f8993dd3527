"""Writing and reading checkpoints (layout and guarantees: run_folder.py): weights by ``save_pretrained``,
the optimizer state by parameter name in safetensors and JSON, RNG states, and the trainer's state,
staged in a temporary folder and renamed into place. Nothing is unpickled on load."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from auto_research.engine.run_folder import PREFIX, checkpoint_dirs, write_manifest
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, make_tree_shareable


def capture_rng(numpy_rng) -> dict:
    """Every random state a step consumes: torch (CPU and CUDA) and the prompt sampler's."""
    cuda = enumerate(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    state = {"torch": torch.get_rng_state(), **{f"cuda{index}": cuda_state for index, cuda_state in cuda}}
    return {"tensors": state, "numpy": numpy_rng.bit_generator.state}


def restore_rng(captured: dict, numpy_rng) -> None:
    torch.set_rng_state(captured["tensors"]["torch"])
    cuda = [captured["tensors"][key] for key in sorted(captured["tensors"]) if key.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    numpy_rng.bit_generator.state = captured["numpy"]


def _optimizer_to_files(state_dict: dict) -> tuple[dict, dict]:
    """Split an optimizer state keyed by parameter name into tensors (safetensors) and plain values (JSON)."""
    state = state_dict["state"]
    tensors = {f"{parameter}/{key}": value.detach().cpu().contiguous() for parameter, values in state.items()
               for key, value in values.items() if isinstance(value, torch.Tensor)}
    plain_state = {str(parameter): {key: value for key, value in values.items() if not isinstance(value, torch.Tensor)}
                   for parameter, values in state.items()}
    return tensors, {"keys": "names", "state": plain_state, "param_groups": state_dict["param_groups"]}


def _optimizer_from_files(tensors: dict, plain: dict) -> dict:
    """The optimizer state as saved: keyed by parameter name (or, from checkpoints before names, by index)."""
    by_name = plain.get("keys") == "names"
    separator = "/" if by_name else "."
    key_of = str if by_name else int
    state = {key_of(parameter): dict(values) for parameter, values in plain["state"].items()}
    for name, tensor in tensors.items():
        parameter, key = name.rsplit(separator, 1) if by_name else name.split(separator, 1)
        state.setdefault(key_of(parameter), {})[key] = tensor
    return {"state": state, "param_groups": plain["param_groups"]}


def _save_model(model, folder: Path, state: dict | None, optimizer_state: dict) -> None:
    extra = {} if state is None else {"state_dict": state}  # FSDP: the gathered whole weights
    if hasattr(model, "peft_config"):  # LoRA: the trained adapter only (not the frozen reference copy)
        extra["selected_adapters"] = ["default"]
    model.save_pretrained(folder, safe_serialization=True, **extra)
    tensors, plain = _optimizer_to_files(optimizer_state)
    save_file(tensors, str(folder / "optimizer.safetensors"))
    atomic_write_json(folder / "optimizer.json", plain)


def _put_in_place(staging: Path, target: Path) -> None:
    """Rename the staged checkpoint into place (over an earlier one of the same step: a resumed run's)."""
    if target.exists():
        trash = target.parent / f".{target.name}.old"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(target, trash)
        os.replace(staging, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, target)


def _as_os_error(error: SafetensorError) -> OSError:
    """safetensors' failed write (a full disk: "I/O error: No space left on device (os error 28)") as the
    OSError it wraps, so the loop answers it like any failed write: one line, the last good checkpoint named."""
    found = re.search(r"(?:I/O error: )?([^:]*?) \(os error (\d+)\)", str(error))
    if found is None:
        return OSError(errno.EIO, f"safetensors could not write ({error})")
    return OSError(int(found.group(2)), found.group(1).strip())


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer_state: dict, rng: dict, trainer_state: dict,
                    keep: int, critic=None, critic_optimizer_state: dict | None = None, model_state: dict | None = None,
                    critic_state: dict | None = None, in_flight: tuple[dict, list] | None = None) -> Path:
    """Write one checkpoint (rank 0 only). ``model_state``: the whole weights when the model holds
    shards (FSDP); ``optimizer_state``: the whole optimizer state keyed by parameter name; ``in_flight``: the
    batches drawn ahead of the trainer (--max-staleness ≥ 1), as tensors and plain values."""
    root = Path(run_dir) / "checkpoints"
    if root.exists() and not root.is_dir():
        raise UserError(f"{root} is not a folder any more (something replaced it while the run was live): stopped "
                        "without writing; no checkpoint of this run is left there")
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{PREFIX}{step:06d}"
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}."))
    try:
        try:  # every file into the staging folder, the manifest last
            _save_model(model, staging, model_state, optimizer_state)
            tokenizer.save_pretrained(staging)
            if critic is not None:
                (staging / "critic").mkdir()
                _save_model(critic, staging / "critic", critic_state, critic_optimizer_state)
            rng_tensors = {key: value.contiguous() for key, value in rng["tensors"].items()}
            save_file(rng_tensors, str(staging / "rng.safetensors"))
            extra = {}
            if in_flight is not None:
                save_file(in_flight[0], str(staging / IN_FLIGHT))
                extra = {"in_flight": in_flight[1]}
            atomic_write_json(staging / "trainer_state.json",
                              {**trainer_state, "step": step, "numpy_rng": rng["numpy"], **extra})
            write_manifest(staging)
            make_tree_shareable(staging)
        except SafetensorError as error:
            raise _as_os_error(error) from None
        _put_in_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


IN_FLIGHT = "in_flight.safetensors"


def _load(path: Path) -> dict:
    """A checkpoint's tensors. The header was checked when the checkpoint was verified; a file changed since
    then is one line, not safetensors' traceback."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise UserError(f"--resume: cannot read {path} ({error}); it changed after the checkpoint was verified") from None


def read_in_flight(folder: Path) -> tuple[dict, list] | None:
    """The batches in flight a checkpoint holds (tensors, plain values), None when it holds none."""
    plain = json.loads((folder / "trainer_state.json").read_text()).get("in_flight")
    return None if plain is None else (_load(folder / IN_FLIGHT), plain)


def load_weights(folder: Path, model) -> None:
    """The checkpoint's weights into a whole (not yet wrapped or sharded) model."""
    weights = _load(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; anything else missing means a different model.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise UserError(f"--resume: checkpoint {folder} does not match the model ({len(missing)} missing, {len(unexpected)} unexpected tensors)")


def read_optimizer_state(folder: Path) -> dict:
    return _optimizer_from_files(_load(folder / "optimizer.safetensors"),
                                 json.loads((folder / "optimizer.json").read_text()))


def read_trainer_state(path: Path) -> tuple[dict, dict]:
    """(trainer_state, rng) of a checkpoint."""
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    rng = {"tensors": _load(path / "rng.safetensors"), "numpy": trainer_state["numpy_rng"]}
    return trainer_state, rng
