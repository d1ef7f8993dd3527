"""The rollout side of a run: draw prompts → sample → score, one frozen batch per step, each row tagged with the
policy version that drew it, for the trainer side (``side.take(step)``, then ``side.publish(step, policy)``).

Step s's batch is drawn by weights version ``drawing_version(s, K)`` = max(0, s − 1 − K), version v being the policy
after v steps (K = 0: drawn when the trainer asks, with the weights it is about to update). Nothing here runs a
collective (the side may live in a thread): every rank's agreement is the trainer's, in ``agreed_scores``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from auto_research.example import Example
from auto_research.engine.rollout import Rollout, Sampler, concatenate, prompt_seed
from auto_research.errors import RewardError
from auto_research.rewards.combine import Scored, checked, invalid_count, reward_problem
from auto_research.train.dynamic import REFILL_SEED_OFFSET, fill, has_signal, refill_index
from auto_research.train.experience import Batch, Scores


def drawing_version(step: int, max_staleness: int) -> int:
    """The weights version that draws step ``step``'s batch (steps count from 1, versions from 0)."""
    return max(0, step - 1 - max_staleness)


@dataclass(frozen=True)
class RolloutSource:
    """What the rollout side needs, and nothing of the trainer's."""

    prompts: list[str]
    examples: list[Example]
    seed: int
    prompts_per_step: int
    group_size: int
    share: Callable[[list], list]
    """This rank's share of a step's prompts (whole mini-batches; no collective)."""
    sampler: Sampler
    reward: Callable
    greedy: Callable[[list[str]], Rollout] | None = None
    """One greedy completion per prompt (ReMax's baseline), from the weights that sample."""
    reference: Callable[[Rollout], torch.Tensor] | None = None
    """log π_ref of the completion tokens, when the rollout side computes them; None: the trainer does."""
    max_refills: int | None = None
    """Dynamic sampling (``dynamic.py``): refills a slot without signal may take; None: off."""
    pad_token_id: int = 0
    episodes: object | None = None
    """Multi-turn trajectories (envs.rollout.EpisodeRunner over this source's sampler), or None: one completion."""
    scorers: dict = field(default_factory=dict)
    """Stream name → (rollout, its rows' examples) → ``RowScores``: what asks outside once a batch (``signals``)."""


@dataclass(frozen=True)
class Drawn:
    """One step's frozen batch as the rollout side hands it over: sampled and scored on this rank."""

    step: int
    batch: Batch
    rollout: Rollout
    """With ``policy_versions``: the weights version that drew each row."""
    rewards: list | None
    """This rank's task rewards, None where the reward could not score (None when it failed)."""
    greedy_rewards: list | None
    failure: str | None
    """The reward's error (RewardError's message), raised on every rank by ``agreed_scores``."""
    numpy_after: dict
    """The prompt generator's state after this batch was drawn (what a checkpoint saves)."""
    seconds: dict
    """sample, score (with the reference's forward, when here), idle (waiting for weights)."""
    reference_logprobs: torch.Tensor | None = None
    """(B, T) log π_ref of the completion tokens (``RolloutSource.reference``), or None."""
    counts: dict | None = None
    """This rank's groups sampled, those without signal among them, refills and those trained without signal
    (dynamic sampling; ``signal_counts`` without it)."""
    outside: dict = field(default_factory=dict)
    """Stream name → the batch's ``RowScores`` (``RolloutSource.scorers``)."""


def draw_batch(source: RolloutSource, rng: np.random.Generator, step: int) -> Batch:
    """Distinct prompts, the same on every rank (one generator), and this rank's share of them."""
    picks = rng.choice(len(source.prompts), size=source.prompts_per_step, replace=False)
    picks = [int(index) for index in source.share(list(picks))]
    return batch_of(source, picks, [prompt_seed(source.seed, step, index) for index in picks])


def batch_of(source: RolloutSource, indices: list[int], seeds: list[int]) -> Batch:
    return Batch(indices, [source.prompts[i] for i in indices], [source.examples[i] for i in indices], seeds)


