"""The phases after the experience: advantages from the algorithm's record, then the actor's and the critic's
updates in epochs × mini-batches (whole groups) × micro-batches, aggregated with the batch's global counts
(so micro-batches of any size, splitting groups or not, give the same gradient)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from auto_research.algorithms.estimators import ADVANTAGE_ESTIMATORS, AdvantageInputs, sequence_scores, whiten
from auto_research.algorithms.losses import (POLICY_LOSSES, LossInputs, aggregate, clipped_value_loss, last_token,
                                             policy_loss_name)
from auto_research.config.generation import GenerationConfig
from auto_research.engine.logprobs import completion_values, kl_per_token, token_logprobs
from auto_research.train.components import Components
from auto_research.train.experience import Experience, widen


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor
    """(B, T) per-token advantages (whitened over the global batch when the record says so)."""
    returns: torch.Tensor
    """(B, T) per-token returns (the critic's targets)."""
    inputs: AdvantageInputs
    """What the estimator saw: the per-token rewards and the rest."""


def estimate_advantages(c: Components, experience: Experience, baseline: float = 0.0) -> Advantages:
    """Per-token rewards (the task reward on the last token, −β·kl on every token when the KL shapes the
    reward) → the record's estimator → whitening over every rank's tokens when the record asks for it."""
    config, mask, scores = c.config, experience.mask, experience.scores
    token_rewards = last_token(mask) * scores.rewards.unsqueeze(1)
    if config.kl_in == "reward":
        token_rewards = token_rewards - config.beta * experience.kl
    inputs = AdvantageInputs(token_rewards, mask, config.group_size, scores.scored, scores.greedy_rewards,
                             experience.values, 1.0, config.gae_lambda, baseline, scores.rewards)
    advantages, returns = ADVANTAGE_ESTIMATORS[c.algorithm.advantage](inputs)
    if c.algorithm.whiten and config.whiten_advantages:
        advantages = whiten(advantages, mask * scores.scored.float().unsqueeze(1), total=c.world.total)
    return Advantages(advantages, returns, inputs)


def moving_average_after(inputs: AdvantageInputs, baseline: float, decay: float, total=lambda tensor: tensor) -> float:
    """b ← decay · b + (1 − decay) · this step's mean score over every rank's valid samples (REINFORCE):
    the loop's, after the step's advantages used the old b; ``total`` sums over ranks."""
    scores = sequence_scores(inputs)[inputs.scored.view(-1, inputs.group_size)].double()
    summed, count = total(torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=torch.float64)]))
    return float(decay * baseline + (1 - decay) * summed / count) if count else baseline


def learning_rate_at(config: GenerationConfig, update: int, total_updates: int) -> float:
    """Linear warmup, then constant or cosine decay to zero (update counted from 0)."""
    if config.warmup_steps and update < config.warmup_steps:
        return config.learning_rate * (update + 1) / config.warmup_steps
    if config.lr_schedule == "cosine":
        span = max(1, total_updates - config.warmup_steps)
        progress = min(1.0, (update - config.warmup_steps) / span)
        return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.learning_rate


def _mini_batches(c: Components, rows: int) -> list[slice]:
    """Slices of whole groups, one optimizer step each."""
    size = rows // c.config.ppo_mini_batches
    return [slice(start, start + size) for start in range(0, rows, size)]


def _accumulating(c: Components, experience: Experience, rows: slice, wrapped):
    """The trimmed micro-batches of one optimizer step, each body run inside DDP's ``no_sync``
    except the last, whose backward then all-reduces the accumulated gradient once."""
    size = c.config.micro_batch_size or (rows.stop - rows.start)
    parts = [slice(start, min(start + size, rows.stop)) for start in range(rows.start, rows.stop, size)]
    for index, part in enumerate(parts):
        with c.world.no_sync(wrapped, last=index == len(parts) - 1):
            yield part, experience.rollout.rows(part.start, part.stop, trim=True)


