"""The phases after the experience: advantages from the algorithm's record, then the actor's and the critic's updates
in epochs × mini-batches (whole groups) × micro-batches, aggregated with the batch's global counts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from auto_research.algorithms.estimators import (ADVANTAGE_ESTIMATORS, AdvantageInputs, dense_term,
                                                 normalise_over_batch, sequence_scores, whiten)
from auto_research.algorithms.losses import POLICY_LOSSES, LossInputs, aggregate, clip_fraction, clipped_value_loss
from auto_research.algorithms.registry import kl_in_loss, kl_shapes_reward
from auto_research.engine.logprobs import completion_values, kl_per_token, token_logprobs
from auto_research.engine.rollout import Rollout, eos_ids
from auto_research.train.components import Models, RunContext
from auto_research.train.experience import Experience, widen
from auto_research.train.micro_batches import micro_batches, rows_of


@dataclass(frozen=True)
class Advantages:
    advantages: torch.Tensor
    returns: torch.Tensor
    """(B, T) per-token returns (the critic's targets)."""
    inputs: AdvantageInputs
    centred: torch.Tensor | None = None
    """(B, T) the dense stream less its baseline (a teacher's d − b), whose λ× joined the advantages; None without."""


def estimate_advantages(run: RunContext, experience: Experience, baseline: float = 0.0) -> Advantages:
    """The record's streams summed per token (−β·kl too when the KL shapes the reward) → its estimator → whitening or
    --normalize-advantages → its dense streams the run has, less their baselines: Â_{i,t} = A_i + λ·(d_{i,t} − b_i)."""
    loss, group_size, gae_lambda = run.config.loss, run.config.sampling.group_size, run.config.critic.gae_lambda
    mask, scores, streams = experience.mask, experience.scores, experience.streams
    token_rewards = sum((streams[name] for name in run.algorithm.rewards), torch.zeros_like(mask))
    if kl_shapes_reward(loss.kl_in):
        token_rewards = token_rewards - loss.beta * streams["kl"]
    inputs = AdvantageInputs(token_rewards, mask, group_size, scores.scored, scores.greedy_rewards, experience.values,
                             1.0, gae_lambda, baseline, streams["task"].sum(1), loss.std or "population")
    advantages, returns = ADVANTAGE_ESTIMATORS[run.algorithm.advantage](inputs)
    if run.algorithm.whiten and loss.whiten_advantages:
        advantages = whiten(advantages, mask * scores.scored.float().unsqueeze(1), total=run.world.total)
    if loss.normalize_advantages:
        advantages = normalise_over_batch(advantages, mask, scores.scored, total=run.world.total)
    centred = None
    for name in (name for name in run.algorithm.dense if name in streams):
        centred = dense_term(streams[name], mask, group_size, loss.distill_baseline, scores.scored)
        advantages = advantages + loss.distill_weight * centred
    return Advantages(advantages, returns, inputs, centred)


def truncated(rollout: Rollout, max_new_tokens: int, eos: list[int]) -> torch.Tensor:
    """(B,) bool: the completion hit the length limit without ending (its last token is no EOS)."""
    if rollout.episodes is not None:  # a multi-turn trajectory: at --max-turns or its length limit
        return torch.tensor([bool(row["truncated"]) for row in rollout.episodes], device=rollout.sequences.device)
    lengths = rollout.completion_mask.sum(1).long()
    last = rollout.completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lengths >= max_new_tokens) & ~torch.isin(last, torch.tensor(eos, dtype=last.dtype, device=last.device))


def loss_mask(run: RunContext, policy, experience: Experience) -> torch.Tensor:
    """(B, T) the tokens the actor's loss counts: --mask-truncated drops the truncated completions'."""
    mask = experience.mask
    if not run.config.loss.mask_truncated:
        return mask
    cut = truncated(experience.rollout, run.config.sampling.max_new_tokens, eos_ids(run.tokenizer, policy))
    return mask * (~cut).to(mask.dtype).unsqueeze(1)