def produce(source: RolloutSource, rng: np.random.Generator, step: int, version: int, idle: float = 0.0,
            loading: float = 0.0) -> Drawn:
    """Draw step ``step``'s prompts, sample them with the weights of ``version``, score them (this rank's)."""
    started = time.perf_counter()
    batch = draw_batch(source, rng, step)
    numpy_after = rng.bit_generator.state
    rollout = sample_batch(source, batch)
    seconds = {"sample": time.perf_counter() - started + loading, "idle": idle}
    return finish(source, step, version, batch, rollout, numpy_after, seconds)


def finish(source: RolloutSource, step: int, version: int, batch: Batch, rollout: Rollout, numpy_after: dict,
           seconds: dict, reference: torch.Tensor | None = None) -> Drawn:
    """A sampled batch scored (refilled with dynamic sampling), with its reference log-probs (``reference``: those
    computed already); each row tagged with ``version``, unless its tokens carry their own (partial rollouts)."""
    if rollout.token_versions is None:
        rollout = replace(rollout, policy_versions=torch.full((rollout.sequences.shape[0],), version, dtype=torch.long))
    sampled = time.perf_counter()
    greedy = source.greedy(batch.prompts) if source.greedy is not None else None
    rewards = greedy_rewards = failure = None
    try:
        rewards = score(source, batch, rollout)
        greedy_rewards = checked(source.reward(batch.prompts, greedy.completions, batch.examples)) if greedy else None
    except RewardError as error:
        failure = str(error)
    counts = signal_counts(rewards, source.group_size) if failure is None else None
    if source.max_refills is not None and failure is None:
        try:
            batch, rollout, rewards, counts = refill(source, step, batch, rollout, rewards)
        except RewardError as error:
            failure = str(error)
        rollout = replace(rollout, policy_versions=torch.full((rollout.sequences.shape[0],), version,
                                                              dtype=torch.long))
    if source.reference is None or failure is not None:
        reference = None
    elif reference is None:
        reference = source.reference(rollout)
    outside = {name: scorer(rollout, batch.examples) for name, scorer in source.scorers.items()}  # (every rank)
    seconds = {**seconds, "score": time.perf_counter() - sampled}
    return Drawn(step, batch, rollout, rewards, greedy_rewards, failure, numpy_after, seconds, reference, counts,
                 outside)


def sample_batch(source: RolloutSource, batch: Batch) -> Rollout:
    """K completions of each prompt, or K multi-turn trajectories with an environment or tools."""
    if source.episodes is not None:
        return source.episodes.sample(batch.examples, source.group_size, batch.seeds)
    return source.sampler.sample(batch.prompts, source.group_size, batch.seeds)


def score(source: RolloutSource, batch: Batch, rollout: Rollout) -> Scored:
    """Each sample's task reward (None: unscored, or invalid: ``combine.checked``); a trajectory's is its
    environment's plus the reward functions' on its final reply (``envs.rollout.episode_rewards``)."""
    K = source.group_size
    prompts, examples = [p for p in batch.prompts for _ in range(K)], [e for e in batch.examples for _ in range(K)]
    if rollout.episodes is not None:
        from auto_research.envs.rollout import episode_rewards  # noqa: PLC0415

        replies = []  # what the reward functions gave the final replies: their parts and causes

        def reward(*arguments):
            replies.append(source.reward(*arguments))
            return replies[-1]

        values = episode_rewards(reward, prompts, rollout, examples, source.episodes.scores_replies)
        return _episode_scores(values, rollout.episodes, replies[0] if replies else None)
    return checked(source.reward(prompts, rollout.completions, examples, rollout.token_lists()))


def _episode_scores(values: list, episodes: list[dict], replies) -> Scored:
    """A batch of trajectories' rewards, checked: an environment's own invalid reward (NaN, ±inf, too large) is
    that trajectory's failure, named; the reward functions' parts and causes are kept."""
    values, causes = list(values), list(getattr(replies, "causes", None) or [None] * len(values))
    for index, row in enumerate(episodes):
        problem = None if row["environment_reward"] is None else reward_problem(row["environment_reward"])
        if problem is not None:
            values[index], causes[index] = None, f"the environment's reward was {problem}"
    return checked(values, "the environment's reward plus the reward functions'", getattr(replies, "parts", None),
                   causes)


