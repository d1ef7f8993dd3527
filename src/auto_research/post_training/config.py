"""Run configuration: dataclasses with the paper's names, validated once.

``validate`` raises ``UserError`` with one line that says what was wrong and
what is allowed; it runs before any data is read or any output is written.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from auto_research.errors import UserError
from auto_research.post_training.algorithms import check_group_size, get_algorithm

CANDIDATE_DATASETS = ("arithmetic-smoke", "gsm8k-candidate")
DATASETS = CANDIDATE_DATASETS


@dataclass
class CandidateConfig:
    """One candidate-level run (docs/candidate-protocol.md)."""

    algorithm: str = "rloo"
    """Name in the algorithm registry."""
    dataset: str = "arithmetic-smoke"
    """arithmetic-smoke (embedded) or gsm8k-candidate (GSM8K files)."""
    maximum_examples: int = 512
    """N: train problems; validation uses max(32, N // 4) (gsm8k) or max(64, N // 4) (arithmetic)."""
    steps: int = 100
    """Policy updates; each draws one problem and K of its candidates."""
    group_size: int = 4
    """K: samples per prompt, drawn without replacement from the 6 candidates."""
    learning_rate: float = 0.08
    """lr in w ← w + lr · clip(g, −5, 5); the PPO critic uses it too."""
    seed: int = 42
    beta: float = 0.02
    """β: weight of the KL penalty (in the reward for rloo, in the loss for grpo/ppo)."""
    gradient_clip: float = 5.0
    """Element-wise clip on g before the update."""
    clip_range: float = 0.2
    """ε of the clipped surrogate (grpo, ppo-rlhf)."""
    rollout_refresh: int = 16
    """The rollout policy is set to the current one after every this many updates."""
    dataset_dir: Path = field(default_factory=lambda: Path("data"))
    output_dir: Path = field(default_factory=lambda: Path("runs/post-training"))
    offline: bool = False

    @property
    def run_name(self) -> str:
        return f"{self.algorithm}-{self.dataset}-seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def validate(self) -> "CandidateConfig":
        algorithm = get_algorithm(self.algorithm)
        if self.dataset not in CANDIDATE_DATASETS:
            raise UserError(f"unknown dataset {self.dataset!r}; choose one of: {', '.join(DATASETS)}")
        check_group_size(algorithm, self.group_size)
        if not 2 <= self.group_size <= 6:
            raise UserError(
                f"--group-size {self.group_size} is outside 2..6: the candidate level samples K of 6 "
                "candidates without replacement"
            )
        if self.maximum_examples < 8:
            raise UserError(f"--maximum-examples {self.maximum_examples} is below the minimum of 8")
        if self.steps <= 0:
            raise UserError(f"--steps must be a positive integer, got {self.steps}")
        check_positive_finite("--learning-rate", self.learning_rate)
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise UserError(f"--beta must be a finite number >= 0, got {self.beta}")
        return self

    def to_json(self) -> dict:
        payload = asdict(self)
        payload["dataset_dir"] = str(self.dataset_dir)
        payload["output_dir"] = str(self.output_dir)
        return payload


def check_positive_finite(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0, got {value}")
