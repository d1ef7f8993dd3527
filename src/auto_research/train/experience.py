"""The phases before the update, each handing a frozen value to the next:

    batch      = draw_batch(c, rng, step)               # the step's prompts (this rank's share) and seeds
    rollout    = c.sampler.sample(batch.prompts, K, batch.seeds)
    scores     = score(c, batch, rollout, step)          # rewards, None-masked; NaN stops the run
    experience = build_experience(c, rollout, scores)    # log π_old, log π_ref, entropy, values, KL
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auto_research.data.types import Example
from auto_research.algorithms.correction import importance_weights, mismatch
from auto_research.engine.logprobs import completion_values, kl_per_token, token_logprobs
from auto_research.engine.rollout import Rollout, prompt_seed
from auto_research.engine.rollout.builtin import sample
from auto_research.engine.samplers import sampler_record
from auto_research.errors import RewardError
from auto_research.train.components import Components


@dataclass(frozen=True)
class Batch:
    """The prompts of one step that this rank samples: dataset indices, texts as the model sees them, rows."""

    indices: list[int]
    prompts: list[str]
    examples: list[Example]
    seeds: list[int]
    """One sampling seed per prompt, from (run seed, step, dataset index)."""


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor
    """(B,) task reward, 0 where unscored."""
    scored: torch.Tensor
    """(B,) bool: the reward could score this completion."""
    greedy_rewards: torch.Tensor | None = None
    """(B,) the reward of the prompt's greedy completion (ReMax), repeated over its group."""
    unscored: int = 0
    """Completions the reward could not score, over every rank."""
    samples: int = 0
    """Completions scored or not, over every rank."""


@dataclass(frozen=True)
class Experience:
    """One step's rollout and everything computed from it without gradient (B completions, T tokens)."""

    rollout: Rollout
    scores: Scores
    old_logprobs: torch.Tensor
    """(B, T) log π of the policy that sampled: the ratios' denominator."""
    entropy: torch.Tensor
    """(B, T) per-token entropy of that policy."""
    kl: torch.Tensor
    """(B, T) per-token KL estimate against the reference (0 without one)."""
    reference_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """(B, T) the critic's V(s_t) (PPO)."""
    rollout_weights: torch.Tensor | None = None
    """(B, T) the importance weights of each token's loss term for a sampler other than the trainer
    (--rollout-correction; algorithms/correction.py); None when the trainer sampled."""
    drift: dict | None = None
    """This process's sums of the sampler/trainer log-prob mismatch (``correction.mismatch``)."""

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.completion_mask.float()


def draw_batch(c: Components, rng: np.random.Generator, step: int) -> Batch:
    """Distinct prompts, the same on every rank (one generator), and this rank's share of them."""
    picks = rng.choice(len(c.task.train), size=c.config.prompts_per_step, replace=False)
    picks = [int(index) for index in c.world.share(list(picks), c.config.ppo_mini_batches)]
    return Batch(picks, [c.train_prompts[i] for i in picks], [c.task.train[i] for i in picks],
                 [prompt_seed(c.config.seed, step, index) for index in picks])


def score(c: Components, batch: Batch, rollout: Rollout, step: int) -> Scores:
    """Task rewards of every completion (and of the greedy ones, for an algorithm that needs them).

    A reward that fails on one rank stops every rank (each would otherwise wait for the others); a step
    in which no completion could be scored is an error.
    """
    K = c.config.group_size
    prompts = [prompt for prompt in batch.prompts for _ in range(K)]
    examples = [example for example in batch.examples for _ in range(K)]
    greedy = None
    if c.algorithm.needs_greedy:
        with c.sampling():
            greedy = sample(c.policy, c.tokenizer, batch.prompts, 1, c.config.max_new_tokens, greedy=True)
    failure, values, greedy_values = None, None, None
    try:
        values = c.reward(prompts, rollout.completions, examples, rollout.token_lists())
        greedy_values = c.reward(batch.prompts, greedy.completions, batch.examples) if greedy else None
    except RewardError as error:
        failure = error
    c.world.agree(failure, RewardError)
    scored = torch.tensor([value is not None for value in values])
    rewards = torch.tensor([0.0 if value is None else value for value in values])
    unscored, total = (int(x) for x in c.world.total(torch.tensor([int((~scored).sum()), len(values)])))
    if unscored == total:
        raise RewardError(f"no sample of step {step} could be scored: the reward returned None for all {unscored} "
                          "completions")
    greedy_rewards = None
    if greedy_values is not None:
        greedy_rewards = torch.tensor([0.0 if v is None else v for v in greedy_values]).repeat_interleave(K)
    return Scores(rewards, scored, greedy_rewards, unscored, total)


def widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, c) → (b, width), zeros on the right: a trimmed micro-batch's output at the batch's width."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1])) if values.shape[1] < width else values


def no_grad_forward(c: Components, model, rollout: Rollout, function, **options):
    """``function`` over the rollout in micro-batches, without gradient, concatenated.

    Each micro-batch is trimmed to its own longest prompt and completion (``Rollout.rows``), so
    no compute goes to columns that are padding in every row, and a micro-batch has the same
    shape whichever process holds it; outputs are padded back to the batch's width with zeros.
    """
    size = c.config.micro_batch_size or rollout.sequences.shape[0]
    width = rollout.completion_mask.shape[1]
    outputs = []
    with torch.no_grad(), c.autocast():
        for start in range(0, rollout.sequences.shape[0], size):
            chunk = rollout.rows(start, start + size, trim=True)
            result = function(model, chunk.sequences, chunk.prompt_mask, chunk.completion_mask,
                              group_size=c.config.group_size, **options)
            outputs.append(tuple(widen(part, width) for part in result) if isinstance(result, tuple)
                           else widen(result, width))
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outputs))
    return torch.cat(outputs)


def build_experience(c: Components, rollout: Rollout, scores: Scores) -> Experience:
    """log π_ref of every completion token (when a reference is held), then log π of the policy that sampled
    (the ratios' denominator and the KL) with its entropy, and the critic's values: no-grad forwards.

    The policy's forward is skipped when the step is on-policy (one update per batch) and the sampler drew
    from the training weights' own, unfiltered distribution in float32: its log-probs and entropies are then
    those of the policy (the ratio of the one update is 1), computed as it sampled."""
    temperature = c.config.temperature
    mask = rollout.completion_mask.float()
    reference_logprobs = None
    if c.reference is not None:
        reference_logprobs = no_grad_forward(c, c.reference, rollout, token_logprobs, temperature=temperature)
    if sampled_is_the_policy(c, rollout):
        old_logprobs, entropy = rollout.sampler_logprobs, rollout.sampler_entropy
    else:
        old_logprobs, entropy = no_grad_forward(c, c.policy, rollout, token_logprobs, temperature=temperature,
                                                with_entropy=True)
    if reference_logprobs is not None:
        kl = kl_per_token(old_logprobs, reference_logprobs, c.config.kl_estimator) * mask
    else:
        kl = torch.zeros_like(old_logprobs)
    values = no_grad_forward(c, c.critic, rollout, completion_values) * mask if c.critic is not None else None
    weights = drift = None
    if not sampler_record(c.config).is_the_trainer and rollout.sampler_logprobs is not None:
        # Another engine sampled: how far its log-probs are from the trainer's, and the weights that correct it.
        weights = importance_weights(old_logprobs - rollout.sampler_logprobs, mask, c.config.rollout_correction,
                                     c.config.rollout_correction_cap)
        drift = mismatch(old_logprobs, rollout.sampler_logprobs, mask)
    return Experience(rollout, scores, old_logprobs, entropy, kl, reference_logprobs, values, weights, drift)


def sampled_is_the_policy(c: Components, rollout: Rollout) -> bool:
    """Whether the rollout's own log-probs serve as the old policy's (see ``build_experience``)."""
    return (rollout.trained_distribution and rollout.sampler_logprobs is not None
            and rollout.sampler_entropy is not None and c.updates_per_step == 1
            and c.compute_dtype == torch.float32)