def moving_average_after(inputs: AdvantageInputs, baseline: float, decay: float, total=lambda tensor: tensor) -> float:
    """b ← decay · b + (1 − decay) · this step's mean score over every rank's valid samples (REINFORCE)."""
    scores = sequence_scores(inputs)[inputs.scored.view(-1, inputs.group_size)].double()
    summed, count = total(torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=torch.float64,
                                                                  device=scores.device)]))
    return float(decay * baseline + (1 - decay) * summed / count) if count else baseline


def learning_rate_at(optimisation, update: int, total_updates: int) -> float:
    """Linear warmup, then constant, or a linear or cosine decay to zero at the last update (counted from 0)."""
    rate, warmup = optimisation.learning_rate, optimisation.warmup_steps
    if warmup and update < warmup:
        return rate * (update + 1) / warmup
    span = max(1, total_updates - warmup)
    if optimisation.lr_schedule == "linear":
        return rate * max(0.0, (total_updates - update) / span)
    if optimisation.lr_schedule == "cosine":
        progress = min(1.0, (update - warmup) / span)
        return rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return rate


def _mini_batches(run: RunContext, rows: int) -> list[slice]:
    """Slices of whole groups, one optimizer step each."""
    size = rows // run.config.loss.ppo_mini_batches
    return [slice(start, start + size) for start in range(0, rows, size)]


def _accumulating(run: RunContext, experience: Experience, rows: slice, wrapped):
    """The trimmed micro-batches of one optimizer step, with whether they are packed, each inside DDP's ``no_sync``
    but the last (whose backward all-reduces the accumulated gradient once)."""
    pack, parts = micro_batches(run, experience.rollout, rows, wrapped)
    for index, part in enumerate(parts):
        with run.world.no_sync(wrapped, last=index == len(parts) - 1):
            yield part, rows_of(experience.rollout, part), pack


