"""Multi-turn rollouts as the trainer's ``Rollout``: K trajectories per prompt, each talking to its own
environment (and tools), through any sampler that generates from token ids. A row's completion span is the whole
trajectory after the prompt; its ``loss_mask`` is 1 on the model's own tokens only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch

from auto_research.example import Example
from auto_research.engine.rollout import Rollout, SamplingSettings, left_padded
from auto_research.envs import EnvironmentFactory, Episode
from auto_research.envs.deadline import CONCURRENCY, each
from auto_research.envs.tools import load_tools, tool_schema
from auto_research.envs.trajectory import Conversation, Generate, Trajectory, run_episodes, turn_seed
from auto_research.errors import UserError


def load_environment(environment, tools, sample_row: dict, timeout: float = 0.0
                     ) -> tuple[EnvironmentFactory | None, dict[str, Callable]]:
    """``--environment`` and ``--tools`` (specs, or from Python a factory and functions), checked now."""
    factory = None if environment is None else EnvironmentFactory.load(environment, sample_row, timeout)
    loaded: dict[str, Callable] = {}
    for item in ([tools] if isinstance(tools, str) else list(tools or ())):
        if isinstance(item, str):
            loaded.update(load_tools(item))
        else:
            tool_schema(item)
            loaded[item.__name__] = item
    return factory, loaded


def runner_for(turns, sampling, algorithm, factory: EnvironmentFactory | None, tools: dict[str, Callable], tokenizer,
               eos: list[int], sampler, model_name: str, sample_row: dict, scores_replies: bool
               ) -> "EpisodeRunner | None":
    """The run's multi-turn runner, or None without an environment or tools; a chat template that would hide the
    tools is refused here, before any work."""
    from auto_research.envs.tools import check_template_takes_tools  # noqa: PLC0415

    if factory is None and not tools:
        return None
    if algorithm.needs_greedy:
        raise UserError(f"--environment/--tools with {algorithm.name} is not built (its greedy baseline is one "
                        "single-turn completion)")
    shown = factory.checked_episode(sample_row, tools).tools if factory is not None else tools
    if shown:
        check_template_takes_tools(tokenizer, [tool_schema(function) for function in shown.values()], model_name)
    settings = SamplingSettings(sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return EpisodeRunner(sampler.generate_ids, tokenizer, factory, tools, settings, turns.max_turns,
                         turns.trajectory_tokens(sampling.max_new_tokens, True), tuple(eos), pad, scores_replies,
                         turns.tool_timeout, turns.env_concurrency, turns.observation_tokens())


def row_of(example: Example) -> dict:
    """The dataset row an environment is made from: its fields, with ``prompt`` and ``answer``."""
    return {**example.fields, "prompt": example.prompt, "answer": example.answer}


class _Unmade(Episode):
    """An episode whose factory raised: its trajectory is left unscored (the error is its ``failed``)."""

    def __init__(self, error: Exception):
        super().__init__(None, {})
        self.error = error

    def first_message(self, prompt: str) -> str:
        raise self.error


class Runner:
    """What both runners do with their ``trajectories``: the rollout side's ``sample``, the evaluation's ``greedy``."""

    def sample(self, examples: list[Example], group_size: int, seeds: list[int]) -> Rollout:
        return trajectory_rollout(self.tokenizer, self.trajectories(examples, group_size, seeds), group_size, self.pad)

    def greedy(self, model, examples: list[Example]) -> Rollout:
        """One greedy trajectory per example from ``model``, whatever the run's sampler."""
        return replace(self, generate=greedy_generate(model, self.tokenizer)).sample(examples, 1, [0] * len(examples))


@dataclass(frozen=True)
class EpisodeRunner(Runner):
    generate: Generate
    """``generate(prompt_ids, seeds, settings)``: one completion (ids, log-probs) per prompt (``generate_ids``)."""
    tokenizer: object
    factory: EnvironmentFactory | None
    tools: dict[str, Callable] = field(default_factory=dict)
    settings: SamplingSettings = SamplingSettings(64)
    max_turns: int = 4
    max_tokens: int = 256
    """The most tokens after the prompt (the model's and the environment's)."""
    eos: tuple[int, ...] = ()
    pad: int = 0
    scores_replies: bool = True
    """Whether the reward functions score the final reply (else the environment's rewards alone count)."""
    tool_timeout: float = 0.0  # --tool-timeout; --env-timeout is the factory's
    concurrency: int = CONCURRENCY  # --env-concurrency
    observation_tokens: int | None = None
    """The most tokens of what answers one reply (None: the trajectory's room alone bounds it)."""

    def episodes(self, rows: list[dict]) -> list[Episode]:
        """One episode per row, made ``concurrency`` at a time; a factory that failed leaves its sample unscored."""
        if self.factory is None:
            return [Episode(None, row, dict(self.tools), tool_timeout=self.tool_timeout) for row in rows]
        factory = self.factory
        bound = self.concurrency if factory.timeout or self.tool_timeout else 1
        made = each([partial(factory.episode, row, self.tools, self.tool_timeout) for row in rows], bound)
        return [episode if ok else _Unmade(episode) for ok, episode in made]

    def trajectories(self, examples: list[Example], group_size: int, seeds: list[int]) -> list[Trajectory]:
        """K trajectories per example; trajectory k of prompt i draws from ``turn_seed(seeds[i], k, 0)`` alone."""
        episodes = self.episodes([row_of(example) for example in examples for _ in range(group_size)])
        tools = {name: f for e in episodes for name, f in e.tools.items()}
        schemas = [tool_schema(function) for function in tools.values()] or None
        conversation = Conversation(self.tokenizer, schemas, self.eos)
        prompts = [example.prompt for example in examples for _ in range(group_size)]
        own = [turn_seed(seed, k, 0) for seed in seeds for k in range(group_size)]
        return run_episodes(self.generate, conversation, episodes, prompts, own, self.settings, self.max_turns,
                            self.max_tokens, self.concurrency, self.observation_tokens)


