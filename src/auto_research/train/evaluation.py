"""Held-out evaluation: greedy completions, exact-match accuracy, reward, entropy and KL. Entropy and KL(π ‖ π_ref)
are exact over the whole vocabulary (no sampling noise): ``entropy`` per token, ``kl_from_reference`` summed over a
completion and averaged over prompts, as the rows' ``entropy`` and ``kl``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from auto_research.engine.logprobs import completion_logits
from auto_research.engine.rollout.builtin import sample
from auto_research.envs.rollout import episode_rewards
from auto_research.errors import RewardError
from auto_research.rewards.combine import checked
from auto_research.rewards.gold import win_rate as judged
from auto_research.rewards.verifiers import is_correct


def _distributions(model, rollout, temperature: float) -> torch.Tensor:
    logits = completion_logits(model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask, temperature)
    return torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def evaluate(model, reference, tokenizer, prompts: list[str], examples, verifier: str, reward, max_new_tokens: int,
             temperature: float = 1.0, batch_size: int = 64, shard: tuple[int, int] = (0, 1),
             total=lambda tensor: tensor, gold=None, completions: dict | None = None, details: dict | None = None,
             detail_count: int = 0, episodes=None) -> dict[str, float]:
    """accuracy (None without a verifier), mean_reward, entropy and kl_from_reference of greedy completions.
    ``shard`` = (rank, size) deals out the fixed batches (b to rank b mod size), ``total`` adds the sums up: every batch
    is the one a single process would evaluate. ``completions`` and ``details`` receive this rank's completions (and
    rewards, verdicts for the first ``detail_count``); ``episodes``: multi-turn trajectories, ``turns_mean`` added."""
    tally = _Tally()
    rank, size = shard
    for start in range(rank * batch_size, len(prompts), batch_size * size):
        batch_prompts = prompts[start : start + batch_size]
        batch_examples = examples[start : start + batch_size]
        rollout, replies = _greedy(model, tokenizer, batch_prompts, batch_examples, max_new_tokens, episodes)
        if episodes is not None:
            tally.turns += [row["turns"] for row in rollout.episodes]
        # Rows without answers (verifier None) have no verdicts: accuracy is null, the mean reward says how it did.
        verdicts = [is_correct(verifier, text, example) if verifier else None
                    for text, example in zip(replies, batch_examples)]
        tally.correct += verdicts
        values = _rewards(reward, batch_prompts, rollout, batch_examples, episodes)
        tally.rewards += [value for value in values if value is not None]
        if details is not None:
            details.update({start + i: (text, value, verdict)
                            for i, (text, value, verdict) in enumerate(zip(rollout.completions, values, verdicts))
                            if start + i < detail_count})
        if gold is not None:
            tally.golds += gold(batch_prompts, rollout.completions, batch_examples)
        if completions is not None:
            completions.update({start + i: text for i, text in enumerate(rollout.completions)})
        _measure(model, reference, rollout, temperature, len(batch_prompts), tally)
    return _summary(tally, len(prompts), total, verifier, gold is not None, episodes is not None)


@dataclass
class _Tally:
    """This rank's figures, one entry per held-out prompt, summed across ranks at the end."""

    correct: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    entropies: list = field(default_factory=list)
    kls: list = field(default_factory=list)
    golds: list = field(default_factory=list)
    turns: list = field(default_factory=list)
    tokens: list = field(default_factory=list)


def _greedy(model, tokenizer, prompts: list[str], examples, max_new_tokens: int, episodes):
    """A batch's greedy rollout and the replies the verifier reads (with ``episodes``, each final reply)."""
    if episodes is None:
        rollout = sample(model, tokenizer, prompts, 1, max_new_tokens, greedy=True)
        return rollout, rollout.completions
    rollout = episodes.greedy(model, examples)
    return rollout, [row["reply"] for row in rollout.episodes]


def _rewards(reward, prompts: list[str], rollout, examples, episodes) -> list:
    """Each completion's reward, None where it could not be scored (an invalid value too, as in training)."""
    if episodes is not None:
        values = episode_rewards(reward, prompts, rollout, examples, episodes.scores_replies)
    elif getattr(reward, "takes_completion_ids", False):
        values = reward(prompts, rollout.completions, examples, rollout.token_lists())
    else:
        values = reward(prompts, rollout.completions, examples)
    return checked(values)


