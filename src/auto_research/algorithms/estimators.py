"""Advantage estimators of the generation level in torch: pure functions, registered by name.

Shapes: B completions (G groups of K, rows g·K … g·K + K − 1 answer prompt g) of T tokens; ``mask`` (B, T) is 1 on
the tokens that count. An estimator maps per-token rewards (B, T) to per-token advantages and returns (B, T). Nothing
here communicates or keeps state: whitening over the global batch and baselines across steps are the loop's. The
sequence-level methods spread one advantage per completion (from its summed reward) over its tokens; GAE is per
token. ``candidate.py`` keeps NumPy twins (tests check that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}


def register_advantage(name: str):
    def decorate(function):
        ADVANTAGE_ESTIMATORS[name] = function
        return function

    return decorate


@dataclass(frozen=True)
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
    baseline: float = 0.0
    """The loop's moving-average baseline b (algorithms with a ``moving_average`` decay)."""
    task_rewards: torch.Tensor | None = None
    """(B,) the task's score of each completion, before any KL (0 where unscored)."""
    std: str = "population"
    """The GRPO family's group standard deviation: population (÷ K), unbiased (÷ K − 1) or none (no division)."""


# --- group statistics over (G, K), the torch twins of candidate.py ------------------------------------


def leave_one_out(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A_i = v_i − 1/(K−1) Σ_{j≠i} v_j over the valid samples of each group (the paper's Eq. 5)."""
    kept = torch.where(valid, values, 0.0)
    count = valid.sum(-1, keepdim=True)
    advantages = kept - (kept.sum(-1, keepdim=True) - kept) / (count - 1).clamp(min=1)
    return torch.where(valid & (count >= 2), advantages, 0.0)


def group_normalised(values: torch.Tensor, valid: torch.Tensor, epsilon: float = 1e-6,
                     unbiased: bool = False) -> torch.Tensor:
    """A_i = (v_i − mean v) / (std v + ε) over the valid samples (GRPO): population std (÷ n), or with
    ``unbiased`` the sample std (÷ n − 1, as verl, OpenRLHF and TRL)."""
    count = valid.sum(-1, keepdim=True)
    safe = count.clamp(min=1)
    mean = torch.where(valid, values, 0.0).sum(-1, keepdim=True) / safe
    centred = torch.where(valid, values - mean, 0.0)
    std = (centred.square().sum(-1, keepdim=True) / ((count - 1).clamp(min=1) if unbiased else safe)).sqrt()
    return torch.where(valid & (count >= 2), centred / (std + epsilon), 0.0)


def group_centred(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A_i = v_i − mean v over the valid samples, no std (Dr. GRPO); 0 in a group with fewer than 2."""
    count = valid.sum(-1, keepdim=True)
    mean = torch.where(valid, values, 0.0).sum(-1, keepdim=True) / count.clamp(min=1)
    return torch.where(valid & (count >= 2), values - mean, 0.0)


def group_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of each group's valid values, broadcast back over the group (0 in a group with none)."""
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    return (torch.where(valid, values, 0.0).sum(-1, keepdim=True) / count).expand_as(values)


def best_of_k(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """1 on the best valid sample of each group (first drawn on ties), 0 elsewhere (RAFT)."""
    chosen = torch.where(valid, values, -torch.inf).argmax(-1, keepdim=True)
    onehot = torch.arange(values.shape[-1], device=values.device) == chosen
    return (onehot & valid).to(values.dtype)


def sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """(G, K) each completion's summed per-token reward: the return of the whole response."""
    return (inputs.token_rewards * inputs.mask).sum(-1).view(-1, inputs.group_size)


def _sequence(inputs: AdvantageInputs, advantage: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Score each completion by its summed reward, compute a (G, K) advantage, spread it over the tokens."""
    K = inputs.group_size
    per_sequence = advantage(sequence_scores(inputs), inputs.scored.view(-1, K)).reshape(-1, 1)
    spread = per_sequence * inputs.mask
    return spread, spread


def dense_term(stream: torch.Tensor, mask: torch.Tensor, group_size: int, baseline: str,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) a per-token signal s_{i,t} (a teacher's d) less its baseline b_i: ``loo`` b_i = mean over the group's
    other valid samples j of mean_t s_{j,t} (independent of i: unbiased), ``none`` b_i = 0. ``valid`` (B,): the rows
    that have the signal (default all); an invalid row's term is 0 and it is in no baseline."""
    valid = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device) if valid is None else valid
    if baseline == "none":
        return stream * mask * valid.unsqueeze(1)
    means = torch.where(valid, (stream * mask).sum(1) / mask.sum(1).clamp(min=1), 0.0).view(-1, group_size)
    others = (means.sum(-1, keepdim=True) - means) / (valid.view(-1, group_size).sum(-1, keepdim=True)
                                                      - valid.view(-1, group_size).long()).clamp(min=1)
    return (stream - others.reshape(-1, 1)) * mask * valid.unsqueeze(1)


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = Σ_{s ≥ t} r_s over each completion's tokens (γ = 1), 0 where masked."""
    rewards = rewards * mask
    return (rewards.flip(-1).cumsum(-1).flip(-1)) * mask


# --- the estimators --------------------------------------------------------------------------------------


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs):
    return _sequence(inputs, leave_one_out)


@register_advantage("grpo")
def grpo(inputs: AdvantageInputs):
    """GRPO's group-normalised advantage (DAPO's, GSPO's, CISPO's too), by --std (none: the mean subtracted only)."""
    if inputs.std == "none":
        return _sequence(inputs, group_centred)
    return _sequence(inputs, lambda scores, valid: group_normalised(scores, valid, unbiased=inputs.std == "unbiased"))


@register_advantage("dr-grpo")
def dr_grpo(inputs: AdvantageInputs):
    """Dr. GRPO (Liu et al., 2025): the group mean subtracted, no division by the group's std."""
    return _sequence(inputs, group_centred)


@register_advantage("vanilla-pg")
def vanilla_pg(inputs: AdvantageInputs):
    return _sequence(inputs, lambda scores, valid: torch.where(valid, scores, 0.0))


@register_advantage("reinforce")
def reinforce(inputs: AdvantageInputs):
    """A_i = r̃_i − b, b the loop's moving average of past steps' mean r̃ (it never holds this step's)."""
    return _sequence(inputs, lambda scores, valid: torch.where(valid, scores - inputs.baseline, 0.0))


@register_advantage("remax")
def remax(inputs: AdvantageInputs):
    greedy = inputs.greedy_rewards.view(-1, inputs.group_size)
    return _sequence(inputs, lambda scores, valid: torch.where(valid, scores - greedy, 0.0))


@register_advantage("raft")
def raft(inputs: AdvantageInputs):
    return _sequence(inputs, best_of_k)


@register_advantage("gae")
def gae(inputs: AdvantageInputs):
    """GAE (Schulman et al., 2016): δ_t = r_t + γ V_{t+1} − V_t (V after the last token 0), A_t = δ_t + γλ A_{t+1};
    returns R_t = A_t + V_t are the critic's targets. Unscored samples get 0."""
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


@register_advantage("reinforce-pp")
def reinforce_pp(inputs: AdvantageInputs):
    """REINFORCE++ (Hu et al., 2025): G_t = Σ_{s≥t} r_s (γ = 1), no critic or group baseline."""
    returns = returns_to_go(inputs.token_rewards, inputs.mask) * inputs.scored.to(inputs.mask.dtype).unsqueeze(1)
    return returns, returns


@register_advantage("reinforce-pp-baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs):
    """REINFORCE++-baseline (the same paper; OpenRLHF's ``reinforce_baseline``): G_t − mean_group(r) on every token
    (the group's mean score on the last token adds to every token's return)."""
    K, keep = inputs.group_size, inputs.scored.to(inputs.mask.dtype).unsqueeze(1)
    baseline = group_mean(inputs.task_rewards.view(-1, K), inputs.scored.view(-1, K)).reshape(-1, 1)
    returns = (returns_to_go(inputs.token_rewards, inputs.mask) - baseline * inputs.mask) * keep
    return returns, returns


# --- reward shaping and normalisation over the global batch (the loop's, never an estimator's) ----------------


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, Eq. 13), added to the reward: 0 for |y| ≤ L_max − L, then
    falling linearly, −P·(|y| − (L_max − L))/L, to −P at |y| = L_max (the length limit, --max-new-tokens), with L
    the buffer and P the penalty (DAPO: P = 1). ``lengths``: (B,) each completion's tokens, its EOS included."""
    over = (lengths.to(torch.float32) - (max_tokens - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def normalise_over_batch(advantages: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor, epsilon: float = 1e-4,
                         total=lambda tensor: tensor) -> torch.Tensor:
    """--normalize-advantages (TRL's for RLOO): each completion's mean token advantage z-scored over the global
    batch's valid completions (sample std, ÷ n − 1), spread back over its tokens; ``total`` sums over processes."""
    per_sequence = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    weight = valid.to(per_sequence.dtype)
    count = total(weight.sum())
    mean = total((per_sequence * weight).sum()) / count.clamp(min=1)
    variance = total(((per_sequence - mean).square() * weight).sum()) / (count - 1).clamp(min=1)
    normalised = (per_sequence - mean) / (variance.sqrt() + epsilon) * weight
    return normalised.unsqueeze(1) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8, total=lambda tensor: tensor) -> torch.Tensor:
    """(v − mean) / std over the masked entries (population std), 0 elsewhere; ``total`` sums over processes."""
    count = total(mask.sum()).clamp(min=1)
    mean = total((values * mask).sum()) / count
    variance = total(((values - mean).square() * mask).sum()) / count
    return (values - mean) * torch.rsqrt(variance + epsilon) * mask