def greedy_generate(model, tokenizer) -> Generate:
    """A ``generate`` that decodes greedily from ``model`` (log-probs 0): the held-out evaluation's."""
    from auto_research.engine.rollout.builtin import sample  # noqa: PLC0415

    def generate(prompt_ids, seeds, settings):
        tokens = sample(model, tokenizer, prompt_ids, 1, settings.max_new_tokens, greedy=True).token_lists()
        return tokens, [[0.0] * len(ids) for ids in tokens]

    return generate


def trajectory_rollout(tokenizer, trajectories: list[Trajectory], group_size: int, pad: int) -> Rollout:
    """The Rollout of finished trajectories: prompts left-padded, ids right-padded; a row's text is its ids decoded
    (special tokens kept), or the trajectory's own ``text``."""
    rows = len(trajectories)
    width = max(1, max(len(t.ids) for t in trajectories))
    prompt, prompt_mask = left_padded([t.prompt_ids for t in trajectories], pad)
    completion = torch.full((rows, width), pad, dtype=torch.long)
    span = torch.zeros(rows, width, dtype=torch.long)
    owned = torch.zeros(rows, width, dtype=torch.long)
    logprobs = torch.zeros(rows, width)
    for row, t in enumerate(trajectories):
        if t.ids:
            completion[row, : len(t.ids)] = torch.tensor(t.ids, dtype=torch.long)
            span[row, : len(t.ids)] = 1
            owned[row, : len(t.ids)] = torch.tensor(t.loss_mask, dtype=torch.long)
            logprobs[row, : len(t.ids)] = torch.tensor(t.logprobs, dtype=torch.float32)
    texts = [tokenizer.decode(t.ids, skip_special_tokens=False) if t.text is None else t.text for t in trajectories]
    episodes = [{"turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
                 "truncated": t.truncated, "environment_reward": t.reward, "failed": t.failed,
                 "timed_out": t.timed_out, "limit": t.limit,
                 "reply": next((m["content"] for m in reversed(t.messages) if m["role"] == "assistant"), "")}
                for t in trajectories]
    return Rollout(torch.cat([prompt, completion], dim=1), prompt_mask, span, texts, group_size, logprobs * owned,
                   None, False, None, owned, episodes)


def episode_rewards(reward: Callable, prompts: list[str], rollout: Rollout, examples: list[Example],
                    scores_replies: bool = True) -> list:
    """Each trajectory's reward: the environment's rewards summed, plus the reward functions on its final reply
    (when ``scores_replies``); None when the environment raised, or when nothing scored it."""
    replies = [row["reply"] for row in rollout.episodes]
    scored = reward(prompts, replies, examples, rollout.token_lists()) if scores_replies else [None] * len(replies)
    return [None if row["failed"] is not None
            or (value is None and (scores_replies or row["environment_reward"] is None))
            else (row["environment_reward"] or 0.0) + (value or 0.0) for row, value in zip(rollout.episodes, scored)]


def episode_figures(world, rollout: Rollout) -> dict:
    """The trajectories' figures over every rank: turns, tool calls and errors, truncations, failures, timeouts."""
    per_row = [[1, r["turns"], r["tool_calls"], r["tool_errors"], bool(r["truncated"]), r["failed"] is not None,
                r.get("timed_out") == "environment", r.get("timed_out") == "tool"] for r in rollout.episodes or []]
    sums = world.total(torch.tensor([float(sum(column)) for column in zip(*per_row)] or [0.0] * 8, dtype=torch.float64))
    count, turns, calls, errors, cut, failed, environment_timeouts, tool_timeouts = sums.tolist()
    count = max(count, 1.0)
    return {"turns_mean": turns / count, "tool_calls_mean": calls / count, "tool_errors": int(errors),
            "truncated_fraction": cut / count, "environment_errors": int(failed),
            "env_timeouts": int(environment_timeouts), "tool_timeouts": int(tool_timeouts)}


def environment_failures(rollout: Rollout) -> str | None:
    """Why a step's samples are unscored: the environment's failures (the first in its own words), or, when every
    trajectory was cut off, the flags that cut them, to raise. None otherwise."""
    rows = rollout.episodes or ()
    failures = [row["failed"] for row in rows if row.get("failed") is not None]
    if failures:
        return (f"the environment failed on {len(failures)} of {len(rows)} samples (the first: "
                f"{failures[0]})")
    limits = Counter(row.get("limit") for row in rows if row.get("truncated"))
    if not rows or sum(limits.values()) < len(rows) or None in limits:
        return None
    ordered = sorted(limits.items(), key=lambda item: -item[1])
    where = (f" at {ordered[0][0]}" if len(ordered) == 1 else
             ": " + ", ".join(f"{count} at {limit}" for limit, count in ordered))
    flags = " or ".join(dict.fromkeys(limit.split()[0] for limit, _ in ordered))
    return (f"every trajectory was cut off before its environment ended it ({len(rows)} of {len(rows)} truncated"
            f"{where}), so none has a reward: raise {flags}")
