"""Which rows of a batch go through the model together, in an update and in the no-grad passes: consecutive slices
(--micro-batch-size), or by tokens (--max-tokens-per-micro-batch, docs/generation-level.md). The loss is normalised
by the whole batch's counts, so any grouping gives the same gradient up to float rounding. Every rank runs as many
micro-batches as the rank needing most (under FSDP each forward is a collective).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from auto_research.engine.packing import packs_sequences, row_tokens
from auto_research.engine.rollout import Rollout
from auto_research.train.components import RunContext


def micro_batches(run: RunContext, rollout: Rollout, rows: slice, model) -> tuple[bool, list]:
    """Whether the parts are packed, and the parts of ``rows``: slices, or (n,) tensors of row indices."""
    size, budget = run.config.optimisation.micro_batch_size, run.config.optimisation.max_tokens_per_micro_batch
    if budget is None:
        size = size or (rows.stop - rows.start)
        return False, [slice(start, min(start + size, rows.stop)) for start in range(rows.start, rows.stop, size)]
    prompt_mask, completion_mask = rollout.prompt_mask[rows], rollout.completion_mask[rows]
    cap = size or prompt_mask.shape[0]
    pack = packs_sequences(model)
    if pack:
        bins = packed_bins(row_tokens(prompt_mask, completion_mask).tolist(), budget, cap)
    else:
        bins = sorted_buckets(prompt_mask.long().sum(1).tolist(), completion_mask.long().sum(1).tolist(), budget, cap)
    # (On the rollout's device: NCCL all-gathers CUDA tensors only.)
    bins = split_to(bins, int(run.world.gather(torch.tensor([len(bins)], device=prompt_mask.device)).max()))
    return pack, [torch.tensor(sorted(part), dtype=torch.long) + rows.start for part in bins]


def packed_bins(lengths: list[int], budget: int, cap: int) -> list[list[int]]:
    """First-fit decreasing: each row, longest first (ties by index), into the first micro-batch it fits in
    (tokens ≤ ``budget``, rows ≤ ``cap``), else a new one."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for index, load in enumerate(loads):
            if load + lengths[row] <= budget and len(bins[index]) < cap:
                bins[index].append(row)
                loads[index] += lengths[row]
                break
        else:
            bins.append([row])
            loads.append(lengths[row])
    return bins


def sorted_buckets(prompts: list[int], completions: list[int], budget: int, cap: int) -> list[list[int]]:
    """Rows sorted by length, longest first (ties by index), filling one padded bucket after another while
    rows × (longest prompt + longest completion) ≤ ``budget`` and rows ≤ ``cap``."""
    buckets: list[list[int]] = []
    widest = (0, 0)
    for row in sorted(range(len(prompts)), key=lambda i: (-(prompts[i] + completions[i]), i)):
        grown = (max(widest[0], prompts[row]), max(widest[1], completions[row]))
        if buckets and len(buckets[-1]) < cap and (len(buckets[-1]) + 1) * sum(grown) <= budget:
            buckets[-1].append(row)
            widest = grown
        else:
            buckets.append([row])
            widest = (prompts[row], completions[row])
    return buckets


def split_to(bins: list[list[int]], count: int) -> list[list[int]]:
    """``count`` micro-batches: the one with the most rows (the first of equals) halved until there are."""
    bins = [list(part) for part in bins]
    while len(bins) < count:
        index = max(range(len(bins)), key=lambda i: (len(bins[i]), -i))
        part = bins[index]
        if len(part) < 2:
            raise RuntimeError(f"{len(bins)} micro-batches of single rows cannot make the {count} another rank runs")
        bins[index:index + 1] = [part[:len(part) // 2], part[len(part) // 2:]]
    return bins


def rows_of(rollout: Rollout, part) -> Rollout:
    """The rows of ``part`` (a slice or row indices), trimmed to their own longest prompt and completion."""
    if isinstance(part, slice):
        return rollout.rows(part.start, part.stop, trim=True)
    pick = [int(index) for index in part]
    rows = rollout.sequences.shape[0]
    chosen = {}
    for field in fields(rollout):  # every per-row field, whatever fields a Rollout holds
        value = getattr(rollout, field.name)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            chosen[field.name] = value[part]
        elif isinstance(value, list) and len(value) == rows:
            chosen[field.name] = [value[index] for index in pick]
    return replace(rollout, **chosen).rows(0, len(pick), trim=True)
