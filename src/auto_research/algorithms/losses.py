"""Policy losses (per-token terms) and loss aggregations, each registered by name, and PPO's value loss. Shapes as
in ``estimators.py``: (B, T) terms over B completions of T tokens, ``mask`` 1 on the tokens that count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from auto_research.algorithms.registry import AGGREGATIONS
from auto_research.algorithms.registry import POLICY_LOSSES as REGISTERED_NAMES

POLICY_LOSSES: dict[str, Callable] = {}
"""name → function(LossInputs) → (B, T) per-token loss terms; the names are ``registry.POLICY_LOSSES``."""
RATIOS: dict[str, Callable] = {}
"""name → function(LossInputs) → (B, T) the ratio the loss clips, per token (for the clip fraction)."""


def register_policy_loss(name: str, ratio: Callable | None = None):
    if name not in REGISTERED_NAMES:
        raise ValueError(f"policy loss {name!r} is not listed in algorithms/registry.py's POLICY_LOSSES")

    def decorate(function):
        POLICY_LOSSES[name] = function
        if ratio is not None:
            RATIOS[name] = ratio
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
    clip_low: float = 0.2
    """ε_low: ratios are clipped below at 1 − ε_low."""
    clip_high: float = 0.2
    """ε_high: ratios are clipped above at 1 + ε_high (DAPO's clip-higher when larger than ε_low)."""


@register_policy_loss("vanilla")
def vanilla_loss(inputs: LossInputs) -> torch.Tensor:
    """−A_t · log π(y_t): REINFORCE; summed over a completion it is −A_i · log π(y_i | x)."""
    return -inputs.advantages * inputs.logprobs * inputs.mask


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """−min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A): PPO's pessimistic surrogate, negated."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * advantages
    return -torch.minimum(unclipped, clipped)


def token_ratio(inputs: LossInputs) -> torch.Tensor:
    """ρ_t = π(y_t)/π_old(y_t)."""
    return torch.exp(inputs.logprobs - inputs.old_logprobs)


def _sequence_log_ratio(inputs: LossInputs) -> torch.Tensor:
    return ((inputs.logprobs - inputs.old_logprobs) * inputs.mask).sum(-1, keepdim=True)


def sequence_ratio(inputs: LossInputs) -> torch.Tensor:
    """ρ_i = π(y_i|x)/π_old(y_i|x) = exp(Σ_t log ρ_t), on every token of completion i."""
    return torch.exp(_sequence_log_ratio(inputs)).expand_as(inputs.mask)


def length_normalised_ratio(inputs: LossInputs) -> torch.Tensor:
    """GSPO's s_i = (π(y_i|x)/π_old(y_i|x))^(1/|y_i|) = exp(mean_t log ρ_t), on every token of completion i."""
    lengths = inputs.mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.exp(_sequence_log_ratio(inputs) / lengths).expand_as(inputs.mask)


@register_policy_loss("clipped-token", ratio=token_ratio)
def clipped_token(inputs: LossInputs) -> torch.Tensor:
    """PPO's clipped surrogate with a ratio per token, ρ_t = π(y_t)/π_old(y_t) (PPO, GRPO, DAPO, TRL)."""
    return _clipped(token_ratio(inputs), inputs.advantages, inputs.clip_low, inputs.clip_high) * inputs.mask


@register_policy_loss("clipped-sequence", ratio=sequence_ratio)
def clipped_sequence(inputs: LossInputs) -> torch.Tensor:
    """The clipped surrogate of one ratio per completion, ρ_i = π(y_i|x)/π_old(y_i|x), on its last token."""
    advantage = (inputs.advantages * inputs.mask).sum(-1, keepdim=True) / inputs.mask.sum(-1, keepdim=True).clamp(min=1)
    per_sequence = _clipped(torch.exp(_sequence_log_ratio(inputs)), advantage, inputs.clip_low, inputs.clip_high)
    return per_sequence * last_token(inputs.mask)


@register_policy_loss("gspo", ratio=length_normalised_ratio)
def gspo(inputs: LossInputs) -> torch.Tensor:
    """GSPO (Zheng et al., 2025): −min(s_i A, clip(s_i, 1 − ε_low, 1 + ε_high) A), written per token as GSPO-token
    does: s_i,t = sg(s_i)·π(y_t)/sg(π(y_t)) has the value s_i (the clip decision is the sequence's) and the gradient
    s_i ∇log π(y_t); its sequence-mean-token-mean is GSPO's gradient."""
    s = length_normalised_ratio(inputs).detach()
    per_token = s * torch.exp(inputs.logprobs - inputs.logprobs.detach())
    return _clipped(per_token, inputs.advantages, inputs.clip_low, inputs.clip_high) * inputs.mask


@register_policy_loss("cispo", ratio=token_ratio)
def cispo(inputs: LossInputs) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025): −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · log π(y_t): a token whose ratio left
    the range keeps its gradient, scaled by the clipped weight (PPO's surrogate gives it none)."""
    weight = token_ratio(inputs).detach().clamp(1.0 - inputs.clip_low, 1.0 + inputs.clip_high)
    return -weight * inputs.advantages * inputs.logprobs * inputs.mask


def clip_fraction(name: str, inputs: LossInputs) -> torch.Tensor:
    """(B, T) 1 on the tokens whose ratio (the one ``name`` clips) is outside its clip range."""
    if name not in RATIOS:
        return torch.zeros_like(inputs.mask)
    ratio = RATIOS[name](inputs).detach()
    outside = (ratio < 1.0 - inputs.clip_low) | (ratio > 1.0 + inputs.clip_high)
    return outside.to(inputs.mask.dtype) * inputs.mask


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) one-hot on the last position each row's mask keeps (a multi-turn mask has gaps)."""
    onehot = torch.zeros_like(mask)
    if not mask.shape[-1]:
        return onehot
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    rows = last >= 0
    onehot[rows, last[rows]] = 1.0
    return onehot


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """½·max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, −c, c): PPO's value loss per token."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())


@dataclass(frozen=True)
class Counts:
    """The whole batch's counts an aggregation divides by (all micro-batches, later all processes)."""
    sequences: float
    tokens: float
    groups: float
    per_group_sum: bool = False
    """The record's reduction is a sum within each group (RAFT's best of K): divide by groups, not completions."""
    max_tokens: float | None = None
    """The completion length limit (--max-new-tokens), for the constant normaliser."""


