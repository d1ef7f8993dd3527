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

ALGORITHMS = ("rloo", "ppo-rlhf", "grpo", "remax", "reinforce", "vanilla-pg", "raft")
"""The registry's names (algorithms.py), here without NumPy so that --help can list them; a test keeps them equal."""
CANDIDATE_DATASETS = ("arithmetic-smoke", "gsm8k-candidate")
PREFERENCE_DATASETS = ("preference-generate", "preference-arithmetic")
GENERATION_DATASETS = ("arithmetic-generate", "gsm8k-generate", *PREFERENCE_DATASETS)
EMBEDDED_MODEL_DATASETS = ("arithmetic-generate", *PREFERENCE_DATASETS)
DATASETS = CANDIDATE_DATASETS + GENERATION_DATASETS


IN_MEMORY = "memory:"
"""Prefix of an in-memory dataset's name (the Python API: rows passed as a list of dicts)."""


# Prompt files read through Hugging Face ``datasets`` (besides .jsonl, which the project reads itself,
# line by line, with line numbers in its messages); ``hf:owner/name`` is a hub dataset (online).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
HUB_DATASET = "hf:"


def is_data_source(name: str) -> bool:
    """A file or folder of rows (or a hub dataset) rather than a named dataset."""
    folder = Path(name).expanduser()
    return (name.endswith(DATA_FILE_SUFFIXES) or name.startswith(HUB_DATASET)
            or (folder.is_dir() and ((folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists())))


def is_generation_dataset(name: str) -> bool:
    """The generation level's datasets: the named ones, data files and folders, rows in memory."""
    return name in GENERATION_DATASETS or is_data_source(name) or name.startswith(IN_MEMORY)


def looks_like_a_file(name: str) -> bool:
    return "/" in name or os.sep in name or Path(name).suffix != "" or Path(name).exists()


def check_candidate_dataset(name: str) -> None:
    if is_generation_dataset(name):
        raise UserError(f"{name} is a generation-level dataset; 'compare' and --seeds run the candidate "
                        f"level ({', '.join(CANDIDATE_DATASETS)})")
    if name in CANDIDATE_DATASETS:
        return
    if looks_like_a_file(name):
        raise UserError(f"--dataset {name}: a data file must be .jsonl (JSON Lines), .json, .parquet or .csv, or a "
                        "folder written by datasets' save_to_disk")
    raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}, or a .jsonl file")


def check_generation_dataset(name: str) -> None:
    """One line for a dataset the generation level cannot take, saying what it can."""
    if is_generation_dataset(name):
        return
    if name in CANDIDATE_DATASETS:
        raise UserError(f"{name} is a candidate-level dataset (no text to generate); the generation level takes "
                        f"{', '.join(GENERATION_DATASETS)} or a .jsonl file")
    if looks_like_a_file(name):
        raise UserError(f"--dataset {name}: a data file must be .jsonl (JSON Lines), .json, .parquet or .csv, or a "
                        "folder written by datasets' save_to_disk")
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
        from auto_research.post_training.algorithms import check_group_size, get_algorithm

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
    # Against a learned reward model (auto-research rlhf): shorter, with evaluations for the KL curves.
    "preference-generate": dict(steps=300, learning_rate=3e-4, prompts_per_step=32, temperature=1.5,
                                max_new_tokens=6, evaluation_examples=500, warmup_steps=10, eval_every=50),
    "preference-arithmetic": dict(steps=300, learning_rate=3e-4, prompts_per_step=32, temperature=1.5,
                                  max_new_tokens=6, evaluation_examples=500, warmup_steps=10, eval_every=50),
    "gsm8k-generate": dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0,
                           max_new_tokens=256, evaluation_examples=128, warmup_steps=10),
    # A JSONL file holds out its last min(128, rows // 5) rows unless --evaluation-examples is given.
    "jsonl": dict(steps=300, learning_rate=1e-6, prompts_per_step=8, temperature=1.0,
                  max_new_tokens=128, warmup_steps=10),
}
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def comma_floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--reward-weights takes comma-separated numbers such as 1,0.2; got {text!r}") from None