def optimizer_step(c: Components, model, optimizer, update: int) -> float:
    """Clip the gradient norm, set the scheduled learning rate, step, zero; returns the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], c.config.max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    for group in optimizer.param_groups:
        group["lr"] = learning_rate_at(c.config, update, c.config.steps * c.updates_per_step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def update_actor(c: Components, experience: Experience, advantages: Advantages, updates: int) -> dict:
    """Epochs × mini-batches × micro-batches of the record's policy loss (plus the KL term in the loss).
    ``updates``: optimizer steps taken before (the schedule's position); returns the figures and their count."""
    config, mask, world = c.config, experience.mask, c.world
    clipped_name = policy_loss_name(c.algorithm.policy_loss, config.ratio_level,
                                    config.updates_per_batch > 1 or config.ppo_mini_batches > 1)
    loss_function, clipped = POLICY_LOSSES[clipped_name], clipped_name != "vanilla"
    totals = {"loss": 0.0, "pg_loss": 0.0, "kl_loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0}
    width, all_tokens = mask.shape[1], float(world.total(mask.sum()).clamp(min=1))
    for _ in range(config.updates_per_batch):
        for rows in _mini_batches(c, mask.shape[0]):
            # Global counts of this optimizer step (over every rank): micro-batch shares sum to its exact loss.
            # DDP and FSDP average gradients over ranks, hence the loss × N.
            sequences = (rows.stop - rows.start) * world.size
            counts = dict(sequences=float(sequences), tokens=float(world.total(mask[rows].sum()).clamp(min=1)),
                          groups=float(sequences // config.group_size))
            for part, chunk in _accumulating(c, experience, rows, c.train_policy):
                with c.autocast():
                    logprobs = widen(token_logprobs(c.train_policy, chunk.sequences, chunk.prompt_mask,
                                                    chunk.completion_mask, config.temperature,
                                                    group_size=config.group_size), width)
                inputs = LossInputs(logprobs, experience.old_logprobs[part], advantages.advantages[part], mask[part],
                                    config.clip_range)
                terms = loss_function(inputs)
                if experience.rollout_weights is not None:  # another engine sampled: π/μ, truncated
                    terms = terms * experience.rollout_weights[part]
                pg = aggregate(terms, mask[part], config.loss_aggregation, **counts,
                               per_group_sum=c.algorithm.reduction == "sum")
                loss = pg
                if config.kl_in == "loss" and experience.reference_logprobs is not None and config.beta > 0:
                    kl = kl_per_token(logprobs, experience.reference_logprobs[part], config.kl_estimator)
                    kl_loss = config.beta * aggregate(kl, mask[part], config.loss_aggregation, **counts)
                    loss = loss + kl_loss
                    totals["kl_loss"] += float(kl_loss.detach())
                (loss * world.size if world.distributed else loss).backward()
                totals["loss"] += float(loss.detach())
                totals["pg_loss"] += float(pg.detach())
                if clipped:
                    ratio = torch.exp(logprobs.detach() - experience.old_logprobs[part])
                    outside = ((ratio - 1).abs() > config.clip_range).float() * mask[part]
                    totals["clip_fraction"] += float(outside.sum()) / all_tokens
            totals["grad_norm"] = optimizer_step(c, c.policy, c.optimizer, updates)
            updates += 1
    # Losses are reported per optimizer step (averaged, summed over ranks); the gradient norm is the last step's.
    keys = ("loss", "pg_loss", "kl_loss", "clip_fraction")
    summed = world.total(torch.tensor([totals[key] for key in keys], dtype=torch.float64))
    for key, value in zip(keys, summed.tolist()):
        totals[key] = value / c.updates_per_step
    return totals


def update_critic(c: Components, experience: Experience, advantages: Advantages, updates: int) -> dict:
    """PPO's critic: ½·max((V − R)², (V_clip − R)²) on the GAE returns, token-mean, times --vf-coef.
    Every critic step of a step takes the schedule's learning rate at ``updates``, the actor's count after
    its updates."""
    if c.critic is None:
        return {}
    config, world = c.config, c.world
    mask = experience.mask * experience.scores.scored.float().unsqueeze(1)
    width, value_loss = mask.shape[1], 0.0
    for _ in range(config.updates_per_batch):
        for rows in _mini_batches(c, mask.shape[0]):
            tokens = float(world.total(mask[rows].sum()).clamp(min=1))
            for part, chunk in _accumulating(c, experience, rows, c.train_critic):
                with c.autocast():
                    values = widen(completion_values(c.train_critic, chunk.sequences, chunk.prompt_mask,
                                                     chunk.completion_mask, config.group_size), width)
                terms = clipped_value_loss(values, experience.values[part], advantages.returns[part],
                                           config.value_clip)
                loss = config.vf_coef * (terms * mask[part]).sum() / tokens
                (loss * world.size if world.distributed else loss).backward()
                value_loss += float(loss.detach()) / max(config.vf_coef, 1e-12)
            optimizer_step(c, c.critic, c.critic_optimizer, updates)
    returns, values = advantages.returns, experience.values
    count = world.total(mask.sum()).clamp(min=1)
    mean = world.total((returns * mask).sum()) / count
    sums = world.total(torch.stack([((returns - values) * mask).square().sum(),
                                    ((returns - mean) * mask).square().sum(),
                                    torch.tensor(value_loss, dtype=torch.float32)]).double())
    residual, variance, value_loss = sums.tolist()
    return {"value_loss": value_loss / c.updates_per_step, "explained_variance": 1.0 - residual / max(variance, 1e-12)}
