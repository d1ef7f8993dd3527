"""The generation level's math, token by token, in torch: advantage estimators, policy losses
and the one aggregation function. Registered by name, so an algorithm is a few lines here.

Shapes: B completions (G groups of K, rows g·K … g·K + K − 1 answer prompt g) of
T completion tokens; ``mask`` (B, T) is 1 on the tokens that count.

Every estimator takes the per-token rewards (B, T) — the task reward on the
last completion token and, when the KL shapes the reward, −β·kl on every
token — and returns per-token advantages and returns (B, T). The
sequence-level methods (RLOO, GRPO, REINFORCE, vanilla PG, ReMax, RAFT) score a
whole completion by its summed per-token reward and spread that one advantage
over its tokens; PPO's GAE is per token. The candidate level keeps its NumPy
twins in ``post_training/estimators.py`` (tests check that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
POLICY_LOSSES: dict[str, Callable] = {}


def register_advantage(name: str):
    def decorate(function):
        ADVANTAGE_ESTIMATORS[name] = function
        return function

    return decorate


def register_policy_loss(name: str):
    def decorate(function):
        POLICY_LOSSES[name] = function
        return function

    return decorate


@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor
    """(B, T) per-token reward: task reward on the last token, −β·kl per token when KL shapes the reward."""
    mask: torch.Tensor
    """(B, T) 1 on completion tokens."""
    group_size: int
    scored: torch.Tensor
    """(B,) bool: the reward could score this completion (None leaves it out of every baseline)."""
    greedy_rewards: torch.Tensor | None = None
    """(B,) reward of the prompt's greedy completion (ReMax)."""
    values: torch.Tensor | None = None
    """(B, T) critic's values V(s_t) before each completion token (PPO)."""
    gamma: float = 1.0
    lam: float = 1.0
    state: dict = field(default_factory=dict)
    """The estimator's own JSON-serialisable state (REINFORCE's moving average)."""
    total: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor
    """Sum over every process's batch (the identity in one process), for batch-wide statistics."""


# --- group statistics over (G, K), the torch twins of estimators.py ------------------------


def leave_one_out(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A_i = v_i − 1/(K−1) Σ_{j≠i} v_j over the valid samples of each group (the paper's Eq. 5)."""
    kept = torch.where(valid, values, 0.0)
    count = valid.sum(-1, keepdim=True)
    advantages = kept - (kept.sum(-1, keepdim=True) - kept) / (count - 1).clamp(min=1)
    return torch.where(valid & (count >= 2), advantages, 0.0)


def group_normalised(values: torch.Tensor, valid: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """A_i = (v_i − mean v) / (std v + ε), population std over the valid samples (GRPO)."""
    count = valid.sum(-1, keepdim=True)
    safe = count.clamp(min=1)
    mean = torch.where(valid, values, 0.0).sum(-1, keepdim=True) / safe
    centred = torch.where(valid, values - mean, 0.0)
    std = (centred.square().sum(-1, keepdim=True) / safe).sqrt()
    return torch.where(valid & (count >= 2), centred / (std + epsilon), 0.0)


def best_of_k(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 on the best valid sample of each group (first drawn on ties), 0 elsewhere (RAFT)."""
    chosen = torch.where(valid, values, -torch.inf).argmax(-1, keepdim=True)
    onehot = torch.arange(values.shape[-1], device=values.device) == chosen
    return (onehot & valid).to(values.dtype)


def _sequence(inputs: AdvantageInputs, advantage: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Score each completion by its summed reward, compute a (G, K) advantage, spread it over the tokens."""
    K = inputs.group_size
    scores = (inputs.token_rewards * inputs.mask).sum(-1).view(-1, K)
    per_sequence = advantage(scores, inputs.scored.view(-1, K)).reshape(-1, 1)
    spread = per_sequence * inputs.mask
    return spread, spread


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs):
    return _sequence(inputs, leave_one_out)


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs):
    return _sequence(inputs, group_normalised)


@register_advantage("vanilla-pg")
def vanilla_pg(inputs: AdvantageInputs):
    return _sequence(inputs, lambda scores, valid: torch.where(valid, scores, 0.0))


@register_advantage("reinforce")
def reinforce(inputs: AdvantageInputs):
    """A_i = r̃_i − b; then b ← 0.9 b + 0.1 · mean of this batch's valid r̃ (b never holds this step's rewards)."""
    baseline = inputs.state.get("moving_average", 0.0)
    captured = {}

    def advantage(scores, valid):
        captured["scores"] = scores[valid]
        return torch.where(valid, scores - baseline, 0.0)

    result = _sequence(inputs, advantage)
    scores = captured["scores"].double()
    total, count = inputs.total(torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)]))
    if count:
        inputs.state["moving_average"] = float(0.9 * baseline + 0.1 * total / count)
    return result


@register_advantage("remax")
def remax(inputs: AdvantageInputs):
    greedy = inputs.greedy_rewards.view(-1, inputs.group_size)
    return _sequence(inputs, lambda scores, valid: torch.where(valid, scores - greedy, 0.0))


@register_advantage("raft")
def raft(inputs: AdvantageInputs):
    return _sequence(inputs, best_of_k)


@register_advantage("gae")
def gae(inputs: AdvantageInputs):
    """Generalised advantage estimation (Schulman et al., 2016), per token.

    δ_t = r_t + γ V_{t+1} − V_t (V after the last token is 0), A_t = δ_t + γλ A_{t+1};
    returns R_t = A_t + V_t are the critic's targets. Unscored samples get 0.
    """
    rewards, values, mask = inputs.token_rewards * inputs.mask, inputs.values * inputs.mask, inputs.mask
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        following = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + inputs.gamma * following - values[:, t]
        running = delta + inputs.gamma * inputs.lam * running * mask[:, t + 1] if t + 1 < T else delta
        advantages[:, t] = running
    advantages = advantages * mask
    keep = inputs.scored.to(rewards.dtype).unsqueeze(1)
    return advantages * keep, (advantages + values) * keep


def whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8, total=lambda tensor: tensor) -> torch.Tensor:
    """(v − mean) / std over the masked entries (population std), 0 elsewhere: PPO's advantage whitening.

    ``total`` sums over processes, so the statistics are the whole batch's.
    """
    count = total(mask.sum()).clamp(min=1)
    mean = total((values * mask).sum()) / count
    variance = total(((values - mean).square() * mask).sum()) / count
    return (values - mean) * torch.rsqrt(variance + epsilon) * mask


# --- policy losses: per-token loss terms (B, T), to be aggregated ------------------------------


@dataclass
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
    (the README's candidate-level form; GSPO-style). The term sits on the last token."""
    log_ratio = ((inputs.logprobs - inputs.old_logprobs) * inputs.mask).sum(-1, keepdim=True)
    advantage = (inputs.advantages * inputs.mask).sum(-1, keepdim=True) / inputs.mask.sum(-1, keepdim=True).clamp(min=1)
    per_sequence = _clipped(torch.exp(log_ratio), advantage, inputs.clip_range)
    return per_sequence * last_token(inputs.mask)


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


# --- aggregation -----------------------------------------------------------------------------------


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
