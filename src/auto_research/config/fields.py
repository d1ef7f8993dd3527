"""What every config dataclass is made of: fields that are also flags, the checks they share, and the checks of
a dataset's name (data/registry.py's). Light: no NumPy, no torch, so ``--help`` is fast.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import field
from pathlib import Path

from auto_research.data.registry import task_names, task_record
from auto_research.data.rows import DATA_FILE_KINDS, HUB_DATASET, IN_MEMORY, data_file_kinds
from auto_research.errors import UserError

CANDIDATE_DATASETS = task_names("candidate")
PREFERENCE_DATASETS = task_names("generation", "preference")
GENERATION_DATASETS = task_names("generation")
EMBEDDED_MODEL_DATASETS = task_names("generation", "embedded_model")
DATASETS = CANDIDATE_DATASETS + GENERATION_DATASETS

DATA_FILE_SUFFIXES = tuple(DATA_FILE_KINDS)

DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")

SECTIONS = {
    # a run's sections (config/generation.py SECTIONS), in --help's order
    "run": "the run: algorithm, length, run folder, evaluations and checkpoints",
    "data": "data",
    "policy": "the model and where it computes",
    "rewards": "rewards",
    "sampling": "sampling",
    "loss": "loss, KL and updates",
    "critic": "critic (ppo-rlhf)",
    "rollout": "the rollout engine",
    "turns": "multi-turn environments and tools",
    "optimisation": "optimisation",
    "lora": "LoRA",
    "logging": "logging and trackers",
    # the other commands' groups
    "common": "the run (both levels)",
    "environment": "multi-turn environments and tools",
    "scaling": "several processes (torchrun) and LoRA",
}


def setting(default, help: str, section: str | None = "common", flag: str | None = None, default_text: str | None = None,
            **argparse_options):
    """A config field that is also a command-line flag: its name, default and help are written once, here.

    ``section`` groups the flag in --help (None: no flag); ``default_text`` says what an unset (None) default
    means; ``argparse_options`` go to argparse. Mutable defaults are given as a zero-argument function.
    """
    metadata = {"help": help, "section": section, "flag": flag, "default_text": default_text,
                "options": argparse_options}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def default_dataset_dir() -> Path:
    """``$AUTO_RESEARCH_DATA`` when set, else ``data`` (the folder holding gsm8k/)."""
    return Path(os.environ.get("AUTO_RESEARCH_DATA") or "data")


def setting_fields(cls) -> list:
    """The settings of a config class: its fields, or every section's (``GenerationConfig.flat_fields``)."""
    from dataclasses import fields  # noqa: PLC0415

    return cls.flat_fields() if hasattr(cls, "flat_fields") else list(fields(cls))


def flagged_fields(cls, exclude=()) -> list:
    """The settings of ``cls`` that have a flag (a ``section``), less ``exclude``."""
    return [item for item in setting_fields(cls)
            if item.metadata.get("section") is not None and item.name not in exclude]


def help_group(cls, item) -> str | None:
    """The --help group of a setting: its section's (a run's settings), else its own metadata's."""
    return cls.section_of(item.name) if hasattr(cls, "section_of") else item.metadata.get("section")


def flag_of(item) -> str:
    """The command-line flag of a dataclass field made by ``setting``."""
    return item.metadata.get("flag") or "--" + item.name.replace("_", "-")


# --- checks every command shares --------------------------------------------------------------------


def check_positive_finite(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0, got {value}")


def check_non_negative_finite(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"{flag} must be a finite number >= 0, got {value}")


def check_positive_integers(*pairs) -> None:
    """(flag, value) pairs: each value None (unset) or a positive integer."""
    for flag, value in pairs:
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")


def check_non_negative_integers(*pairs) -> None:
    for flag, value in pairs:
        if value is not None and value < 0:
            raise UserError(f"{flag} must be >= 0, got {value}")


def check_device(device: str) -> None:
    if not DEVICE_PATTERN.fullmatch(device):
        raise UserError(f"--device {device!r}: choose auto, cpu, cuda, cuda:N or mps")


def check_choice(flag: str, value, allowed) -> None:
    if value is not None and value not in allowed:
        raise UserError(f"{flag} {value!r}: choose one of {', '.join(allowed)}")


def comma_floats(text: str) -> list[float]:
    try:
        return [float(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"--reward-weights takes comma-separated numbers such as 1,0.2; got {text!r}") from None


def comma_list(flag: str, text: str, kind=str, noun: str = "value") -> list:
    """``a,b,c`` → [a, b, c] of ``kind``; an empty list, a malformed item or a repeated one is one line."""
    items = [part.strip() for part in str(text).split(",") if part.strip()]
    if not items:
        raise UserError(f"{flag} is empty; give a comma-separated list such as "
                        f"{'42,43' if kind is int else '0.01,0.05' if kind is float else 'rloo,grpo'}")
    values = []
    for item in items:
        try:
            values.append(kind(item))
        except ValueError:
            what = ("integers such as 42,43,44" if kind is int else "numbers such as 0.01,0.05" if kind is float
                    else "names")
            raise UserError(f"{flag} takes comma-separated {what}; got {item!r}") from None
    if len(set(values)) != len(values):
        raise UserError(f"{flag} lists a {noun} twice: {text}")
    return values


# --- datasets by name ---------------------------------------------------------------------------------


def is_data_source(name: str) -> bool:
    """A file or folder of rows (or a hub dataset) rather than a named dataset."""
    folder = Path(name).expanduser()
    return (name.endswith(DATA_FILE_SUFFIXES) or name.startswith(HUB_DATASET)
            or (folder.is_dir() and ((folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists())))


def is_generation_dataset(name: str) -> bool:
    """The generation level's datasets: the named ones, data files and folders, rows in memory."""
    return task_record(name, "generation") is not None or is_data_source(name) or name.startswith(IN_MEMORY)


def looks_like_a_file(name: str) -> bool:
    return "/" in name or os.sep in name or Path(name).suffix != "" or Path(name).exists()


def _unknown_dataset(name: str, choices: tuple[str, ...]) -> UserError:
    if looks_like_a_file(name):
        return UserError(f"--dataset {name}: a data file must be "
                         f"{data_file_kinds().replace('.jsonl', '.jsonl (JSON Lines)')}, or a folder written by "
                         "datasets' save_to_disk")
    return UserError(f"unknown dataset {name!r}; choose one of: {', '.join(choices)}, or a .jsonl file")


def check_candidate_dataset(name: str) -> None:
    if is_generation_dataset(name):
        raise UserError(f"{name} is a generation-level dataset; 'compare' and --seeds run the candidate "
                        f"level ({', '.join(task_names('candidate'))})")
    if task_record(name, "candidate") is None:
        raise _unknown_dataset(name, task_names())


def check_generation_dataset(name: str) -> None:
    """One line for a dataset the generation level cannot take, saying what it can."""
    if is_generation_dataset(name):
        return
    if task_record(name, "candidate") is not None:
        raise UserError(f"{name} is a candidate-level dataset (no text to generate); the generation level takes "
                        f"{', '.join(task_names('generation'))} or a .jsonl file")
    raise _unknown_dataset(name, task_names("generation"))


def json_ready(payload: dict) -> dict:
    """A config's fields as JSON values (paths as text)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in payload.items()}
