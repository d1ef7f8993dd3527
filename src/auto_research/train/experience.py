"""The trainer's first phase (log π_old, π_ref, entropy, values, the per-token signal streams of ``SIGNAL_SOURCES``),
and the values the rollout side hands it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from auto_research.example import Example
from auto_research.algorithms.correction import importance_weights, mismatch
from auto_research.algorithms.estimators import overlong_penalty
from auto_research.algorithms.losses import last_token
from auto_research.engine.logprobs import completion_values, kl_per_token, token_logprobs
from auto_research.engine.rollout import Rollout
from auto_research.train.components import Models, RunContext
from auto_research.train.micro_batches import micro_batches, rows_of


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
    unscored: int = 0  # the counts are over every rank: completions unscored, all, unscored for an invalid reward
    samples: int = 0
    invalid: int = 0
    causes: dict = field(default_factory=dict)
    """{why a completion is unscored: how many}, over every rank (a plain None is not listed)."""
    functions: dict = field(default_factory=dict)
    """Each reward function's ``reward/<name>`` (the mean) and ``reward/<name>.std`` (``rollouts.function_figures``)."""
    streams: dict = field(default_factory=dict)
    """Stream name → (B, T) its values from outside (``signals``: a teacher's log-probs; 0 on an unscored row)."""
    counts: dict = field(default_factory=dict)
    """Their counts for the step's row ({metric name: count}), over every rank."""

    def to(self, device) -> "Scores":
        """The per-completion tensors on ``device`` (the rewards are computed on the CPU)."""
        greedy = None if self.greedy_rewards is None else self.greedy_rewards.to(device)
        return replace(self, rewards=self.rewards.to(device), scored=self.scored.to(device), greedy_rewards=greedy,
                       streams={name: values.to(device) for name, values in self.streams.items()})


@dataclass(frozen=True)
class Experience:
    """One step's rollout and everything computed from it without gradient (B completions, T tokens)."""

    rollout: Rollout
    scores: Scores
    old_logprobs: torch.Tensor
    """(B, T) log π of the policy that sampled: the ratios' denominator."""
    entropy: torch.Tensor
    """(B, T) per-token entropy of that policy."""
    streams: dict
    """Name → (B, T) per-token signal, one for each source the run has (``SIGNAL_SOURCES``)."""
    reference_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """(B, T) the critic's V(s_t) (PPO)."""
    rollout_weights: torch.Tensor | None = None
    """(B, T) each token's importance weight for a sampler other than the trainer (--rollout-correction), or None."""
    drift: dict | None = None
    """This process's sums of the sampler/trainer log-prob mismatch (``correction.mismatch``)."""

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) the model's own tokens (a multi-turn trajectory's environment and tool tokens are 0)."""
        return self.rollout.trained_mask.float()


def widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, c) → (b, width), zeros on the right: a trimmed micro-batch's output at the batch's width."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1])) if values.shape[1] < width else values


def no_grad_forward(run: RunContext, model, rollout: Rollout, function, **options):
    """``function`` over the rollout in micro-batches without gradient, each output row put back in its place. Each
    micro-batch is trimmed to its own widths (the same shape whichever process holds it), outputs zero-padded back."""
    rows, width = rollout.sequences.shape[0], rollout.completion_mask.shape[1]
    outputs = None
    with torch.no_grad(), run.autocast():
        pack, parts = micro_batches(run, rollout, slice(0, rows), model)
        for part in parts:
            chunk = rows_of(rollout, part)
            result = function(model, chunk.sequences, chunk.prompt_mask, chunk.completion_mask,
                              group_size=run.config.sampling.group_size, **({"pack": True} if pack else {}), **options)
            results = result if isinstance(result, tuple) else (result,)
            if outputs is None:
                outputs = [torch.zeros(rows, width, dtype=value.dtype, device=value.device) for value in results]
            for output, value in zip(outputs, results):
                output[part] = widen(value, width)
    return tuple(outputs) if isinstance(result, tuple) else outputs[0]


def build_experience(run: RunContext, models: Models, rollout: Rollout, scores: Scores, version: int | None = None,
                     reference_logprobs: torch.Tensor | None = None) -> Experience:
    """No-grad forwards: log π_ref (when a reference is held), log π_old with its entropy, the critic's values.

    The policy's forward is skipped when the step is on-policy (one update) and the sampler drew from these very
    weights' (``version``'s) unfiltered distribution in float32: its log-probs are then the policy's.
    When another engine or older weights sampled (μ), each token's term is weighted by the truncated π_old/μ: for
    the clipped losses π_old is the decoupled objective's proximal policy; for RLOO & co the one whose gradient is
    taken."""
    temperature, device, critic = run.config.sampling.temperature, run.device, models.critic
    rollout, scores = rollout.to(device), scores.to(device)  # the sampler's device may not be the trainer's
    if reference_logprobs is not None:
        reference_logprobs = reference_logprobs.to(device)
    mask = rollout.trained_mask.float()
    if reference_logprobs is None and models.reference is not None:  # (the rollout side may have computed them)
        with models.reference_in_use() as reference:
            reference_logprobs = no_grad_forward(run, reference, rollout, token_logprobs, temperature=temperature)
    if sampled_is_the_policy(run, rollout, version):
        old_logprobs, entropy = rollout.sampler_logprobs, rollout.sampler_entropy
    else:
        old_logprobs, entropy = no_grad_forward(run, models.policy, rollout, token_logprobs, temperature=temperature,
                                                with_entropy=True)
    streams = {name: stream for name, source in signal_sources().items()
               if (stream := source(run, models, rollout, scores, old_logprobs, reference_logprobs)) is not None}
    values = no_grad_forward(run, critic, rollout, completion_values) * mask if critic is not None else None
    weights = drift = None
    rollout_section = run.config.rollout
    if corrected(run.engine, rollout_section.max_staleness) and rollout.sampler_logprobs is not None:
        # Another engine or older weights sampled: how far μ is from π_old, and the weights that correct it.
        weights = importance_weights(old_logprobs - rollout.sampler_logprobs, mask,
                                     rollout_section.rollout_correction, rollout_section.rollout_correction_cap)
        drift = mismatch(old_logprobs, rollout.sampler_logprobs, mask)
    return Experience(rollout, scores, old_logprobs, entropy, streams, reference_logprobs, values, weights, drift)


def task_reward(run, models, rollout: Rollout, scores: Scores, old_logprobs, reference_logprobs) -> torch.Tensor:
    """The task's reward on each completion's last token, plus DAPO's overlong penalty (--overlong-buffer)."""
    loss, mask, rewards = run.config.loss, rollout.trained_mask.float(), scores.rewards
    if loss.overlong_buffer:
        penalty = overlong_penalty(mask.sum(1), run.config.sampling.max_new_tokens, loss.overlong_buffer,
                                   loss.overlong_penalty)
        rewards = torch.where(scores.scored, rewards + penalty, rewards)
    return last_token(mask) * rewards.unsqueeze(1)