def optimizer_step(run: RunContext, model, optimizer, update: int) -> float:
    """Clip the gradient norm, set the scheduled learning rate, step, zero; returns the norm before clipping."""
    trained = [p for p in model.parameters() if p.requires_grad]
    for parameter in trained:  # (a tied embedding's rows-seen share alone, had the output side had none)
        if parameter.grad is not None and parameter.grad.is_sparse:
            parameter.grad = parameter.grad.to_dense()
    norm = torch.nn.utils.clip_grad_norm_(trained, run.config.optimisation.max_grad_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    for group in optimizer.param_groups:
        group["lr"] = learning_rate_at(run.config.optimisation, update, run.config.run.steps * run.updates_per_step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def update_actor(run: RunContext, models: Models, experience: Experience, advantages: Advantages, updates: int) -> dict:
    """Epochs × mini-batches × micro-batches of the policy loss, the KL in the loss, the entropy bonus."""
    loss, sampling, world, policy_loss = run.config.loss, run.config.sampling, run.world, run.config.policy_loss_in_use
    mask = loss_mask(run, models.policy, experience)
    loss_function = POLICY_LOSSES[policy_loss]
    totals = {"loss": 0.0, "pg_loss": 0.0, "kl_loss": 0.0, "entropy_loss": 0.0, "grad_norm": 0.0,
              "clip_fraction": 0.0}
    width, all_tokens = mask.shape[1], float(world.total(mask.sum()).clamp(min=1))
    entropy_bonus = loss.entropy_coef > 0
    for _ in range(loss.updates_per_batch):
        for rows in _mini_batches(run, mask.shape[0]):
            # Global counts of this optimizer step (over every rank): micro-batch shares sum to its exact loss.
            # DDP and FSDP average gradients over ranks, hence the loss × N.
            sequences = (rows.stop - rows.start) * world.size
            counts = dict(sequences=float(sequences), tokens=float(world.total(mask[rows].sum()).clamp(min=1)),
                          groups=float(sequences // sampling.group_size), max_tokens=float(sampling.max_new_tokens))
            for part, chunk, pack in _accumulating(run, experience, rows, models.train_policy):
                with run.autocast():
                    output = token_logprobs(models.train_policy, chunk.sequences, chunk.prompt_mask,
                                            chunk.completion_mask, sampling.temperature, with_entropy=entropy_bonus,
                                            group_size=sampling.group_size, entropy_gradient=entropy_bonus, pack=pack)
                logprobs, entropy = output if entropy_bonus else (output, None)
                logprobs = widen(logprobs, width)
                inputs = LossInputs(logprobs, experience.old_logprobs[part], advantages.advantages[part], mask[part],
                                    loss.clip_low, loss.clip_high)
                terms = loss_function(inputs)
                if experience.rollout_weights is not None:  # another engine sampled: π/μ, truncated
                    terms = terms * experience.rollout_weights[part]
                pg = aggregate(terms, mask[part], loss.loss_aggregation, **counts,
                               per_group_sum=run.algorithm.reduction == "sum")
                objective = pg
                if kl_in_loss(loss.kl_in) and experience.reference_logprobs is not None and loss.beta > 0:
                    kl = kl_per_token(logprobs, experience.reference_logprobs[part], loss.kl_estimator)
                    kl_loss = loss.beta * aggregate(kl, mask[part], loss.loss_aggregation, **counts)
                    objective = objective + kl_loss
                    totals["kl_loss"] += float(kl_loss.detach())
                if entropy_bonus:
                    entropy_loss = -loss.entropy_coef * aggregate(widen(entropy, width), mask[part],
                                                                  loss.loss_aggregation, **counts)
                    objective = objective + entropy_loss
                    totals["entropy_loss"] += float(entropy_loss.detach())
                (objective * world.size if world.distributed else objective).backward()
                totals["loss"] += float(objective.detach())
                totals["pg_loss"] += float(pg.detach())
                totals["clip_fraction"] += float(clip_fraction(policy_loss, inputs).sum()) / all_tokens
            totals["grad_norm"] = optimizer_step(run, models.policy, models.optimizer, updates)
            updates += 1
    # Losses are reported per optimizer step (averaged, summed over ranks); the gradient norm is the last step's.
    keys = ("loss", "pg_loss", "kl_loss", "entropy_loss", "clip_fraction")
    summed = world.total(torch.tensor([totals[key] for key in keys], dtype=torch.float64))
    for key, value in zip(keys, summed.tolist()):
        totals[key] = value / run.updates_per_step
    if not entropy_bonus:
        del totals["entropy_loss"]
    return totals


def update_critic(run: RunContext, models: Models, experience: Experience, advantages: Advantages, updates: int):
    """PPO's critic: ½·max((V − R)², (V_clip − R)²) on the GAE returns, token-mean, times --vf-coef; its steps take
    the learning rate at ``updates``, the actor's count after its updates."""
    if models.critic is None:
        return {}
    critic, world = run.config.critic, run.world
    mask = experience.mask * experience.scores.scored.float().unsqueeze(1)
    width, value_loss = mask.shape[1], 0.0
    for _ in range(run.config.loss.updates_per_batch):
        for rows in _mini_batches(run, mask.shape[0]):
            tokens = float(world.total(mask[rows].sum()).clamp(min=1))
            for part, chunk, pack in _accumulating(run, experience, rows, models.train_critic):
                with run.autocast():
                    values = widen(completion_values(models.train_critic, chunk.sequences, chunk.prompt_mask,
                                                     chunk.completion_mask, run.config.sampling.group_size, pack=pack),
                                   width)
                terms = clipped_value_loss(values, experience.values[part], advantages.returns[part], critic.value_clip)
                loss = critic.vf_coef * (terms * mask[part]).sum() / tokens
                (loss * world.size if world.distributed else loss).backward()
                value_loss += float(loss.detach()) / max(critic.vf_coef, 1e-12)
            optimizer_step(run, models.critic, models.critic_optimizer, updates)
    returns, values = advantages.returns, experience.values
    count = world.total(mask.sum()).clamp(min=1)
    mean = world.total((returns * mask).sum()) / count
    sums = world.total(torch.stack([((returns - values) * mask).square().sum(),
                                    ((returns - mean) * mask).square().sum(),
                                    torch.tensor(value_loss, dtype=torch.float32, device=mask.device)]).double())
    residual, variance, value_loss = sums.tolist()
    return {"value_loss": value_loss / run.updates_per_step, "explained_variance": 1 - residual / max(variance, 1e-12)}
