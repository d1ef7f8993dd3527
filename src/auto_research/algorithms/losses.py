"""Policy losses (per-token terms, registered by name), PPO's value loss, and the one aggregation function.

Shapes as in ``estimators.py``: (B, T) per-token terms over B completions of T tokens, ``mask`` 1 on
the tokens that count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str):
    def decorate(function):
        POLICY_LOSSES[name] = function
        return function

    return decorate


@dataclass(frozen=True)
class LossInputs:
    logprobs: torch.Tensor
    """(B, T) log π of the sampled tokens, with gradient."""
    old_logprobs: torch.Tensor
    """(B, T) log π of the policy that sampled (detached)."""
    advantages: torch.Tensor
    """(B, T), detached."""
    mask: torch.Tensor
    clip_range: float = 0.2


@register_policy_loss("vanilla")
def vanilla_loss(inputs: LossInputs) -> torch.Tensor:
    """−A_t · log π(y_t): REINFORCE; summed over a completion it is −A_i · log π(y_i | x)."""
    return -inputs.advantages * inputs.logprobs * inputs.mask


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_range, 1.0 + clip_range) * advantages
    return -torch.minimum(unclipped, clipped)


@register_policy_loss("clipped-token")
def clipped_token(inputs: LossInputs) -> torch.Tensor:
    """PPO's clipped surrogate with a ratio per token, ρ_t = π(y_t)/π_old(y_t) (PPO, GRPO, TRL)."""
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    return _clipped(ratio, inputs.advantages, inputs.clip_range) * inputs.mask


@register_policy_loss("clipped-sequence")
def clipped_sequence(inputs: LossInputs) -> torch.Tensor:
    """The clipped surrogate with one ratio per completion, ρ_i = π(y_i|x)/π_old(y_i|x)
    (the candidate level's form; GSPO-style). The term sits on the last token."""
    log_ratio = ((inputs.logprobs - inputs.old_logprobs) * inputs.mask).sum(-1, keepdim=True)
    advantage = (inputs.advantages * inputs.mask).sum(-1, keepdim=True) / inputs.mask.sum(-1, keepdim=True).clamp(min=1)
    per_sequence = _clipped(torch.exp(log_ratio), advantage, inputs.clip_range)
    return per_sequence * last_token(inputs.mask)


def policy_loss_name(policy_loss: str, ratio_level: str, several_updates: bool) -> str:
    """The registered loss a step uses: the record's, clipped whenever a batch serves several updates."""
    return f"clipped-{ratio_level}" if policy_loss == "clipped" or several_updates else "vanilla"


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) one-hot on each row's last completion token."""
    lengths = mask.sum(-1).long()
    onehot = torch.zeros_like(mask)
    rows = lengths > 0
    onehot[rows, (lengths[rows] - 1)] = 1.0
    return onehot


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, −c, c): PPO's value loss per token."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())


AGGREGATIONS = ("sequence", "token-mean", "sequence-mean-token-mean")


def aggregate(terms: torch.Tensor, mask: torch.Tensor, mode: str, sequences: float, tokens: float,
              groups: float, per_group_sum: bool = False) -> torch.Tensor:
    """One scalar from per-token loss terms, normalised by the *global* counts given.

    The counts are those of the whole batch (all micro-batches, later all
    processes), so that summing the shares of micro-batches gives the batch's
    loss exactly. ``sequence``: Σ over tokens and completions / completions (the
    paper: each completion is one action; ``per_group_sum`` divides by groups
    instead, RAFT's sum over the best-of-K); ``token-mean``: / all tokens;
    ``sequence-mean-token-mean``: each completion's token mean, averaged.
    """
    if mode == "sequence":
        return (terms * mask).sum() / (groups if per_group_sum else sequences)
    if mode == "token-mean":
        return (terms * mask).sum() / tokens
    if mode == "sequence-mean-token-mean":
        return ((terms * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / sequences
    raise ValueError(f"unknown aggregation {mode!r}")
