"""What a process knows of its launch before torch is imported: its rank, the number of processes, the settings
that depend on that number, and the CPUs a rollout process may take (``--rollout-cores``). Light, so that a setting
torchrun cannot honour fails at once, and so that both the settings (config/) and the engine may import it."""

from __future__ import annotations

import os

from auto_research.errors import UserError, is_decimal


def environment_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def environment_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def check_world(fsdp: bool, prompts_per_step: int, mini_batches: int, size: int | None = None) -> None:
    """The settings that depend on the number of processes (``size``, else the launch's): FSDP, and a step's prompts
    in whole groups on every rank of every mini-batch; no torch needed."""
    size = environment_world_size() if size is None else size
    if fsdp and size < 2:
        raise UserError("--fsdp shards the models over several processes: launch with "
                        "torchrun --nproc-per-node N -m auto_research post-train … (N >= 2)")
    parts = size * mini_batches
    if prompts_per_step % parts:
        raise UserError(f"--prompts-per-step {prompts_per_step} must be a multiple of the number of processes "
                        f"({size}) times --ppo-mini-batches ({mini_batches}): each rank takes whole groups "
                        "of every mini-batch")


def parse_cores(text: str | None, available: set[int]) -> set[int]:
    """``--rollout-cores``: a comma list of CPU numbers or ranges (``1``, ``2-3``, ``0,4``); None: the last core."""
    if text is None:
        if len(available) < 2:
            raise UserError(f"--rollout-mode process needs two CPUs, the rollout process's and the trainer's, and this "
                            f"process may run on CPU {min(available)} only (use --rollout-mode colocate)")
        return {max(available)}
    cores: set[int] = set()
    for part in str(text).split(","):
        first, _, last = part.strip().partition("-")
        if not is_decimal(first) or (last and not is_decimal(last)):
            raise UserError(f"--rollout-cores {text!r}: expected CPU numbers or ranges, e.g. 1 or 2-3")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores <= available:
        raise UserError(f"--rollout-cores {text!r}: this process may run on CPUs {sorted(available)} only")
    if cores == available:
        raise UserError(f"--rollout-cores {text!r} takes every CPU this process may use; leave the trainer one")
    return cores