def signal_counts(rewards: list, group_size: int, refills: int = 0, trained_no_signal: int | None = None) -> dict:
    groups = [rewards[start: start + group_size] for start in range(0, len(rewards), group_size)]
    no_signal = sum(not has_signal(group) for group in groups)
    return {"groups_sampled": len(groups), "no_signal_sampled": no_signal, "refills": refills,
            "trained_no_signal": no_signal if trained_no_signal is None else trained_no_signal}


def refill(source: RolloutSource, step: int, batch: Batch, rollout: Rollout, rewards: list):
    """Dynamic sampling (``dynamic.py``): each of this rank's slots whose group has no signal is refilled until
    one has, at most ``max_refills`` times; the batch, rollout and rewards the step trains on, and the counts."""
    K = source.group_size
    slots = source.share(list(range(source.prompts_per_step)))
    rounds = {0: (batch, rollout, rewards)}

    def sample_round(number: int, tries: list[tuple[int, int]]) -> list[list]:
        seeds = [prompt_seed(source.seed, step, REFILL_SEED_OFFSET * number + slot) for slot, _ in tries]
        drawn = batch_of(source, [index for _, index in tries], seeds)
        sampled = sample_batch(source, drawn)
        scores = score(source, drawn, sampled)
        rounds[number] = (drawn, sampled, scores)
        return [scores[start: start + K] for start in range(0, len(scores), K)]

    filled = fill(slots, [rewards[i * K: (i + 1) * K] for i in range(len(slots))], sample_round, source.max_refills,
                  lambda slot, number: refill_index(source.seed, step, slot, number, len(source.prompts)))
    counts = {key: value for key, value in vars(filled).items() if key != "chosen"}  # signal_counts' keys
    if not filled.refills:
        return batch, rollout, rewards, counts
    parts = [(rounds[number], position) for number, position in filled.chosen]
    chosen = Batch([b.indices[i] for (b, _, _), i in parts], [b.prompts[i] for (b, _, _), i in parts],
                   [b.examples[i] for (b, _, _), i in parts], [b.seeds[i] for (b, _, _), i in parts])
    pieces = concatenate([r.rows(i * K, (i + 1) * K) for (_, r, _), i in parts], source.pad_token_id)
    scores = Scored.join([s.rows(i * K, (i + 1) * K) for (_, _, s), i in parts])
    return chosen, pieces, scores, counts


def agreed_scores(world, drawn: Drawn, step: int, group_size: int) -> Scores:
    """The rollout's task rewards, agreed over every rank: a reward that failed on one rank stops every rank; a step
    in which no completion could be scored is an error that says why (each cause, how many it struck)."""
    world.agree(RewardError(drawn.failure) if drawn.failure is not None else None, RewardError)
    values = drawn.rewards
    scored = torch.tensor([value is not None for value in values])
    here = list(getattr(values, "causes", None) or [None] * len(values))
    for outside in drawn.outside.values():  # a row a stream from outside could not score is unscored, with its cause
        here = [cause if not ok else failure for cause, ok, failure in zip(here, scored.tolist(), outside.failures)]
        scored = scored & outside.scored
    rewards = torch.tensor([0.0 if value is None else value for value in values])
    unscored, total, invalid = (int(x) for x in world.total(torch.tensor(
        [int((~scored).sum()), len(values), invalid_count(values)])))
    causes = {}
    if unscored:  # on every rank alike: the gather is a collective
        for part in world.gather_objects(Counter(cause for cause in here if cause)):
            causes.update({cause: causes.get(cause, 0) + count for cause, count in part.items()})
    if unscored == total:
        from auto_research.envs.rollout import environment_failures  # noqa: PLC0415

        reason = environment_failures(drawn.rollout) or unscored_reasons(causes, unscored, total, "completions")
        raise RewardError(f"no sample of step {step} could be scored: {reason}")
    greedy_rewards = None
    if drawn.greedy_rewards is not None:
        greedy_rewards = torch.tensor([0.0 if v is None else v for v in drawn.greedy_rewards]).repeat_interleave(
            group_size)
    counts = {name: count for outside in drawn.outside.values() for name, count in outside.counts.items()}
    if counts:  # (the same names on every rank: the same signals)
        counts = dict(zip(counts, (int(x) for x in world.total(torch.tensor(list(counts.values()))))))
    return Scores(rewards, scored, greedy_rewards, unscored, total, invalid, causes,
                  function_figures(world, getattr(values, "parts", {})),
                  {name: outside.values for name, outside in drawn.outside.items()}, counts)


