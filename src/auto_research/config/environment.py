"""The multi-turn settings of a generation-level run (docs/environments.md): an environment made per trajectory,
tools the model may call, and the most turns a trajectory takes. Checked without importing the user's code (that
is ``train/prepare.py``'s, on a dataset row, before any model is loaded)."""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.config.fields import setting
from auto_research.errors import UserError


@dataclass
class EnvironmentSettings:
    environment: str | None = setting(None, "module:factory (or path/file.py:factory): make_env(row) returns an "
                                            "object with reset() and step(text) -> (observation, reward, done), "
                                            "talked to for up to --max-turns turns (TRL's environment_factory "
                                            "shape too)", "environment")
    tools: str | None = setting(None, "module:fn,module:fn: plain functions the model may call (their type hints "
                                      "and docstrings are the schema shown through the chat template)",
                                "environment")
    max_turns: int = setting(4, "the most model turns of a trajectory with --environment or --tools; one that "
                                "reaches it (or --max-trajectory-tokens) is flagged truncated", "environment",
                             type=int)
    max_trajectory_tokens: int | None = setting(None, "the most tokens after the prompt in a multi-turn trajectory, "
                                                      "the model's and the environment's (default: --max-new-tokens "
                                                      "× --max-turns)", "environment", type=int)

    @property
    def multi_turn(self) -> bool:
        return bool(self.environment or self.tools)

    def trajectory_tokens(self, multi_turn: bool | None = None) -> int:
        """The most tokens after the prompt a sample may hold (one completion without an environment;
        ``multi_turn``: an environment or tools given from Python)."""
        if not (self.multi_turn if multi_turn is None else multi_turn):
            return self.max_new_tokens
        return self.max_trajectory_tokens or self.max_new_tokens * self.max_turns

    def engine_tokens(self) -> int:
        """The most tokens a sampling engine adds to a prompt: a trajectory's, and the last turn's draw (cut to
        the trajectory's room after it is drawn)."""
        return self.trajectory_tokens() + (self.max_new_tokens if self.multi_turn else 0)

    def check_environment(self, needs_greedy: bool) -> None:
        if self.max_turns < 1:
            raise UserError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.max_trajectory_tokens is not None and self.max_trajectory_tokens < 1:
            raise UserError(f"--max-trajectory-tokens must be >= 1, got {self.max_trajectory_tokens}")
        if not self.multi_turn:
            return
        if needs_greedy:
            raise UserError(f"--environment/--tools with {self.algorithm} is not built (its greedy baseline is one "
                            "single-turn completion)")
