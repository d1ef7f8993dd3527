"""Run configuration: dataclasses with the paper's names, validated once.

``validate`` raises ``UserError`` with one line that says what was wrong and
what is allowed; it runs before any data is read or any output is written.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from auto_research.errors import UserError
from auto_research.post_training.algorithms import check_group_size, get_algorithm

CANDIDATE_DATASETS = ("arithmetic-smoke", "gsm8k-candidate")
GENERATION_DATASETS = ("arithmetic-generate", "gsm8k-generate")
DATASETS = CANDIDATE_DATASETS + GENERATION_DATASETS


IN_MEMORY = "memory:"
"""Prefix of an in-memory dataset's name (the Python API: rows passed as a list of dicts)."""


def is_generation_dataset(name: str) -> bool:
    """The generation level's datasets: the named ones, any local .jsonl file, rows in memory."""
    return name in GENERATION_DATASETS or name.endswith(".jsonl") or name.startswith(IN_MEMORY)


def looks_like_a_file(name: str) -> bool:
    return "/" in name or os.sep in name or Path(name).suffix != "" or Path(name).exists()


def check_candidate_dataset(name: str) -> None:
    if is_generation_dataset(name):
        raise UserError(f"{name} is a generation-level dataset; 'compare' and --seeds run the candidate "
                        f"level ({', '.join(CANDIDATE_DATASETS)})")
    if name in CANDIDATE_DATASETS:
        return
    if looks_like_a_file(name):
        raise UserError(f"--dataset {name}: a data file must be JSON Lines (one JSON object per line) named *.jsonl")
    raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}, or a .jsonl file")


def check_generation_dataset(name: str) -> None:
    """One line for a dataset the generation level cannot take, saying what it can."""
    if is_generation_dataset(name):
        return
    if name in CANDIDATE_DATASETS:
        raise UserError(f"{name} is a candidate-level dataset (no text to generate); the generation level takes "
                        f"{', '.join(GENERATION_DATASETS)} or a .jsonl file")
    if looks_like_a_file(name):
        raise UserError(f"--dataset {name}: a data file must be JSON Lines (one JSON object per line) named *.jsonl")
    raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(GENERATION_DATASETS)}, or a .jsonl file")


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
        check_candidate_dataset(self.dataset)
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


KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("reward", "loss", "none")
LOSS_AGGREGATIONS = ("sequence", "token-mean", "sequence-mean-token-mean")
SCHEDULES = ("constant", "cosine")

# Per-dataset defaults for settings the user leaves unset. arithmetic-generate's
# were chosen so that its CPU demo learns within minutes (see README, "CPU demo").
GENERATION_PRESETS = {
    "arithmetic-generate": dict(steps=600, learning_rate=3e-4, prompts_per_step=32, temperature=1.5,
                                max_new_tokens=6, evaluation_examples=500, warmup_steps=10),
    "gsm8k-generate": dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0,
                           max_new_tokens=256, evaluation_examples=128, warmup_steps=10),
    # A JSONL file holds out its last min(128, rows // 5) rows unless --evaluation-examples is given.
    "jsonl": dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0,
                  max_new_tokens=128, warmup_steps=10),
}
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


