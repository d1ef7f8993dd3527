"""The sampling and optimisation sections of a generation-level run. None means the dataset's preset
(``GenerationConfig.filled``). Light: no torch."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from auto_research.config.fields import (check_choice, check_non_negative_finite, check_non_negative_integers,
                                         check_positive_finite, check_positive_integers, setting)
from auto_research.engine.temperature import MIN_TEMPERATURE, temperature_problem
from auto_research.errors import UserError

SCHEDULES = ("constant", "linear", "cosine")
MAX_REFILLS = 64
"""The most refills one slot may take in a step (--max-refills): each is a sampling round of its own, so a reward
that is constant on most prompts would otherwise hold step 1 for as long as the bound allows (1,000,000 never
ends). 64 tries at a slot where a prompt with signal turns up 1 time in 20 miss with probability 0.04."""


def check_temperature(value: float) -> None:
    """A run's --temperature: a sampling temperature (``temperature_problem``), and not 0: greedy decoding draws
    a prompt's K completions alike, so no group would carry a signal to train on."""
    problem = temperature_problem(value)
    if problem is None and value == 0:
        problem = ("0 is greedy decoding: a prompt's K completions would be identical and no group would carry a "
                   f"signal to train on; sample at a temperature >= {MIN_TEMPERATURE:g}")
    if problem is not None:
        raise UserError(f"--temperature {problem}")


@dataclass(frozen=True)
class SamplingSection:
    """A step's batch: its prompts, K completions of each, and every setting the engine samples them with."""

    group_size: int = setting(4, "K: completions sampled per prompt", type=int)
    prompts_per_step: int | None = setting(None, "prompts (groups) per step; the batch holds prompts × K completions "
                                                 "(default: per dataset)", "sampling", type=int)
    temperature: float | None = setting(None, "sampling temperature (default: per dataset)", "sampling", type=float)
    top_p: float = setting(1.0, "nucleus sampling", "sampling", type=float)
    top_k: int = setting(0, "top-k sampling, 0 = off", "sampling", type=int)
    max_new_tokens: int | None = setting(None, "completion length limit (default: per dataset)", "sampling", type=int)
    generation_batch_size: int | None = setting(None, "completions per sampling call, rounded down to whole groups: "
                                                      "decoding reads every weight once a token, so more rows a call "
                                                      "is faster; the same on 1 and N processes keeps their numbers "
                                                      "equal (default: --micro-batch-size, else the whole batch)",
                                                "sampling", type=int)
    dynamic_sampling: bool | None = setting(None, "drop groups whose K scores are all equal (no signal) and refill "
                                                  "their slots with fresh prompts, up to --max-refills times each, "
                                                  "before the step trains (DAPO; default: the algorithm's, on for "
                                                  "dapo)", "sampling", action=argparse.BooleanOptionalAction)
    max_refills: int = setting(4, "with --dynamic-sampling, the most fresh prompts one slot may try (at most "
                                  f"{MAX_REFILLS}); a slot still without signal trains on its first group "
                                  "(trained_no_signal_fraction)", "sampling", type=int)

    def check(self) -> None:
        if self.group_size < 2:
            raise UserError(f"--group-size {self.group_size}: the generation level samples K >= 2 completions per "
                            "prompt (leave-one-out is undefined for K = 1)")
        check_positive_integers(("--max-new-tokens", self.max_new_tokens), ("--prompts-per-step", self.prompts_per_step),
                                ("--generation-batch-size", self.generation_batch_size))
        check_non_negative_integers(("--top-k", self.top_k))
        if self.temperature is not None:
            check_temperature(self.temperature)
        if not (0 < self.top_p <= 1):
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.max_refills <= MAX_REFILLS:
            raise UserError(f"--max-refills must be in 0..{MAX_REFILLS} (each refill is a sampling round of the step), "
                            f"got {self.max_refills}")


@dataclass(frozen=True)
class OptimisationSection:
    """How the weights move (AdamW, schedule, clip) and what a step's memory holds."""

    learning_rate: float | None = setting(None, "AdamW step size", default_text="per dataset", type=float)
    lr_schedule: str = setting("constant", "after the linear warmup: constant, linear (to zero at the last step) or "
                                           "cosine (to zero at the last step)", "optimisation")
    warmup_steps: int | None = setting(None, "linear warmup updates, from lr/N to lr (default: none for a data file; "
                                             "a named dataset's preset, at most a tenth of --steps)", "optimisation",
                                       type=int)
    warmup_ratio: float | None = setting(None, "linear warmup as a share of --steps, ceil(share × steps) updates "
                                               "(instead of --warmup-steps; TRL's warmup_ratio)", "optimisation",
                                         type=float)
    weight_decay: float = setting(0.0, "AdamW weight decay", "optimisation", type=float)
    max_grad_norm: float = setting(1.0, "gradient-norm clip", "optimisation", type=float)
    micro_batch_size: int | None = setting(None, "completions per forward/backward, any size, and per sampling call "
                                                 "unless --generation-batch-size says otherwise (default: the whole "
                                                 "batch)", "optimisation", type=int)
    max_tokens_per_micro_batch: int | None = setting(None, "micro-batches of at most N tokens (prompt + completion): "
                                                           "packed without padding where the attention allows, else "
                                                           "length-sorted buckets; a longer row goes alone",
                                                     "optimisation", type=int)
    gradient_checkpointing: bool = setting(False, "recompute every decoder layer in the backward: the least memory, "
                                                  "the most compute", "optimisation", action="store_true")
    checkpoint_mlp: bool = setting(False, "recompute each decoder layer's MLP in the backward instead of keeping its "
                                          "activations: on Llama-shaped models about half the activation memory "
                                          "for about a quarter more update time", "optimisation",
                                   action="store_true")
    offload_reference: bool = setting(False, "keep the frozen reference out of the process's memory between its "
                                             "passes (on the CPU a mapped file in the cache folder, on CUDA host "
                                             "memory): one model's weights less at the update's peak",
                                      "optimisation", action="store_true")

    def check(self) -> None:
        for flag, value in (("--learning-rate", self.learning_rate), ("--max-grad-norm", self.max_grad_norm)):
            if value is not None:
                check_positive_finite(flag, value)
        check_non_negative_finite("--weight-decay", self.weight_decay)
        check_choice("--lr-schedule", self.lr_schedule, SCHEDULES)
        check_non_negative_integers(("--warmup-steps", self.warmup_steps))
        if self.warmup_ratio is not None:
            if not (math.isfinite(self.warmup_ratio) and 0 <= self.warmup_ratio < 1):
                raise UserError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps is not None:
                raise UserError("--warmup-ratio and --warmup-steps both set the warmup: give one")
        check_positive_integers(("--micro-batch-size", self.micro_batch_size),
                                ("--max-tokens-per-micro-batch", self.max_tokens_per_micro_batch))
