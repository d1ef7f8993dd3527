"""Padding-free micro-batches: the rows of a micro-batch laid end to end in one row, with position ids that
restart at 0 at each sequence and no attention mask.

Transformers (``masking_utils.find_packed_sequence_indices``) reads a restart of the position ids, when no 2-D
attention mask and no cache is given, as another sequence's start and makes the causal mask block-diagonal. The
positions are the padded forward's (``logprobs.attention_for``), so log-probs, values and gradients are the padded
batch's up to float rounding. ``packs_sequences`` checks this once per model; one that fails gets length-sorted
buckets instead (``train/micro_batches.py``). On the CPU's sdpa a packed row of L tokens costs L² in attention (the
blocks are masked, not skipped): fine at a CPU's budgets, where the MLPs and projections outweigh it.

The grouped layout (``grouped_layout``) is the other padding-free form: one row a group, its prompt once and its K
completions after it, under an explicit block mask; ``takes_block_masks`` checks the model honours one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """B ``[left-padded prompt | completion]`` rows as one row of L = Σ (prompt + completion) tokens."""

    input_ids: torch.Tensor
    """(1, L) every row's prompt tokens, then its completion tokens up to the last that counts."""
    position_ids: torch.Tensor
    """(1, L) 0 … length − 1 within each sequence."""
    predictors: torch.Tensor
    """(N,) for the counted completion tokens in row-major order (``completion_mask.bool()``), the index in the
    packed row of the token before each: its output predicts that token (or is that state's value)."""
    targets: torch.Tensor
    """(N,) those completion tokens."""

    def inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}


def layout(sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Packed:
    """The packed row of ``[prompt | completion]`` rows (a prompt is its unmasked tokens, a completion its first
    ``completion_mask`` tokens: the masks of a Rollout)."""
    prompt_length = prompt_mask.shape[1]
    keep = torch.cat([prompt_mask.bool(), completion_mask.bool()], dim=1)
    counted = completion_mask.bool()
    if bool((counted.any(1) & ~prompt_mask.bool().any(1)).any()):
        raise ValueError("a completion without a prompt token cannot be packed (nothing predicts its first token)")
    positions = keep.long().cumsum(dim=1) - 1
    index = (keep.reshape(-1).long().cumsum(0) - 1).reshape(keep.shape)
    predictors = index[:, prompt_length:][counted] - 1
    return Packed(sequences[keep].unsqueeze(0), positions[keep].unsqueeze(0), predictors,
                  sequences[:, prompt_length:][counted])


def row_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) the tokens each row puts in a packed row: its prompt and its counted completion."""
    return prompt_mask.long().sum(1) + completion_mask.long().sum(1)


_CHECKED: dict = {}


def unwrapped(model, depth: int = 8):
    """``model``, then each model inside its wrappers (DDP, PEFT, a LoRA reference), outermost first."""
    for _ in range(depth):
        yield model
        model = next((getattr(model, name) for name in ("module", "model", "base_model") if hasattr(model, name)),
                     None)
        if model is None:
            return


def _inner(model):
    """The model that holds the config under DDP, PEFT or a LoRA reference's wrapper."""
    holders = (inner for inner in unwrapped(model) if isinstance(inner, torch.nn.Module))
    return next((inner for inner in holders if hasattr(inner, "config")), None)


def takes_block_masks(model) -> bool:
    """Whether ``model`` honours a (B, 1, L, L) boolean attention mask with its own position ids (sdpa and eager
    do; flash-attention does not): two completions of one prompt as one grouped row (``grouped_layout``) give
    the outputs of the two rows apart. Checked once per model class and attention implementation."""
    def compare(model, device):
        sequences = torch.tensor([[3, 5, 7, 0], [3, 5, 6, 4]], device=device)
        completion_mask = torch.tensor([[1, 0], [1, 1]], device=device)
        grouped = grouped_layout(sequences, torch.ones_like(completion_mask), completion_mask, 2)
        alone = [_logits_alone(model, ids[None], device)[0] for ids in (sequences[0, :3], sequences[1])]
        return model(**grouped.inputs(), use_cache=False).logits.float()[0], torch.cat([alone[0], alone[1][2:]])

    return _checked(model, "block mask", compare)


def packs_sequences(model) -> bool:
    """Whether ``model`` keeps sequences packed in one row apart (position ids restarting, no attention mask):
    two short sequences, alone and packed, give the same outputs. Checked once per model class and attention
    implementation; every rank checks at the same point (under FSDP each forward is a collective)."""
    def compare(model, device):
        first, second = torch.tensor([[3, 5, 7]], device=device), torch.tensor([[6, 4]], device=device)
        positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
        packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False)
        return packed.logits.float(), torch.cat([_logits_alone(model, ids, device) for ids in (first, second)], 1)

    return _checked(model, "packed", compare)


def _logits_alone(model, ids: torch.Tensor, device) -> torch.Tensor:
    positions = torch.arange(ids.shape[1], device=device)[None]
    return model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()


