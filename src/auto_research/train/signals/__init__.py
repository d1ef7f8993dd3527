"""Training signals that ask something outside the trainer once a batch, on the rollout side (a teacher's
log-probs, ``teacher.py``). Each module of this package registers one in ``OUTSIDE`` under its stream's name; a new
one is its module here, its name in ``algorithms/registry.py``'s ``SIGNALS`` (and the records that take it) and its
setting in its section (docs/architecture.md, "The training signal").

    build(section, loading)      -> what it scores with (a model, a client), or a falsy value: the run has none
    score(run, held, rollout, examples) -> RowScores    # the rollout side, once a batch; kept in a checkpoint
    signal(run, models, rollout, scores, log π_old, log π_ref) -> (B, T) or None   # as experience.SIGNAL_SOURCES
    figures(run, experience, advantages) -> dict       # its own metrics, every step
    held(held) -> {label: model}                       # the models it loaded, for report.md's parameter counts
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class RowScores:
    """One batch's values from outside: ``values`` (B, T) (0 on a row left unscored), ``failures`` (B,) why a row is
    unscored (None where scored) and ``counts`` {metric name: count}, summed over every rank into the step's row."""

    values: torch.Tensor
    failures: list
    counts: dict

    @property
    def scored(self) -> torch.Tensor:
        return torch.tensor([failure is None for failure in self.failures])


@dataclass(frozen=True)
class Loading:
    """What a signal's ``build`` may load its models with."""

    offline: bool
    device: str
    compute_dtype: torch.dtype
    world: object
    tokenizer: object
    log: Callable


@dataclass(frozen=True)
class OutsideSignal:
    section: str
    """The run config's section its ``build`` reads."""
    build: Callable
    score: Callable
    signal: Callable
    figures: Callable
    held: Callable


OUTSIDE: dict[str, OutsideSignal] = {}


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
