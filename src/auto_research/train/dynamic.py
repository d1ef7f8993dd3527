"""Dynamic sampling (DAPO's, Yu et al. 2025, §3.2; docs/algorithms.md): a group whose K scores are all equal is
dropped and its slot refilled with a fresh prompt, up to ``--max-refills`` times. Slot j's refill r draws from a
generator seeded by (seed, step, j, r), so the batch is the same on any number of processes and the main prompt
generator (a checkpoint's state) is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REFILL_WARNING = 4
"""Refills per slot in one step beyond which the run warns once (the default --max-refills never passes it)."""

REFILL_SEED_OFFSET = 1_000_003
"""Refill r of slot j samples with ``prompt_seed(seed, step, OFFSET·r + j)``: apart from every dataset index."""


def has_signal(scores: list) -> bool:
    """A group's K scores (None where unscored) carry signal when at least two scored values differ."""
    values = [value for value in scores if value is not None]
    return len(values) >= 2 and max(values) != min(values)


def refill_index(seed: int, step: int, slot: int, refill: int, prompts: int) -> int:
    """The dataset index slot ``slot`` tries at its ``refill``-th refill of step ``step``."""
    return int(np.random.default_rng([seed, step, slot, refill]).integers(prompts))


@dataclass(frozen=True)
class Filled:
    """Which group fills each of this rank's slots, and the step's counts on this rank."""

    chosen: list[tuple[int, int]]
    """(round, position in that round's batch) of each slot's group, in slot order."""
    groups_sampled: int
    no_signal_sampled: int
    refills: int
    trained_no_signal: int


def fill(slots: list[int], first_scores: list[list], sample_round, max_refills: int, draw_index) -> Filled:
    """Fill every slot with a group that has signal, if one turns up within ``max_refills`` refills.
    ``first_scores[i]``: slot ``slots[i]``'s K scores; ``draw_index(slot, r)``: the index it tries at refill r;
    ``sample_round(r, [(slot, index), ...])`` samples and scores those prompts, returning their groups' scores."""
    chosen = [(0, position) for position in range(len(slots))]
    waiting = [position for position, scores in enumerate(first_scores) if not has_signal(scores)]
    groups, no_signal, refills = len(slots), len(waiting), 0
    for refill in range(1, max_refills + 1):
        if not waiting:
            break
        tries = [(slots[position], draw_index(slots[position], refill)) for position in waiting]
        scores = sample_round(refill, tries)
        groups, refills = groups + len(tries), refills + len(tries)
        still = []
        for order, (position, group) in enumerate(zip(waiting, scores)):
            if has_signal(group):
                chosen[position] = (refill, order)
            else:
                no_signal += 1
                still.append(position)
        waiting = still
    return Filled(chosen, groups, no_signal, refills, len(waiting))
