"""Padding-free micro-batches: the rows of a micro-batch laid end to end in one row, with position ids that
restart at 0 at each sequence and no attention mask.

Transformers (4.5x and 5.x, ``masking_utils.find_packed_sequence_indices``) reads a restart of the position ids,
when no 2-D attention mask and no cache is given, as the start of another sequence, and builds the causal mask
block-diagonal: with sdpa and eager a dense (L, L) mask with one causal block per sequence, with
flash-attention the varlen kernel over the cumulative lengths. No sequence then attends to another, no token is
padding, and the positions are those of the padded forward (``logprobs.attention_for``), so log-probs, values and
gradients are the padded batch's up to float rounding. ``packs_sequences`` checks it on the model at hand once
(two short sequences, alone and packed); a model that fails the check gets length-sorted buckets instead
(``train/micro_batches.py``).

On the CPU's sdpa, attention over a packed row of L tokens costs L² (the blocks are masked, not skipped): fine
for the budgets a CPU trains with, where the MLPs and projections outweigh attention's scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """A micro-batch of B rows, ``[left-padded prompt | completion]``, as one row of L = Σ (prompt + completion)
    tokens, and where each counted completion token is predicted from in it."""

    input_ids: torch.Tensor
    """(1, L) every row's prompt tokens, then its completion tokens up to the last that counts."""
    position_ids: torch.Tensor
    """(1, L) 0 … length − 1 within each sequence."""
    predictors: torch.Tensor
    """(N,) for the counted completion tokens in row-major order (``completion_mask.bool()``), the index in the
    packed row of the token before each: its output predicts that token (or is that state's value)."""
    targets: torch.Tensor
    """(N,) those completion tokens."""


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


def _inner(model):
    """The model that holds the config under DDP, PEFT or a LoRA reference's wrapper."""
    inner = model
    for _ in range(8):
        if hasattr(inner, "config") and isinstance(inner, torch.nn.Module):
            return inner
        inner = next((getattr(inner, name) for name in ("module", "model", "base_model") if hasattr(inner, name)),
                     None)
        if inner is None:
            return None
    return None


def packs_sequences(model) -> bool:
    """Whether ``model`` keeps sequences packed in one row apart (position ids restarting, no attention mask):
    two short sequences, alone and packed, give the same outputs. Checked once per model class and attention
    implementation; every rank checks at the same point (under FSDP each forward is a collective)."""
    inner = _inner(model)
    if inner is None:
        return False
    key = (type(inner).__name__, getattr(inner.config, "_attn_implementation", None))
    if key not in _CHECKED:
        _CHECKED[key] = _check(model, inner)
    return _CHECKED[key]


def _check(model, inner) -> bool:
    vocabulary = int(getattr(inner.config, "vocab_size", 0) or 0)
    if vocabulary < 8:
        return False
    device = next(inner.parameters()).device
    first, second = torch.tensor([[3, 5, 7]], device=device), torch.tensor([[6, 4]], device=device)
    training = inner.training
    inner.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            alone = [model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=device)[None],
                           use_cache=False).logits.float() for ids in (first, second)]
            positions = torch.tensor([[0, 1, 2, 0, 1]], device=device)
            packed = model(input_ids=torch.cat([first, second], 1), position_ids=positions,
                           use_cache=False).logits.float()
    except (TypeError, ValueError, RuntimeError):
        return False
    finally:
        inner.train(training)
    expected = torch.cat(alone, dim=1)
    scale = float(expected.abs().max()) + 1e-6
    return packed.shape == expected.shape and float((packed - expected).abs().max()) <= 1e-3 * scale
