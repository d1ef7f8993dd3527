"""The sections of a generation-level run that need no algorithm knowledge to check: the run itself, its data,
the policy, its rewards, LoRA and logging (``generation.check_across`` joins them). Light: no NumPy, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from auto_research.algorithms.registry import REGISTRY, get_algorithm
from auto_research.config.fields import (CANDIDATE_DATASETS, GENERATION_DATASETS, HUB_DATASET, IN_MEMORY,
                                         check_choice, check_device, check_generation_dataset,
                                         check_non_negative_integers, check_positive_finite, check_positive_integers,
                                         comma_floats, default_dataset_dir, is_data_source, setting)
from auto_research.data.rows import data_file_kinds
from auto_research.errors import UserError
from auto_research.rewards.verifiers import VERIFIERS


@dataclass(frozen=True)
class RunSection:
    """What the run is and where it goes: algorithm, seed, length, run folder, evaluations and checkpoints."""

    algorithm: str = setting("rloo", f"one of {', '.join(REGISTRY)}")
    seed: int = setting(42, "random seed", type=int)
    steps: int | None = setting(None, "policy updates", default_text="per dataset", type=int)
    output_dir: Path = setting(lambda: Path("runs/post-training"), "where run folders go", type=Path)
    run_name: str | None = setting(None, "the run folder's name under --output-dir, also the trackers' run name",
                                   "run", default_text="ALGORITHM-DATASET-seedSEED")
    resume: bool = setting(False, "continue the run in --output-dir from its latest good checkpoint", "run",
                           action="store_true")
    overwrite: bool = setting(False, "start afresh where an earlier run is (deletes its checkpoints)", "run",
                              action="store_true")
    eval_every: int | None = setting(None, "evaluate every N steps, 0 = only at the end (default: steps // 10, at least 1)", "run",
                                     type=int)
    checkpoint_every: int = setting(100, "checkpoint every N steps, and always at the end", "run", type=int)
    keep_checkpoints: int = setting(2, "most recent checkpoints kept", "run", type=int)

    def check(self) -> None:
        get_algorithm(self.algorithm)
        if self.resume and self.overwrite:
            raise UserError("--resume continues the run in the output folder and --overwrite deletes it: choose one")
        check_positive_integers(("--steps", self.steps))
        check_non_negative_integers(("--checkpoint-every", self.checkpoint_every), ("--eval-every", self.eval_every))
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclass(frozen=True)
class DataSection:
    """The prompts: a named dataset or a data file, its fields, the held-out split and how it is judged."""

    dataset: str = setting("arithmetic-generate", f"the generation level: {', '.join(GENERATION_DATASETS)}, or a "
                           f"{data_file_kinds()} file, a save_to_disk folder, hf:owner/name; the candidate level: "
                           f"{', '.join(CANDIDATE_DATASETS)}")
    dataset_dir: Path = setting(default_dataset_dir, "folder holding gsm8k/{train,test}.jsonl",
                                default_text="$AUTO_RESEARCH_DATA, else data", type=Path)
    maximum_examples: int | None = setting(None, "training prompts used: the dataset's first N", default_text="all",
                                           type=int)
    prompt_field: str | None = setting(None, "prompt field of a data file: text, or a conversation (a list of "
                                             "{role, content})", "data", default_text="prompt, else messages (up to "
                                             "its last user turn)")
    answer_field: str | None = setting(None, "answer field of a data file, text or a number; none: rows without "
                                             "answers, scored by --reward or --reward-model only", "data",
                                       default_text="answer when the first row has one")
    evaluation_examples: int | None = setting(None, "held-out prompts evaluated (default: per dataset)", "data",
                                              type=int)
    verifier: str | None = setting(None, "how a data file's held-out answers are judged, and its reward when none is "
                                         "given: match (the final number, or the normalised text) or exact (the whole "
                                         "completion is the answer)", "data", default_text="match")
    chat_template: bool = setting(True, "send prompts as plain text, not through the chat template", "data",
                                  flag="--no-chat-template", action="store_false")
    offline: bool = setting(False, "never download; missing data or models are an error", action="store_true")

    @property
    def name(self) -> str:
        """The dataset's name in a run folder's: a file's stem, a hub dataset's owner-name, in-memory rows' name."""
        if self.dataset.startswith(IN_MEMORY):
            return self.dataset[len(IN_MEMORY):] or "rows"
        if self.dataset.startswith(HUB_DATASET):
            return self.dataset[len(HUB_DATASET):].replace("/", "-")
        return Path(self.dataset).stem if is_data_source(self.dataset) else self.dataset

    def check(self) -> None:
        check_generation_dataset(self.dataset)
        if not is_data_source(self.dataset) and not self.dataset.startswith(IN_MEMORY):
            for flag, value in (("--prompt-field", self.prompt_field), ("--answer-field", self.answer_field),
                                ("--verifier", self.verifier)):
                if value is not None:
                    raise UserError(f"{flag} applies to .jsonl datasets only; {self.dataset} has fixed fields")
        check_positive_integers(("--maximum-examples", self.maximum_examples),
                                ("--evaluation-examples", self.evaluation_examples))
        check_choice("--verifier", self.verifier, VERIFIERS)


