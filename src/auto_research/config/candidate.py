"""One candidate-level run: the linear softmax policy over 6 candidates (docs/candidate-protocol.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from auto_research.algorithms.registry import candidate_algorithms, check_group_size, get_algorithm
from auto_research.config.fields import (check_candidate_dataset, check_non_negative_finite, check_positive_finite,
                                         default_dataset_dir, json_ready, setting)
from auto_research.data.registry import about_tasks
from auto_research.errors import UserError


@dataclass
class CandidateConfig:
    """One candidate-level run (docs/candidate-protocol.md); the fields with a section are the shared run flags."""

    algorithm: str = setting("rloo", "name in the algorithm registry")
    dataset: str = setting("arithmetic-smoke", about_tasks("candidate"))
    maximum_examples: int = setting(512, "N train problems; validation uses max(32, N // 4) (gsm8k) or "
                                         "max(64, N // 4) (arithmetic)", type=int)
    steps: int = setting(100, "policy updates; each draws one problem and K of its candidates", type=int)
    group_size: int = setting(4, "K samples per prompt, drawn without replacement from the 6 candidates", type=int)
    learning_rate: float = setting(0.08, "lr in w ← w + lr · clip(g, −5, 5); the PPO critic uses it too", type=float)
    seed: int = setting(42, "random seed", type=int)
    beta: float = setting(0.02, "β: weight of the KL penalty (in the reward for rloo, in the loss for grpo/ppo)",
                          type=float)
    gradient_clip: float = setting(5.0, "element-wise clip on g before the update", section=None)
    clip_range: float = setting(0.2, "ε of the clipped surrogate (grpo, ppo-rlhf)", section=None)
    rollout_refresh: int = setting(16, "the rollout policy is set to the current one after every this many updates",
                                   section=None)
    dataset_dir: Path = setting(default_dataset_dir, "folder holding gsm8k/{train,test}.jsonl",
                                default_text="$AUTO_RESEARCH_DATA, else data", type=Path)
    output_dir: Path = setting(lambda: Path("runs/post-training"), "where run folders go", type=Path)
    offline: bool = setting(False, "never download; missing data or models are an error", action="store_true")

    @property
    def run_name(self) -> str:
        return f"{self.algorithm}-{self.dataset}-seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def validate(self) -> "CandidateConfig":
        algorithm = get_algorithm(self.algorithm)
        if algorithm.candidate is None:
            raise UserError(f"--algorithm {self.algorithm} has no candidate-level form (those with one: "
                            f"{', '.join(candidate_algorithms())}); run it at the generation level, e.g. "
                            "--dataset arithmetic-generate")
        check_candidate_dataset(self.dataset)
        check_group_size(algorithm, self.group_size)
        if not 2 <= self.group_size <= 6:
            raise UserError(f"--group-size {self.group_size} is outside 2..6: the candidate level samples K of 6 "
                            "candidates without replacement")
        if self.maximum_examples < 8:
            raise UserError(f"--maximum-examples {self.maximum_examples} is below the minimum of 8")
        if self.steps <= 0:
            raise UserError(f"--steps must be a positive integer, got {self.steps}")
        check_positive_finite("--learning-rate", self.learning_rate)
        check_non_negative_finite("--beta", self.beta)
        return self

    def to_json(self) -> dict:
        return json_ready(asdict(self))