def _measure(model, reference, rollout, temperature: float, rows: int, tally: _Tally) -> None:
    """Each completion's exact entropy and KL(π ‖ π_ref) over its trained tokens, and their count."""
    mask = rollout.trained_mask.float()
    log_p = _distributions(model, rollout, temperature)
    tally.entropies += (-(log_p.exp() * log_p).sum(-1) * mask).sum(-1).tolist()
    tally.tokens += mask.sum(-1).tolist()
    if reference is None:
        tally.kls += [0.0] * rows
    else:
        log_q = _distributions(reference, rollout, temperature)
        tally.kls += ((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum(-1).tolist()


def _summary(tally: _Tally, prompts: int, total, verifier: str | None, gold: bool, episodes: bool) -> dict[str, float]:
    """The ranks' sums added up, then the figures (accuracy and KL per prompt, entropy per token)."""
    count = max(prompts, 1)
    sums = total(torch.tensor([sum(map(bool, tally.correct)), sum(tally.rewards), len(tally.rewards),
                               sum(tally.entropies), sum(tally.kls), sum(tally.golds), sum(tally.turns),
                               sum(tally.tokens)], dtype=torch.float64))
    correct_count, reward_sum, scored, entropy_sum, kl_sum, gold_sum, turn_sum, token_count = sums.tolist()
    extra = {"gold_reward": gold_sum / count} if gold else {}
    if episodes:
        extra["turns_mean"] = turn_sum / count
    return {
        **extra,
        "accuracy": correct_count / count if verifier else None,
        # None when the reward could score no held-out completion (written as null, shown as n/a).
        "mean_reward": reward_sum / scored if scored else None,
        "entropy": entropy_sum / max(token_count, 1.0),  # per token, as the rows' entropy
        "kl_from_reference": kl_sum / count,
    }


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task, max_new_tokens: int = 8) -> float | None:
    """Exact-match accuracy of greedy completions on the task's held-out prompts (None: rows without answers)."""
    if task.verifier is None:
        return None
    correct = 0
    for start in range(0, len(task.evaluation), 128):
        batch = task.evaluation[start : start + 128]
        rollout = sample(model, tokenizer, [example.prompt for example in batch], 1, max_new_tokens, greedy=True)
        correct += sum(is_correct(task.verifier, text, example) for text, example in zip(rollout.completions, batch))
    return correct / max(len(task.evaluation), 1)


def held_out(run, models, drawing, completions: dict | None = None, table: list | None = None) -> dict:
    """Held-out evaluation of a run's policy over every rank. ``completions`` (a dict) receives every prompt's greedy
    completion by index; ``table`` (a list), the completion table of the first --log-completions prompts."""
    failure, result, mine, details = None, None, {}, {}
    task, sampling, world = run.task, run.config.sampling, run.world
    with models.reference_in_use() as reference, run.sampling(models.policy)(reference):
        try:
            result = evaluate(models.policy, reference, run.tokenizer, drawing.eval_prompts, task.evaluation,
                              task.verifier, drawing.reward, sampling.max_new_tokens, sampling.temperature,
                              shard=(world.rank, world.size), total=world.total, gold=task.gold,
                              completions=mine if completions is not None else None,
                              details=details if table is not None else None,
                              detail_count=run.config.logging.log_completions, episodes=drawing.episodes)
        except RewardError as error:
            failure = error
    world.agree(failure, RewardError)
    if completions is not None:
        for part in world.gather_objects(mine):
            completions.update(part)
    if table is not None:
        found = {}
        for part in world.gather_objects(details):
            found.update(part)
        table += [{"prompt": task.evaluation[index].prompt, "completion": text,
                   "answer": task.evaluation[index].answer, "reward": reward, "correct": correct}
                  for index, (text, reward, correct) in sorted(found.items())]
    return result


def win_rate(run, drawing, baseline_completions: list[str], new: list[str]) -> float:
    """Held-out win rate of ``new`` greedy completions against the starting policy's, judged both ways round."""
    total, count = judged(drawing.judge, run.config.rewards.judge, drawing.eval_prompts, run.task.evaluation, new,
                          baseline_completions)
    return total / max(count, 1.0)