def reference_kl(run, models, rollout: Rollout, scores: Scores, old_logprobs, reference_logprobs) -> torch.Tensor:
    """The sampling policy's KL to the reference per token, by --kl-estimator (0 without a reference)."""
    if reference_logprobs is None:
        return torch.zeros_like(old_logprobs)
    return kl_per_token(old_logprobs, reference_logprobs, run.config.loss.kl_estimator) * rollout.trained_mask.float()


SIGNAL_SOURCES: dict[str, Callable] = {"task": task_reward, "kl": reference_kl}
"""A stream's name → its source: (the run's context, its models, rollout, scores, log π_old, log π_ref or None) → the
(B, T) stream, or None where the run has none. A source reads its settings from the run's sections (the loss's)."""


def signal_sources() -> dict[str, Callable]:
    """``SIGNAL_SOURCES`` and those of the signals from outside (``signals.OUTSIDE``: a teacher's)."""
    from auto_research.train.signals import OUTSIDE  # noqa: PLC0415 - its modules read this one

    return {**SIGNAL_SOURCES, **{name: outside.signal for name, outside in OUTSIDE.items()}}


def corrected(engine, max_staleness: int) -> bool:
    """Whether μ may differ from π_old: another engine samples, or older weights (--max-staleness ≥ 1)."""
    return not engine.is_the_trainer or max_staleness > 0


def sampled_is_the_policy(run: RunContext, rollout: Rollout, version: int | None = None) -> bool:
    """Whether the rollout's own log-probs serve as the old policy's (see ``build_experience``)."""
    current = (rollout.policy_versions is None or version is None
               or bool((rollout.policy_versions == version).all()))
    return (current and rollout.trained_distribution and rollout.sampler_logprobs is not None
            and rollout.sampler_entropy is not None and run.updates_per_step == 1
            and run.compute_dtype == torch.float32)