def _checked(model, layout_name: str, compare) -> bool:
    """Once per (layout, model class, attention implementation): ``compare(model, device)`` → (got, expected)
    logits, run in eval mode without gradient or autocast, must agree to 1e-3 of their scale."""
    inner = _inner(model)
    if inner is None:
        return False
    key = (layout_name, type(inner).__name__, getattr(inner.config, "_attn_implementation", None))
    if key in _CHECKED:
        return _CHECKED[key]
    agrees = False
    if int(getattr(inner.config, "vocab_size", 0) or 0) >= 8:
        device = next(inner.parameters()).device
        training = inner.training
        inner.eval()
        try:
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                got, expected = compare(model, device)
            scale = float(expected.abs().max()) + 1e-6
            agrees = got.shape == expected.shape and float((got - expected).abs().max()) <= 1e-3 * scale
        except (TypeError, ValueError, RuntimeError):
            agrees = False
        finally:
            inner.train(training)
    _CHECKED[key] = agrees
    return agrees


@dataclass(frozen=True)
class Grouped:
    """Whole groups of K rows that share their prompt, one row a group: the prompt once, then each completion, each
    seeing the prompt and its own earlier tokens only: K rows' positions and attention, no prompt computed K times
    (a group's row is padded at its right end to the longest group's)."""

    input_ids: torch.Tensor
    """(G, L) each group's prompt tokens, then its K completions' tokens up to the last that counts."""
    position_ids: torch.Tensor
    """(G, L) 0 … p − 1 over the prompt, then p … p + n − 1 for each completion of n tokens."""
    attention: torch.Tensor
    """(G, 1, L, L) bool, True where a query position attends to a key position."""
    predictors: torch.Tensor
    """(N,) as ``Packed.predictors``, indexing the flattened (G · L) rows."""
    targets: torch.Tensor
    """(N,) those completion tokens."""

    def inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": self.attention}


def whole_groups_with_one_prompt(sequences: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> bool:
    """Whether the rows are whole groups of ``group_size`` ≥ 2 whose rows each have the same prompt (the tokens and
    the mask of the first ``prompt_mask.shape[1]`` columns): what any sharing of a group's prompt needs."""
    rows = sequences.shape[0]
    if group_size < 2 or rows % group_size:
        return False
    prompts, masks = sequences[:, :prompt_mask.shape[1]], prompt_mask
    return bool(torch.equal(prompts, prompts[::group_size].repeat_interleave(group_size, dim=0))
                and torch.equal(masks, masks[::group_size].repeat_interleave(group_size, dim=0)))


def grouped_layout(sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                   group_size: int) -> Grouped | None:
    """The ``Grouped`` layout of ``[left-padded prompt | completion]`` rows in whole groups of ``group_size``
    with identical prompts, or None where it does not apply: rows that are not whole groups, prompts that differ
    within a group, or a completion mask that is not a prefix of its row (tokens counted after a gap)."""
    rows, prompt_length = sequences.shape[0], prompt_mask.shape[1]
    whole = whole_groups_with_one_prompt(sequences, prompt_mask, group_size)
    if not whole or not bool(prompt_mask.bool().any(1).all()):
        return None
    counted = completion_mask.bool()
    lengths = counted.long().sum(1)
    steps = torch.arange(counted.shape[1], device=counted.device)
    if not torch.equal(counted, steps[None] < lengths[:, None]):
        return None
    prompts, masks = sequences[:, :prompt_length], prompt_mask.bool()
    groups = rows // group_size
    prompt_lengths = masks[::group_size].long().sum(1)                                   # (G,)
    per_group = lengths.view(groups, group_size)
    width = int((prompt_lengths + per_group.sum(1)).max())
    device = sequences.device
    input_ids = torch.zeros(groups, width, dtype=sequences.dtype, device=device)
    positions = torch.zeros(groups, width, dtype=torch.long, device=device)
    segment = torch.full((groups, width), -1, dtype=torch.long, device=device)       # 0 prompt, k + 1 completion k
    predictors = []
    for g in range(groups):
        p = int(prompt_lengths[g])
        input_ids[g, :p] = prompts[g * group_size][masks[g * group_size]]
        positions[g, :p] = torch.arange(p, device=device)
        segment[g, :p] = 0
        start = p
        for k in range(group_size):
            row, n = g * group_size + k, int(per_group[g, k])
            input_ids[g, start:start + n] = sequences[row, prompt_length:prompt_length + n]
            positions[g, start:start + n] = torch.arange(p, p + n, device=device)
            segment[g, start:start + n] = k + 1
            if n:
                before = torch.arange(start - 1, start + n - 1, device=device)
                before[0] = p - 1  # the first completion token is predicted from the prompt's last
                predictors.append(before + g * width)
            start += n
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    attention = causal & (query != -1) & (key != -1) & ((key == 0) | (key == query))
    attention |= torch.eye(width, dtype=torch.bool, device=device)  # padding attends to itself: no empty row
    targets = sequences[:, prompt_length:][counted]
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return Grouped(input_ids, positions, attention[:, None], torch.cat(predictors) if predictors else empty, targets)
