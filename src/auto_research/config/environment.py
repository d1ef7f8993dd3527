"""The multi-turn section of a generation-level run (docs/environments.md), checked without importing the user's
code (``train/prepare.py`` does that, on a dataset row, before any model is loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from auto_research.config.fields import setting
from auto_research.envs.deadline import CONCURRENCY
from auto_research.errors import UserError

OBSERVATION_TOKENS = 256
"""--max-observation-tokens's default, with --max-trajectory-tokens unset: room of the environment's own per turn,
so that an observation never eats the model's (--max-new-tokens a turn)."""


@dataclass(frozen=True)
class TurnsSection:
    """Multi-turn rollouts: an environment, tools, or the user's own rollout function, and their bounds."""

    environment: str | None = setting(None, "module:factory (from the working folder) or path/file.py:factory: "
                                            "make_env(row) returns an object with reset() and step(text) -> "
                                            "(observation, reward, done), talked to for up to --max-turns turns "
                                            "(TRL's environment_factory shape too)", "environment")
    tools: str | None = setting(None, "module:fn,path/file.py:fn,...: plain functions the model may call (their "
                                      "type hints and docstrings are the schema shown through the chat template)",
                                "environment")
    rollout_function: str | None = setting(None, "module:fn or path/file.py:fn: your own rollout loop, "
                                                 "fn(rows, context) -> one dict per trajectory with prompt_ids, "
                                                 "completion_ids, logprobs, loss_mask and reward "
                                                 "(context.generate draws from the run's sampler; "
                                                 "instead of --environment and --tools)", "environment")
    max_turns: int = setting(4, "the most model turns of a trajectory with --environment or --tools; one that "
                                "reaches it (or --max-trajectory-tokens) is flagged truncated", "environment",
                             type=int)
    env_timeout: float = setting(60.0, "seconds an environment's make_env(row), reset(), step() or get_reward() may "
                                       "take; one that runs past it fails its sample (unscored, counted in "
                                       "env_timeouts) and the run goes on; 0: no limit", "environment", type=float)
    tool_timeout: float = setting(30.0, "seconds a tool call may take; one that runs past it fails its sample "
                                        "(counted in tool_timeouts) and the run goes on; 0: no limit",
                                  "environment", type=float)
    env_concurrency: int = setting(CONCURRENCY, "calls into different trajectories' environments and tools made "
                                                "at once (under --env-timeout or --tool-timeout): a hung environment "
                                                "costs a step one limit, not one per row; 1: one call at a time, in "
                                                "order", "environment", type=int)
    max_trajectory_tokens: int | None = setting(None, "the most tokens after the prompt in a multi-turn trajectory, "
                                                      "the model's and the environment's (default: the model's "
                                                      "--max-new-tokens × --max-turns plus the environment's "
                                                      "--max-observation-tokens × (--max-turns − 1))",
                                                "environment", type=int)
    max_observation_tokens: int | None = setting(None, "the most tokens of what answers one model turn (the "
                                                       "environment's observation or the tools' results, with the "
                                                       "chat template's tokens around them), cut to fit",
                                                 "environment", type=int,
                                                 default_text=f"{OBSERVATION_TOKENS}; with --max-trajectory-tokens "
                                                              "given, the trajectory's room alone")

    @property
    def multi_turn(self) -> bool:
        """A sample may be longer than one completion: an environment, tools or a rollout function."""
        return bool(self.environment or self.tools or self.rollout_function)

    def trajectory_tokens(self, max_new_tokens: int, multi_turn: bool | None = None) -> int:
        """The most tokens after the prompt a sample may hold: one completion of ``max_new_tokens`` without an
        environment (``multi_turn``: an environment or tools given from Python, as the flags)."""
        if not (self.multi_turn if multi_turn is None else multi_turn):
            return max_new_tokens
        if self.max_trajectory_tokens:
            return self.max_trajectory_tokens
        return max_new_tokens * self.max_turns + self.observation_tokens() * (self.max_turns - 1)

    def observation_tokens(self) -> int | None:
        """The most tokens of what answers one reply: --max-observation-tokens; by default room of its own beside
        the model's, or with --max-trajectory-tokens given none but the trajectory's room (None)."""
        if self.max_observation_tokens is not None:
            return self.max_observation_tokens
        return OBSERVATION_TOKENS if self.max_trajectory_tokens is None else None

    def engine_tokens(self, max_new_tokens: int, multi_turn: bool | None = None) -> int:
        """The most tokens a sampling engine adds to a prompt: a trajectory's, and the last turn's draw (cut to
        the trajectory's room after it is drawn). ``multi_turn``: as for ``trajectory_tokens``."""
        multi_turn = self.multi_turn if multi_turn is None else multi_turn
        return self.trajectory_tokens(max_new_tokens, multi_turn) + (max_new_tokens if multi_turn else 0)

    def check(self) -> None:
        for flag, seconds in (("--env-timeout", self.env_timeout), ("--tool-timeout", self.tool_timeout)):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise UserError(f"{flag} must be a number of seconds >= 0 (0: no limit), got {seconds}")
        if self.max_turns < 1:
            raise UserError(f"--max-turns must be >= 1, got {self.max_turns}")
        for flag, value in (("--max-trajectory-tokens", self.max_trajectory_tokens),
                            ("--max-observation-tokens", self.max_observation_tokens)):
            if value is not None and value < 1:
                raise UserError(f"{flag} must be >= 1, got {value}")
        if self.env_concurrency < 1:
            raise UserError(f"--env-concurrency must be >= 1 (1: one call at a time), got {self.env_concurrency}")

    def check_loops(self, algorithm, environment: bool = False, rollout_function: bool = False) -> None:
        """A rollout function is its own loop, without --environment or --tools; none of them runs with an algorithm
        whose baseline is one greedy completion. ``environment``, ``rollout_function``: given from Python."""
        own = bool(self.rollout_function or rollout_function)
        talks = bool(self.environment or self.tools or environment)
        if own and talks:
            raise UserError("--rollout-function runs its own loop: give it without --environment and --tools")
        if (own or talks) and algorithm.needs_greedy:
            flags = "--rollout-function" if own else "--environment/--tools"
            raise UserError(f"{flags} with {algorithm.name} is not built (its greedy baseline is one single-turn "
                            "completion)")