def setting(default, help: str, section: str | None = None, flag: str | None = None, **argparse_options):
    """A config field that is also a command-line flag: its name, default and help are written once, here.

    ``section`` groups the flag in --help (None: not a generation-level flag of its own); ``flag``
    overrides the flag derived from the field's name; ``argparse_options`` (type, action, aliases)
    go to argparse. Mutable defaults are given as a zero-argument function.
    """
    metadata = {"help": help, "section": section, "flag": flag, "options": argparse_options}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


SECTIONS = {
    "data": "data and model",
    "rewards": "rewards",
    "loss": "loss, KL and updates",
    "critic": "critic (ppo-rlhf)",
    "sampling": "sampling",
    "optimisation": "optimisation",
    "scaling": "several processes (torchrun) and LoRA",
    "run": "evaluation, checkpoints and the run",
}


@dataclass
class GenerationConfig:
    """One generation-level run: RL on a causal LM (the paper's setting).

    The fields are grouped in sections (``SECTIONS``); each one's metadata holds the
    help text the command line shows, so the flags of ``post-train`` and ``compare``
    are generated from this class (``cli.py``). None means "the dataset's preset"
    (``GENERATION_PRESETS``) or "the algorithm's own".
    """

    # --- set by the shared run flags (both levels) ---
    algorithm: str = setting("rloo", "name in the algorithm registry")
    dataset: str = setting("arithmetic-generate", "arithmetic-generate (embedded), preference-generate (embedded, "
                           "against a learned reward model), gsm8k-generate, or a .jsonl file")
    dataset_dir: Path = setting(lambda: Path("data"), "folder holding gsm8k/")
    maximum_examples: int | None = setting(None, "training prompts used: the dataset's first N (default: all)")
    group_size: int = setting(4, "K: completions sampled per prompt")
    beta: float = setting(0.05, "β: weight of the KL penalty to the frozen reference")
    learning_rate: float | None = setting(None, "AdamW step size (default: per dataset)")
    steps: int | None = setting(None, "policy updates (default: per dataset)")
    seed: int = setting(42, "random seed")
    output_dir: Path = setting(lambda: Path("runs/post-training"), "where run folders go")
    offline: bool = setting(False, "never download")

    # --- data and model ---
    model: str | None = setting(None, "local folder or hub id of a causal LM (default: the embedded tiny model, "
                                      "arithmetic-generate only)", "data")
    prompt_field: str | None = setting(None, "prompt field of a .jsonl dataset, text (default: prompt)", "data")
    answer_field: str | None = setting(None, "answer field of a .jsonl dataset, text or a number (default: answer)",
                                       "data")
    evaluation_examples: int | None = setting(None, "held-out prompts evaluated (default: per dataset)", "data",
                                              type=int)
    chat_template: bool = setting(True, "send prompts as plain text, not through the chat template", "data",
                                  flag="--no-chat-template", action="store_false")

    # --- rewards ---
    reward: list[str] = setting(list, "built-in (arithmetic, gsm8k, match, format) or module:function; repeatable "
                                      "(default: the dataset's verifier)", "rewards", action="append")
    reward_weights: list[float] | None = setting(None, "comma-separated weights, one per reward, reward model last",
                                                 "rewards", type=comma_floats)
    reward_model: str | None = setting(None, "sequence-classification reward model (folder or hub id)", "rewards")
    judge: str | None = setting(None, "gold (preference-generate's hidden judge) or module:function(prompt, a, b) -> "
                                "P(a better): held-out win rate against the starting policy, both orders", "rewards")

    # --- loss, KL and updates ---
    kl_estimator: str | None = setting(None, "k1 (default in the reward, the paper), k2 or k3 (default in the loss)",
                                       "loss")
    kl_in: str | None = setting(None, "reward (rloo, reinforce, vanilla-pg, ppo-rlhf: the shaped reward), loss (grpo) "
                                      "or none (remax, raft) (default: the algorithm's)", "loss")
    loss_aggregation: str = setting("sequence", "sequence (the whole response is one action), token-mean or "
                                                "sequence-mean-token-mean", "loss")
    updates_per_batch: int = setting(1, "epochs over each rollout batch; > 1 uses clipped ratios", "loss",
                                     flag="--ppo-epochs", aliases=("--updates-per-batch",), type=int)
    ppo_mini_batches: int = setting(1, "optimizer steps per epoch, each on whole groups; > 1 uses clipped ratios",
                                    "loss", type=int)
    ratio_level: str = setting("token", "importance ratio of the clipped surrogate: token (PPO, GRPO, TRL) or "
                                        "sequence", "loss")
    clip_range: float = setting(0.2, "ε of the clipped ratio", "loss", type=float)

    # --- critic (ppo-rlhf) ---
    gae_lambda: float = setting(1.0, "λ of GAE (the RLOO paper's best for PPO; TRL uses 0.95)", "critic", type=float)
    value_clip: float = setting(0.2, "clip range of the value loss around the old values", "critic", type=float)
    vf_coef: float = setting(0.1, "weight of the value loss (the critic has its own AdamW)", "critic", type=float)
    critic_model: str | None = setting(None, "initial critic weights (default: --reward-model if given, else the "
                                             "policy)", "critic")
    whiten_advantages: bool = setting(True, "keep PPO's GAE advantages as they are (default: whitened over the batch)",
                                      "critic", flag="--no-whiten-advantages", action="store_false")

    # --- sampling ---
    temperature: float | None = setting(None, "sampling temperature (default: per dataset)", "sampling", type=float)
    top_p: float = setting(1.0, "nucleus sampling", "sampling", type=float)
    top_k: int = setting(0, "top-k sampling, 0 = off", "sampling", type=int)
    max_new_tokens: int | None = setting(None, "completion length limit (default: per dataset)", "sampling", type=int)
    prompts_per_step: int | None = setting(None, "prompts (groups) per step; the batch holds prompts × K completions "
                                                 "(default: per dataset)", "sampling", type=int)

    # --- optimisation ---
    micro_batch_size: int | None = setting(None, "completions per forward/backward, any size, and per sampling call "
                                                 "(rounded down to whole groups; default: the whole batch)",
                                           "optimisation", type=int)
    lr_schedule: str = setting("constant", "constant or cosine, after linear warmup", "optimisation")
    warmup_steps: int | None = setting(None, "linear warmup updates (default: per dataset)", "optimisation", type=int)
    weight_decay: float = setting(0.0, "AdamW weight decay", "optimisation", type=float)
    max_grad_norm: float = setting(1.0, "gradient-norm clip", "optimisation", type=float)
    gradient_checkpointing: bool = setting(False, "trade compute for memory", "optimisation", action="store_true")
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N or mps", "optimisation")
    dtype: str = setting("auto", "auto (bf16 compute on a GPU, fp32 on CPU), float32 or bfloat16; weights stay fp32",
                         "optimisation")
    threads: int | None = setting(None, "CPU threads torch may use (default: one per core)", "optimisation", type=int)

    # --- several processes and LoRA ---
    fsdp: bool = setting(False, "under torchrun, shard policy, reference and critic with FSDP2 (default: DDP, "
                         "whole models on each rank)", "scaling", action="store_true")
    lora_r: int | None = setting(None, "train LoRA adapters of this rank instead of every weight (PEFT); the "
                                 "reference is the model with its adapters disabled", "scaling", type=int)
    lora_alpha: float | None = setting(None, "LoRA scaling numerator (default: 2 × --lora-r)", "scaling", type=float)
    lora_dropout: float = setting(0.0, "dropout on the LoRA input (0 keeps sampling and training the same "
                                  "distribution)", "scaling", type=float)
    lora_target_modules: str | None = setting(None, "comma-separated module names to adapt (default: every linear "
                                              "layer of attention and MLP)", "scaling")
    merge_lora: bool = setting(False, "also save the merged model (base + adapters) in <run>/merged at the end",
                               "scaling", action="store_true")

    # --- evaluation, checkpoints and the run ---
    eval_every: int | None = setting(None, "evaluate every N steps, 0 = only at the end (default: steps // 10)", "run",
                                     type=int)
    checkpoint_every: int = setting(100, "checkpoint every N steps, and always at the end", "run", type=int)
    keep_checkpoints: int = setting(2, "most recent checkpoints kept", "run", type=int)
    resume: bool = setting(False, "continue the run in --output-dir from its latest good checkpoint", "run",
                           action="store_true")
    overwrite: bool = setting(False, "start afresh where an earlier run is (deletes its checkpoints)", "run",
                              action="store_true")
    report_to: str = setting("none", "none or tensorboard", "run")
    progress: bool = setting(True, "no progress bar or progress lines", "run", flag="--no-progress",
                             action="store_false")

    @property
    def dataset_name(self) -> str:
        if self.dataset.startswith(IN_MEMORY):
            return self.dataset[len(IN_MEMORY):] or "rows"
        if self.dataset.startswith(HUB_DATASET):
            return self.dataset[len(HUB_DATASET):].replace("/", "-")
        return Path(self.dataset).stem if is_data_source(self.dataset) else self.dataset

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / f"{self.algorithm}-{self.dataset_name}-seed{self.seed}"

    def filled(self) -> "GenerationConfig":
        """A copy with the dataset's presets in place of unset (None) settings."""
        from auto_research.post_training.algorithms import get_algorithm

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
        from auto_research.post_training.algorithms import check_group_size, get_algorithm

        algorithm = get_algorithm(self.algorithm)
        self.validate_dataset()
        if self.model is None and self.dataset not in EMBEDDED_MODEL_DATASETS:
            raise UserError(f"--model is required for {self.dataset} (only {' and '.join(EMBEDDED_MODEL_DATASETS)} have "
                            "an embedded model; "
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
        if self.lora_r is not None and self.lora_r <= 0:
            raise UserError(f"--lora-r must be a positive integer, got {self.lora_r}")
        if self.lora_r is None:
            for flag, value in (("--lora-alpha", self.lora_alpha), ("--lora-target-modules", self.lora_target_modules)):
                if value is not None:
                    raise UserError(f"{flag} needs --lora-r (LoRA is off without it)")
            if self.merge_lora:
                raise UserError("--merge-lora needs --lora-r (LoRA is off without it)")
        if self.lora_alpha is not None:
            check_positive_finite("--lora-alpha", self.lora_alpha)
        if not (0 <= self.lora_dropout < 1):
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None and not [name for name in self.lora_target_modules.split(",") if name.strip()]:
            raise UserError("--lora-target-modules is empty; give module names such as q_proj,v_proj")
        if self.dataset in PREFERENCE_DATASETS and not self.reward_model and not self.reward:
            raise UserError(f"{self.dataset} is optimised against a learned reward model: give --reward-model "
                            "(auto-research rlhf samples the preference pairs and trains one), or --reward")
        if self.judge is not None and self.judge != "gold" and ":" not in self.judge:
            raise UserError(f"--judge {self.judge!r}: give gold or module:function")
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
        if not is_data_source(self.dataset) and not self.dataset.startswith(IN_MEMORY):
            for flag, value in (("--prompt-field", self.prompt_field), ("--answer-field", self.answer_field)):
                if value is not None:
                    raise UserError(f"{flag} applies to .jsonl datasets only; {self.dataset} has fixed fields")

    def to_json(self) -> dict:
        payload = asdict(self)
        payload["dataset_dir"] = str(self.dataset_dir)
        payload["output_dir"] = str(self.output_dir)
        return payload