@dataclass
class GenerationConfig:
    """One generation-level run: RL on a causal LM (the paper's setting)."""

    algorithm: str = "rloo"
    dataset: str = "arithmetic-generate"
    """arithmetic-generate (embedded), gsm8k-generate, or a path to a .jsonl file."""
    model: str | None = None
    """Local folder or hub id; None: the embedded tiny model (arithmetic-generate only)."""
    prompt_field: str | None = None
    """Field of a .jsonl row holding the prompt (text); None: "prompt"."""
    answer_field: str | None = None
    """Field of a .jsonl row holding the answer (text or a number); None: "answer"."""
    dataset_dir: Path = field(default_factory=lambda: Path("data"))
    maximum_examples: int | None = None
    """Training prompts used: the dataset's first N; None: all of them."""
    evaluation_examples: int | None = None
    """Held-out prompts for greedy evaluation; None: the dataset's default."""
    reward: list[str] = field(default_factory=list)
    """Built-in rewards (arithmetic, gsm8k, match, format) or module:function; default: the dataset's verifier."""
    reward_weights: list[float] | None = None
    reward_model: str | None = None
    """Sequence-classification reward model (folder or hub id)."""
    group_size: int = 4
    """K: completions sampled per prompt."""
    beta: float = 0.05
    """β: weight of the KL penalty to the frozen reference."""
    kl_estimator: str | None = None
    """k1 (the paper's log-ratio), k2 or k3; None: k1 in the reward, k3 in the loss."""
    kl_in: str | None = None
    """reward (the paper: shaped reward; per token for PPO), loss (GRPO/verl style) or none;
    None: the algorithm's own (ReMax and RAFT: none)."""
    loss_aggregation: str = "sequence"
    """sequence: the whole response is one action (the paper); token-mean: average over all tokens;
    sequence-mean-token-mean: each completion's token mean, averaged."""
    updates_per_batch: int = 1
    """Epochs over each rollout batch (--ppo-epochs); > 1 uses importance ratios with clipping."""
    ppo_mini_batches: int = 1
    """Optimizer steps per epoch, each on a slice of whole groups; > 1 uses clipped ratios."""
    ratio_level: str = "token"
    """Importance ratio of the clipped surrogate: per token (PPO, GRPO, TRL) or per sequence."""
    clip_range: float = 0.2
    gae_lambda: float = 1.0
    """λ of GAE (ppo-rlhf); the RLOO paper found PPO best at λ = 1 (TRL's default is 0.95)."""
    value_clip: float = 0.2
    """Clip range of the critic's value loss around the old values (ppo-rlhf)."""
    vf_coef: float = 0.1
    """Weight of the value loss (ppo-rlhf); the critic has its own AdamW."""
    critic_model: str | None = None
    """Initial weights of the critic (ppo-rlhf): a folder or hub id; None: the reward model when given, else the policy."""
    whiten_advantages: bool = True
    """Whiten PPO's GAE advantages over the batch (masked mean 0, std 1)."""
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    prompts_per_step: int | None = None
    """Prompts (groups) per step; the batch holds prompts_per_step · K completions."""
    micro_batch_size: int | None = None
    """Completions per forward/backward pass (any size: advantages are computed before the update)."""
    learning_rate: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    steps: int | None = None
    eval_every: int | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    overwrite: bool = False
    """Start afresh in a run folder that holds an earlier run (its checkpoints are deleted)."""
    seed: int = 42
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    """CPU threads for torch; None: torch's default (one per core)."""
    chat_template: bool = True
    output_dir: Path = field(default_factory=lambda: Path("runs/post-training"))
    offline: bool = False
    report_to: str = "none"
    progress: bool = True

    @property
    def dataset_name(self) -> str:
        if self.dataset.startswith(IN_MEMORY):
            return self.dataset[len(IN_MEMORY):] or "rows"
        return Path(self.dataset).stem if self.dataset.endswith(".jsonl") else self.dataset

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / f"{self.algorithm}-{self.dataset_name}-seed{self.seed}"

    def filled(self) -> "GenerationConfig":
        """A copy with the dataset's presets in place of unset (None) settings."""
        preset = GENERATION_PRESETS[self.dataset if self.dataset in GENERATION_PRESETS else "jsonl"]
        values = {key: value for key, value in preset.items() if getattr(self, key) is None}
        filled = replace(self, **values)
        if filled.eval_every is None:
            filled.eval_every = max(1, filled.steps // 10)
        algorithm = get_algorithm(self.algorithm)
        if filled.kl_in is None:
            # PPO at the generation level puts a per-token KL penalty in the reward (TRL, OpenRLHF);
            # the candidate level's ppo-rlhf keeps its protocol's KL-in-the-loss.
            filled.kl_in = "reward" if algorithm.needs_critic else algorithm.kl
        if filled.kl_estimator is None:
            # k1's expected gradient as a loss term is zero: GRPO's paper uses k3 there.
            filled.kl_estimator = "k1" if filled.kl_in != "loss" else "k3"
        return filled

    def validate(self) -> "GenerationConfig":
        """Every check that needs neither torch nor the data: runs before anything heavy is imported."""
        algorithm = get_algorithm(self.algorithm)
        self.validate_dataset()
        if self.model is None and self.dataset != "arithmetic-generate":
            raise UserError(f"--model is required for {self.dataset} (only arithmetic-generate has an embedded model; "
                            "give a local folder or hub id, or an 'auto-research sft' output)")
        if self.resume and self.overwrite:
            raise UserError("--resume continues the run in the output folder and --overwrite deletes it: choose one")
        if self.group_size < 2:
            raise UserError(f"--group-size {self.group_size}: the generation level samples K >= 2 completions per "
                            "prompt (leave-one-out is undefined for K = 1)")
        check_group_size(algorithm, self.group_size)
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise UserError(f"--beta must be a finite number >= 0, got {self.beta}")
        for flag, value in (("--max-new-tokens", self.max_new_tokens), ("--steps", self.steps),
                            ("--prompts-per-step", self.prompts_per_step), ("--ppo-epochs", self.updates_per_batch),
                            ("--maximum-examples", self.maximum_examples), ("--evaluation-examples", self.evaluation_examples)):
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        for flag, value in (("--warmup-steps", self.warmup_steps), ("--checkpoint-every", self.checkpoint_every),
                            ("--eval-every", self.eval_every), ("--top-k", self.top_k)):
            if value is not None and value < 0:
                raise UserError(f"{flag} must be >= 0, got {value}")
        if self.threads is not None and self.threads <= 0:
            raise UserError(f"--threads must be a positive integer, got {self.threads}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise UserError(f"--device {self.device!r}: choose auto, cpu, cuda, cuda:N or mps")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.learning_rate is not None:
            check_positive_finite("--learning-rate", self.learning_rate)
        if self.temperature is not None:
            check_positive_finite("--temperature", self.temperature)
        check_positive_finite("--max-grad-norm", self.max_grad_norm)
        if not (0 < self.top_p <= 1):
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.clip_range < 1):
            raise UserError(f"--clip-range must be in [0, 1), got {self.clip_range}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UserError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        for flag, value, allowed in (("--kl-estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("--kl-in", self.kl_in, KL_PLACEMENTS),
                                     ("--loss-aggregation", self.loss_aggregation, LOSS_AGGREGATIONS),
                                     ("--ratio-level", self.ratio_level, ("token", "sequence")),
                                     ("--lr-schedule", self.lr_schedule, SCHEDULES),
                                     ("--report-to", self.report_to, ("none", "tensorboard"))):
            if value is not None and value not in allowed:
                raise UserError(f"{flag} {value!r}: choose one of {', '.join(allowed)}")
        if self.kl_in == "reward" and algorithm.kl != "reward" and not algorithm.needs_critic and self.beta > 0:
            raise UserError(f"--kl-in reward: {self.algorithm}'s advantage does not use the shaped reward; "
                            "use --kl-in loss (or --beta 0)")
        if self.kl_in == "loss" and self.kl_estimator == "k1":
            raise UserError("--kl-estimator k1 with --kl-in loss: the expected gradient of a k1 loss term is zero, "
                            "so the penalty would do nothing; use k3 (the default there) or k2")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise UserError(f"--micro-batch-size must be a positive integer, got {self.micro_batch_size}")
        if self.ppo_mini_batches <= 0:
            raise UserError(f"--ppo-mini-batches must be a positive integer, got {self.ppo_mini_batches}")
        if self.prompts_per_step is not None and self.prompts_per_step % self.ppo_mini_batches:
            raise UserError(f"--ppo-mini-batches {self.ppo_mini_batches} must divide --prompts-per-step "
                            f"{self.prompts_per_step} (each mini-batch holds whole groups)")
        if not (math.isfinite(self.gae_lambda) and 0 <= self.gae_lambda <= 1):
            raise UserError(f"--gae-lambda must be in [0, 1], got {self.gae_lambda}")
        if not (math.isfinite(self.vf_coef) and self.vf_coef >= 0):
            raise UserError(f"--vf-coef must be a finite number >= 0, got {self.vf_coef}")
        check_positive_finite("--value-clip", self.value_clip)
        if self.critic_model is not None and not algorithm.needs_critic:
            raise UserError(f"--critic-model applies to ppo-rlhf only; {self.algorithm} has no critic")
        if self.dtype in ("float16", "fp16"):
            raise UserError("--dtype float16 would need loss scaling; use bfloat16 (fp32 master weights, bf16 compute) "
                            "or float32")
        if self.reward_weights is not None:
            for weight in self.reward_weights:
                if not math.isfinite(weight):
                    raise UserError(f"--reward-weights must be finite numbers, got {weight}")
        if self.report_to == "tensorboard":
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise UserError("--report-to tensorboard needs the tensorboard package: pip install tensorboard")
        return self

    def validate_dataset(self) -> None:
        check_generation_dataset(self.dataset)
        if not self.dataset.endswith(".jsonl") and not self.dataset.startswith(IN_MEMORY):
            for flag, value in (("--prompt-field", self.prompt_field), ("--answer-field", self.answer_field)):
                if value is not None:
                    raise UserError(f"{flag} applies to .jsonl datasets only; {self.dataset} has fixed fields")

    def to_json(self) -> dict:
        payload = asdict(self)
        payload["dataset_dir"] = str(self.dataset_dir)
        payload["output_dir"] = str(self.output_dir)
        return payload