AGGREGATORS: dict[str, Callable] = {}
"""name → function(masked terms (B, T), mask (B, T), Counts) → the scalar; the names are ``registry.AGGREGATIONS``."""


def register_aggregation(name: str):
    if name not in AGGREGATIONS:
        raise ValueError(f"aggregation {name!r} is not listed in algorithms/registry.py's AGGREGATIONS")

    def decorate(function):
        AGGREGATORS[name] = function
        return function

    return decorate


@register_aggregation("sequence")
def sequence_sum(terms: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """Σ over tokens and completions / completions (each one action); / groups for a per-group sum."""
    return terms.sum() / (counts.groups if counts.per_group_sum else counts.sequences)


@register_aggregation("token-mean")
def token_mean(terms: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """/ all tokens of the batch (DAPO)."""
    return terms.sum() / counts.tokens


@register_aggregation("sequence-mean-token-mean")
def sequence_mean_token_mean(terms: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """Each completion's token mean, averaged over completions (GRPO's paper, GSPO)."""
    return (terms.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / counts.sequences


@register_aggregation("constant")
def constant(terms: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """/ (completions × ``max_tokens``): Dr. GRPO's constant normaliser (the generation budget)."""
    if counts.max_tokens is None:
        raise ValueError("the constant aggregation needs max_tokens (the completion length limit)")
    return terms.sum() / (counts.sequences * counts.max_tokens)


def aggregate(terms: torch.Tensor, mask: torch.Tensor, mode: str, sequences: float, tokens: float,
              groups: float, per_group_sum: bool = False, max_tokens: float | None = None) -> torch.Tensor:
    """One scalar: the aggregation ``mode`` of the masked terms, normalised by the *global* counts given (the whole
    batch's, over micro-batches and processes), so that the micro-batches' shares sum to the batch's loss exactly."""
    if mode not in AGGREGATORS:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")
    return AGGREGATORS[mode](terms * mask, mask, Counts(sequences, tokens, groups, per_group_sum, max_tokens))