@dataclass(frozen=True)
class PolicySection:
    """The model that trains and where it computes: its weights, the device, the compute dtype, threads, FSDP."""

    model: str | None = setting(None, "local folder or hub id of a causal LM (default: the embedded tiny model, "
                                      "arithmetic-generate only)", "data")
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N or mps", "optimisation")
    dtype: str = setting("auto", "auto (bf16 compute on a GPU, fp32 on CPU), float32 or bfloat16; weights stay fp32",
                         "optimisation")
    threads: int | None = setting(None, "CPU threads torch may use (default: one per core)", "optimisation", type=int)
    fsdp: bool = setting(False, "under torchrun, shard policy, reference and critic with FSDP2 (default: DDP, "
                         "whole models on each rank)", "scaling", action="store_true")

    def check(self) -> None:
        check_device(self.device)
        if self.dtype in ("float16", "fp16"):
            raise UserError("--dtype float16 would need loss scaling; use bfloat16 (fp32 master weights, bf16 compute) "
                            "or float32")
        check_positive_integers(("--threads", self.threads))


@dataclass(frozen=True)
class RewardSection:
    """What scores a completion: built-in verifiers and user functions, a reward server, a reward model, a judge."""

    reward: list[str] = setting(list, "built-in (arithmetic, gsm8k, match, format) or module:function; repeatable "
                                      "(default: the dataset's verifier)", "rewards", action="append")
    reward_url: str | None = setting(None, "http://HOST:PORT/PATH of a reward server: a JSON POST per batch "
                                           "({prompts, completions, columns}) answered by a list of numbers or "
                                           "nulls; retried with backoff, then one line and exit 2", "rewards")
    reward_weights: list[float] | None = setting(None, "comma-separated weights, one per reward, reward model last",
                                                 "rewards", type=comma_floats)
    reward_model: str | None = setting(None, "sequence-classification reward model (folder or hub id)", "rewards")
    judge: str | None = setting(None, "gold (preference-generate's hidden judge) or module:function(prompt, a, b) -> "
                                "P(a better): held-out win rate against the starting policy, both orders", "rewards")

    def check(self) -> None:
        if self.judge is not None and self.judge != "gold":
            from auto_research.user_code import FORMS, split_spec  # noqa: PLC0415

            split_spec(self.judge, "--judge", f"gold or {FORMS}")  # the loader's own check, before any work
        for weight in self.reward_weights or ():
            if not math.isfinite(weight):
                raise UserError(f"--reward-weights must be finite numbers, got {weight}")


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters in place of every weight (PEFT)."""

    lora_r: int | None = setting(None, "train LoRA adapters of this rank instead of every weight (PEFT); the "
                                 "reference is the model with its adapters disabled", "scaling", type=int)
    lora_alpha: float | None = setting(None, "LoRA scaling numerator (default: 2 × --lora-r)", "scaling", type=float)
    lora_dropout: float = setting(0.0, "dropout on the LoRA input (0 keeps sampling and training the same "
                                  "distribution)", "scaling", type=float)
    lora_target_modules: str | None = setting(None, "comma-separated module names to adapt (default: every linear "
                                              "layer of attention and MLP)", "scaling")
    merge_lora: bool = setting(False, "also save the merged model (base + adapters) in <run>/merged at the end",
                               "scaling", action="store_true")

    def check(self) -> None:
        check_positive_integers(("--lora-r", self.lora_r))
        if self.lora_alpha is not None:
            check_positive_finite("--lora-alpha", self.lora_alpha)
        if self.lora_r is None:
            for flag, value in (("--lora-alpha", self.lora_alpha), ("--lora-target-modules", self.lora_target_modules)):
                if value is not None:
                    raise UserError(f"{flag} needs --lora-r (LoRA is off without it)")
            if self.merge_lora:
                raise UserError("--merge-lora needs --lora-r (LoRA is off without it)")
        if not (0 <= self.lora_dropout < 1):
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None and not self.lora_target_modules.replace(",", "").strip():
            raise UserError("--lora-target-modules is empty; give module names such as q_proj,v_proj")


@dataclass(frozen=True)
class LoggingSection:
    """Where the figures go and what is shown: trackers, logged completions, progress."""

    report_to: str = setting("none", "experiment trackers, comma-separated: tensorboard, wandb, trackio, mlflow "
                             "(each an extra: pip install 'auto-research[wandb]'), or none", "run")
    tracker_project: str = setting("auto-research", "the trackers' project (wandb: unless WANDB_PROJECT is set; "
                                   "mlflow: the experiment); each run is named after its folder", "run")
    log_completions: int = setting(8, "at every evaluation, the first N held-out prompts with their greedy "
                                      "completions, rewards and verdicts go to completions.jsonl (and report.md "
                                      "shows the last); 0 = none", "run", type=int)
    progress: bool = setting(True, "no progress bar or progress lines (with --log-every, its lines only)", "run",
                             flag="--no-progress", action="store_false")
    log_every: int | None = setting(None, "without a terminal (or with --no-progress), a progress line every N steps "
                                          "(metrics.jsonl and the trackers get every step)", "run",
                                    default_text="a twentieth of --steps", type=int)

    @property
    def shows_progress(self) -> bool:
        """Unless --no-progress, and with it when --log-every is given (TRL's disable_tqdm with logging_steps)."""
        return self.progress or self.log_every is not None

    def check(self) -> None:
        check_non_negative_integers(("--log-completions", self.log_completions))
        check_positive_integers(("--log-every", self.log_every))
        from auto_research.report.trackers import parse_report_to  # noqa: PLC0415  (light: no tracker imported)

        parse_report_to(self.report_to)