def unscored_reasons(causes: dict, unscored: int, total: int, noun: str) -> str:
    """"reward 'f' returned nan for all 4 completions", or each cause with its count, most frequent first (a
    plain None is "the reward returned None")."""
    counted = dict(causes)
    if unscored > sum(causes.values()):
        counted["the reward returned None"] = unscored - sum(causes.values())
    ordered = sorted(counted.items(), key=lambda item: -item[1])
    (first, count), rest = ordered[0], ordered[1:]
    share = f"all {count}" if count == total else f"{count} of {total}"
    return f"{first} for {share} {noun}" + "".join(f", {cause} for {number}" for cause, number in rest)


def function_figures(world, parts: dict) -> dict:
    """Each reward function's mean and population std over every rank's samples it scored: ``reward/<name>`` and
    ``reward/<name>.std`` (None where none; not ``/std``: MLflow's file store cannot make a metric's path a folder)."""
    if not parts:
        return {}
    sums = world.total(torch.tensor([[sum(v for v in part if v is not None), sum(v * v for v in part if v is not None),
                                      sum(v is not None for v in part)] for part in parts.values()],
                                    dtype=torch.float64))
    figures = {}
    for name, (total, squares, count) in zip(parts, sums.tolist()):
        mean = total / count if count else None
        figures[f"reward/{name}"] = mean
        figures[f"reward/{name}.std"] = math.sqrt(max(squares / count - mean * mean, 0.0)) if count else None
    return figures


def rollout_figures(world, drawn: Drawn, step: int, dynamic: bool = False) -> dict:
    """Over every rank: the staleness of the samples, the rollout side's times for this batch, and the groups
    without signal (``dynamic.has_signal``) among those sampled (with dynamic sampling, also those trained on,
    refills and prompts sampled)."""
    staleness, spans = token_staleness(world, drawn.rollout, step)
    counts = drawn.counts or signal_counts([], 1)
    sampled, no_signal, refills, trained = (int(x) for x in world.total(torch.tensor(
        [counts["groups_sampled"], counts["no_signal_sampled"], counts["refills"], counts["trained_no_signal"]])))
    figures = {"staleness_mean": float(staleness.mean()), "staleness_max": int(staleness.max()), **spans,
               "time_sample": drawn.seconds["sample"], "time_sampler_idle": drawn.seconds["idle"],
               "no_signal_groups": no_signal, "no_signal_fraction": no_signal / max(sampled, 1)}
    if drawn.rollout.episodes is not None:
        from auto_research.envs.rollout import episode_figures  # noqa: PLC0415

        figures.update(episode_figures(world, drawn.rollout))
    if dynamic:
        figures.update(trained_no_signal_fraction=trained / max(sampled - refills, 1), refills=refills,
                       prompts_sampled=sampled)
    return figures


def token_staleness(world, rollout: Rollout, step: int) -> tuple[torch.Tensor, dict]:
    """Each trained token's staleness (versions between the weights that drew it and version step − 1) over every
    rank (a row's own without ``token_versions``), and with them ``versions_per_sequence_max``."""
    if rollout.token_versions is None:
        return world.gather(((step - 1) - rollout.policy_versions).double()), {}
    versions, mask = rollout.token_versions.cpu(), rollout.completion_mask.cpu().bool()
    lags = ((step - 1) - versions[mask]).double()
    width = int(world.total(torch.tensor([lags.numel()])).item() if world.distributed else lags.numel())
    gathered = world.gather(torch.nn.functional.pad(lags, (0, width - lags.numel()), value=float("nan")))
    spans = max((len(set(row[row >= 0].tolist())) for row in versions), default=0)
    spans = int(world.gather(torch.tensor([spans])).max())
    return gathered[~gathered.isnan()], {"versions_per_sequence_max": spans}
