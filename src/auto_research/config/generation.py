"""One generation-level run: RL on a causal LM (the paper's setting), validated once.

``validate`` raises ``UserError`` with one line that says what was wrong and what is allowed; it runs
before any data is read or any output is written, and imports neither NumPy nor torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from auto_research.algorithms.registry import (AGGREGATIONS, KL_ESTIMATORS, KL_PLACEMENTS, POLICY_LOSSES, REGISTRY,
                                               ROLLOUT_CORRECTIONS, STANDARD_DEVIATIONS, check_group_size, described,
                                               get_algorithm, kl_in_loss, kl_shapes_reward, names_by)
from auto_research.config.fields import (CANDIDATE_DATASETS, EMBEDDED_MODEL_DATASETS, GENERATION_DATASETS,
                                         HUB_DATASET, IN_MEMORY, PREFERENCE_DATASETS, check_choice, check_device,
                                         check_generation_dataset,
                                         check_non_negative_finite, check_non_negative_integers, check_positive_finite,
                                         check_positive_integers, comma_floats, default_dataset_dir, is_data_source,
                                         json_ready, setting)
from auto_research.config.environment import EnvironmentSettings
from auto_research.config.loss import by_algorithm, check_loss, having
from auto_research.config.rollout import check_rollout_engine, check_staleness, check_temperature
from auto_research.data.registry import generation_presets
from auto_research.engine.samplers import ENGINES, ROLLOUT_MODES
from auto_research.errors import UserError
from auto_research.rewards.verifiers import VERIFIERS

SCHEDULES = ("constant", "linear", "cosine")
SAMPLERS = tuple(ENGINES)  # engine/samplers.py lists them
MAX_REFILLS = 64
"""The most refills one slot may take in a step (--max-refills): each is a sampling round of its own, so a reward
that is constant on most prompts would otherwise hold step 1 for as long as the bound allows (1,000,000 never
ends). 64 tries at a slot where a prompt with signal turns up 1 time in 20 miss with probability 0.04."""


# Per-dataset defaults for settings the user leaves unset: each task record's, and a data file's (data/registry.py).
GENERATION_PRESETS = generation_presets()
WARMUP_SHARE = 10
"""A preset's warmup is at most steps // WARMUP_SHARE updates (a short run is not spent warming up)."""


@dataclass
class GenerationConfig(EnvironmentSettings):
    """One generation-level run: RL on a causal LM (the paper's setting).

    The fields are grouped in sections (``SECTIONS``); each one's metadata holds the
    help text the command line shows, so the flags of ``post-train`` and ``compare``
    are generated from this class (``cli/flags.py``). None means "the dataset's preset"
    (``GENERATION_PRESETS``) or "the algorithm's own".
    """

    # --- the run flags both levels share (config/candidate.py has the candidate level's defaults) ---
    algorithm: str = setting("rloo", f"one of {', '.join(REGISTRY)}")
    dataset: str = setting("arithmetic-generate", f"the generation level: {', '.join(GENERATION_DATASETS)}, or a "
                           ".jsonl, .json, .parquet or .csv file, a save_to_disk folder, hf:owner/name; the candidate "
                           f"level: {', '.join(CANDIDATE_DATASETS)}")
    dataset_dir: Path = setting(default_dataset_dir, "folder holding gsm8k/{train,test}.jsonl",
                                default_text="$AUTO_RESEARCH_DATA, else data", type=Path)
    maximum_examples: int | None = setting(None, "training prompts used: the dataset's first N", default_text="all",
                                           type=int)
    group_size: int = setting(4, "K: completions sampled per prompt", type=int)
    beta: float = setting(0.05, "β: weight of the KL penalty to the frozen reference", type=float)
    learning_rate: float | None = setting(None, "AdamW step size", default_text="per dataset", type=float)
    steps: int | None = setting(None, "policy updates", default_text="per dataset", type=int)
    seed: int = setting(42, "random seed", type=int)
    output_dir: Path = setting(lambda: Path("runs/post-training"), "where run folders go", type=Path)
    offline: bool = setting(False, "never download; missing data or models are an error", action="store_true")

    # --- data and model ---
    model: str | None = setting(None, "local folder or hub id of a causal LM (default: the embedded tiny model, "
                                      "arithmetic-generate only)", "data")
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

    # --- rewards ---
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

    # --- loss, KL and updates ---
    kl_estimator: str | None = setting(None, f"{', '.join(KL_ESTIMATORS)} (default: the algorithm's, "
                                       f"{by_algorithm('kl_estimator', KL_ESTIMATORS)}; moved into the loss by "
                                       "--kl-in, k3)", "loss")
    kl_in: str | None = setting(None, "; ".join(f"{placement}: {text} ({', '.join(names_by('kl').get(placement, []))})"
                                               for placement, text in KL_PLACEMENTS.items())
                                + " (default: the algorithm's)", "loss")
    loss_aggregation: str | None = setting(None, f"{described(AGGREGATIONS)} (default: the algorithm's: "
                                                 f"{by_algorithm('aggregation', AGGREGATIONS)})", "loss")
    updates_per_batch: int = setting(1, "epochs over each rollout batch; > 1 needs a loss with a ratio", "loss",
                                     flag="--ppo-epochs", aliases=("--updates-per-batch",), type=int)
    ppo_mini_batches: int = setting(1, "optimizer steps per epoch, each on whole groups; > 1 needs a loss with a "
                                       "ratio", "loss", type=int)
    policy_loss: str | None = setting(None, f"{described(POLICY_LOSSES)} (default: the algorithm's: "
                                            f"{by_algorithm('policy_loss', POLICY_LOSSES)}; with several updates per "
                                            "batch, clipped-token in place of vanilla)", "loss")
    clip_range: float | None = setting(None, "ε of the clipped ratio on both sides, 1 − ε … 1 + ε (default: the "
                                             "algorithm's; --clip-low and --clip-high set one side each and win)",
                                       "loss", type=float)
    clip_low: float | None = setting(None, "ε_low: ratios clipped below at 1 − ε_low, in [0, 1] (1: no lower bound, "
                                           "CISPO)", "loss", default_text="--clip-range, else the algorithm's: "
                                     "0.2; gspo 3e-4; cispo 1", type=float)
    clip_high: float | None = setting(None, "ε_high: ratios clipped above at 1 + ε_high, >= 0 (DAPO's clip-higher "
                                            "when above ε_low)", "loss", default_text="--clip-range, else the "
                                      "algorithm's: 0.2; dapo and cispo 0.28; gspo 4e-4", type=float)
    std: str | None = setting(None, f"the group std of {having('std')}: {described(STANDARD_DEVIATIONS)}", "loss",
                              default_text="population")
    normalize_advantages: bool = setting(False, "z-score the completions' advantages over the global batch, "
                                         "(A − mean A) / (std A + 1e-4), each completion once (TRL's option for "
                                         "RLOO); not for the algorithms that already whiten", "loss",
                                         action="store_true")
    mask_truncated: bool = setting(False, "leave completions that hit --max-new-tokens without ending out of the "
                                          "loss (DAPO's overlong filtering; TRL's mask_truncated_completions); they "
                                          "still count in their group's baseline", "loss", action="store_true")
    overlong_buffer: int | None = setting(None, "L of DAPO's soft overlong punishment, added to the reward: 0 up "
                                                "to --max-new-tokens − L tokens, then falling linearly to "
                                                "−--overlong-penalty at the limit; 0 = off", "loss",
                                          default_text="dapo: --max-new-tokens // 5, others 0", type=int)
    overlong_penalty: float | None = setting(None, "P, the overlong punishment at the length limit (needs "
                                                   "--overlong-buffer)", "loss", default_text="1.0 (DAPO)", type=float)
    entropy_coef: float = setting(0.0, "weight of the entropy bonus: the loss minus this × the policy's entropy, "
                                       "aggregated as the loss", "loss", type=float)

    # --- critic (ppo-rlhf) ---
    gae_lambda: float = setting(1.0, "λ of GAE (the RLOO paper's best for PPO; TRL uses 0.95)", "critic", type=float)
    value_clip: float = setting(0.2, "clip range of the value loss around the old values", "critic", type=float)
    vf_coef: float = setting(0.1, "weight of the value loss (the critic has its own AdamW)", "critic", type=float)
    critic_model: str | None = setting(None, "initial critic weights (default: --reward-model if given, else the "
                                             "policy)", "critic")
    whiten_advantages: bool = setting(True, "keep the advantages of algorithms that whiten them over the global batch "
                                      f"({having('whiten')}) as they are", "loss", flag="--no-whiten-advantages",
                                      action="store_false")

    # --- sampling ---
    temperature: float | None = setting(None, "sampling temperature (default: per dataset)", "sampling", type=float)
    top_p: float = setting(1.0, "nucleus sampling", "sampling", type=float)
    top_k: int = setting(0, "top-k sampling, 0 = off", "sampling", type=int)
    max_new_tokens: int | None = setting(None, "completion length limit (default: per dataset)", "sampling", type=int)
    prompts_per_step: int | None = setting(None, "prompts (groups) per step; the batch holds prompts × K completions "
                                                 "(default: per dataset)", "sampling", type=int)
    sampler: str = setting("builtin", "builtin (the training model's own decoding loop) or vllm (a vLLM engine, "
                                      "weights pushed after every optimizer step; see --vllm-mode)", "sampling")
    vllm_memory: float | None = setting(None, "on a GPU, the share of its memory vLLM may take for weights, "
                                              "activations and KV cache (default 0.3; the trainer needs the rest); "
                                              "on the CPU, the share of host memory for its KV cache (default 0.05)",
                                        "sampling", flag="--rollout-memory", aliases=("--vllm-memory",), type=float)
    vllm_mode: str = setting("colocate", "where the rollout engine runs: colocate (in each training process), "
                                         "server (an engine of its own, started by auto-research rollout-serve; "
                                         "see --rollout-server) or process (--sampler builtin: that server started "
                                         "by the run itself, on --rollout-cores)", "sampling", flag="--rollout-mode",
                             aliases=("--vllm-mode",))
    vllm_server: str | None = setting(None, "HOST:PORT of the rollout server (--rollout-mode server)", "sampling",
                                      flag="--rollout-server", aliases=("--vllm-server",))
    rollout_cores: str | None = setting(None, "CPUs of the rollout process (--rollout-mode process), e.g. 1 or 2-3; "
                                              "the trainer keeps the others", "sampling",
                                        default_text="the last core")
    rollout_correction: str | None = setting(None, "correct for the sampler's distribution differing from the "
                                                   f"trainer's: {', '.join(ROLLOUT_CORRECTIONS)} (default: the "
                                                   "algorithm's, "
                                                   f"{by_algorithm('rollout_correction', ROLLOUT_CORRECTIONS)}; "
                                                   "the identity with --sampler builtin)", "sampling")
    max_staleness: int = setting(0, "K: train on batches drawn by weights up to K steps older than the policy being "
                                    "updated, the rollout side sampling in a thread of its own while the trainer "
                                    "trains (step s is drawn by weights version max(0, s − 1 − K)); 0 = sample, then "
                                    "train (docs/async.md)", "sampling", type=int)
    dynamic_sampling: bool | None = setting(None, "drop groups whose K scores are all equal (no signal) and refill "
                                                  "their slots with fresh prompts, up to --max-refills times each, "
                                                  "before the step trains (DAPO; default: the algorithm's, on for "
                                                  "dapo)", "sampling", action=argparse.BooleanOptionalAction)
    max_refills: int = setting(4, "with --dynamic-sampling, the most fresh prompts one slot may try (at most "
                                  f"{MAX_REFILLS}); a slot still without signal trains on its first group "
                                  "(trained_no_signal_fraction)", "sampling", type=int)
    rollout_correction_cap: float = setting(2.0, "C of the truncated importance weight min(w, C); sequence-mask "
                                                 "drops completions whose weight is above C or below 1/C",
                                            "sampling", type=float)
    max_rollout_mismatch: float = setting(1.0, "stop the run, before it trains on a batch, when the sampler's "
                                               "log-probs are further than this from the trainer's, in nats a token "
                                               "on average (rollout_logprob_diff_mean; another engine or stale "
                                               "weights only): healthy runs measured 1e-5 to 0.15, a sampler with "
                                               "broken weights 4.3 (docs/vllm.md)", "sampling", type=float)

    # --- optimisation ---
    micro_batch_size: int | None = setting(None, "completions per forward/backward, any size, and per sampling call "
                                                 "unless --generation-batch-size says otherwise (default: the whole "
                                                 "batch)", "optimisation", type=int)
    generation_batch_size: int | None = setting(None, "completions per sampling call, rounded down to whole groups: "
                                                      "decoding reads every weight once a token, so more rows a call "
                                                      "is faster; the same on 1 and N processes keeps their numbers "
                                                      "equal (default: --micro-batch-size, else the whole batch)",
                                                "sampling", type=int)
    max_tokens_per_micro_batch: int | None = setting(None, "micro-batches of at most N tokens (prompt + completion): "
                                                           "packed without padding where the attention allows, else "
                                                           "length-sorted buckets; a longer row goes alone",
                                                     "optimisation", type=int)
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
    eval_every: int | None = setting(None, "evaluate every N steps, 0 = only at the end (default: steps // 10, at least 1)", "run",
                                     type=int)
    checkpoint_every: int = setting(100, "checkpoint every N steps, and always at the end", "run", type=int)
    keep_checkpoints: int = setting(2, "most recent checkpoints kept", "run", type=int)
    resume: bool = setting(False, "continue the run in --output-dir from its latest good checkpoint", "run",
                           action="store_true")
    overwrite: bool = setting(False, "start afresh where an earlier run is (deletes its checkpoints)", "run",
                              action="store_true")
    report_to: str = setting("none", "experiment trackers, comma-separated: tensorboard, wandb, trackio, mlflow "
                             "(each an extra: pip install 'auto-research[wandb]'), or none", "run")
    tracker_project: str = setting("auto-research", "the trackers' project (wandb: unless WANDB_PROJECT is set; "
                                   "mlflow: the experiment); each run is named after its folder", "run")
    log_completions: int = setting(8, "at every evaluation, the first N held-out prompts with their greedy "
                                      "completions, rewards and verdicts go to completions.jsonl (and report.md "
                                      "shows the last); 0 = none", "run", type=int)
    progress: bool = setting(True, "no progress bar or progress lines", "run", flag="--no-progress",
                             action="store_false")
    log_every: int | None = setting(None, "without a terminal, a progress line every N steps (metrics.jsonl and the "
                                          "trackers get every step)", "run", default_text="a twentieth of --steps",
                                    type=int)
    run_name: str | None = setting(None, "the run folder's name under --output-dir, also the trackers' run name",
                                   "run", default_text="ALGORITHM-DATASET-seedSEED")
    verbose: bool = setting(False, "show everything the engines print: vLLM's INFO lines and the known-harmless "
                                   "warnings hidden otherwise (docs/vllm.md)", "run", action="store_true")

    @property
    def dataset_name(self) -> str:
        if self.dataset.startswith(IN_MEMORY):
            return self.dataset[len(IN_MEMORY):] or "rows"
        if self.dataset.startswith(HUB_DATASET):
            return self.dataset[len(HUB_DATASET):].replace("/", "-")
        return Path(self.dataset).stem if is_data_source(self.dataset) else self.dataset

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / (self.run_name or f"{self.algorithm}-{self.dataset_name}-seed{self.seed}")

    @property
    def policy_loss_in_use(self) -> str:
        """--policy-loss, else the record's loss for this many updates per batch (``Algorithm.loss_for``): resolved
        here, not filled, since a copy of a filled config may change the updates per batch."""
        several = self.updates_per_batch > 1 or self.ppo_mini_batches > 1
        return self.policy_loss or get_algorithm(self.algorithm).loss_for(several)

    @classmethod
    def from_trl(cls, settings: dict, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """A config from TRL's names (an ``RLOOConfig``'s or ``GRPOConfig``'s fields as a dict, ``config.to_dict()``
        included) or ours, over ``base``: the same table as the flags and config files (``config/trl.py``,
        docs/trl.md); a TRL field we have no equivalent for is refused in one line."""
        from dataclasses import fields

        from auto_research.config import trl
        from auto_research.config.files import takes

        ours = {item.name: item for item in fields(cls)}
        base = base or cls()
        return replace(base, **trl.keywords(settings, lambda name, value: takes(ours[name], value) if name in ours
                                            else None, base))

    def filled(self) -> "GenerationConfig":
        """A copy with the dataset's presets in place of unset (None) settings, and the algorithm record's defaults
        (KL placement and estimator, aggregation, clip range, std, correction, overlong buffer); user code named
        as it is found from any folder (``user_code.resolved_spec``)."""
        preset = GENERATION_PRESETS[self.dataset if self.dataset in GENERATION_PRESETS else "jsonl"]
        values = {key: value for key, value in preset.items() if getattr(self, key) is None}
        filled = replace(self, **values)
        filled = replace(filled, **filled.resolved_user_code())
        record = get_algorithm(self.algorithm)
        if filled.eval_every is None:
            filled.eval_every = max(1, filled.steps // 10)
        if self.warmup_ratio is not None:
            filled.warmup_steps = math.ceil(filled.steps * self.warmup_ratio)
        elif self.warmup_steps is None:
            filled.warmup_steps = min(filled.warmup_steps, filled.steps // WARMUP_SHARE)
        if filled.kl_in is None:
            filled.kl_in = record.kl
        if filled.kl_estimator is None:
            filled.kl_estimator = record.kl_estimator_for(filled.kl_in)
        if filled.loss_aggregation is None:
            filled.loss_aggregation = record.aggregation
        if filled.clip_low is None:
            filled.clip_low = record.clip_low if filled.clip_range is None else filled.clip_range
        if filled.clip_high is None:
            filled.clip_high = record.clip_high if filled.clip_range is None else filled.clip_range
        if filled.std is None:
            filled.std = record.std
        if filled.rollout_correction is None:
            filled.rollout_correction = record.rollout_correction
        if filled.overlong_buffer is None and isinstance(filled.max_new_tokens, int):
            filled.overlong_buffer = int(record.overlong_buffer_fraction * filled.max_new_tokens)
        if filled.dynamic_sampling is None:
            filled.dynamic_sampling = record.dynamic_sampling
        if filled.overlong_penalty is None and filled.overlong_buffer:
            filled.overlong_penalty = 1.0
        return filled

    def validate(self) -> "GenerationConfig":
        """Every check that needs neither torch nor the data: runs before anything heavy is imported."""
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
        self.check_environment(algorithm.needs_greedy)
        check_non_negative_finite("--beta", self.beta)
        check_positive_integers(("--max-new-tokens", self.max_new_tokens), ("--steps", self.steps),
                                ("--prompts-per-step", self.prompts_per_step), ("--ppo-epochs", self.updates_per_batch),
                                ("--maximum-examples", self.maximum_examples),
                                ("--evaluation-examples", self.evaluation_examples), ("--threads", self.threads),
                                ("--micro-batch-size", self.micro_batch_size),
                                ("--max-tokens-per-micro-batch", self.max_tokens_per_micro_batch),
                                ("--generation-batch-size", self.generation_batch_size),
                                ("--ppo-mini-batches", self.ppo_mini_batches), ("--lora-r", self.lora_r))
        check_non_negative_integers(("--warmup-steps", self.warmup_steps), ("--checkpoint-every", self.checkpoint_every),
                                    ("--eval-every", self.eval_every), ("--top-k", self.top_k),
                                    ("--log-completions", self.log_completions))
        check_positive_integers(("--log-every", self.log_every))
        check_device(self.device)
        if self.warmup_ratio is not None:
            if not (math.isfinite(self.warmup_ratio) and 0 <= self.warmup_ratio < 1):
                raise UserError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
            if self.warmup_steps is not None:
                raise UserError("--warmup-ratio and --warmup-steps both set the warmup: give one")
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.temperature is not None:
            check_temperature(self.temperature)
        for flag, value in (("--learning-rate", self.learning_rate), ("--max-grad-norm", self.max_grad_norm),
                            ("--value-clip", self.value_clip), ("--lora-alpha", self.lora_alpha)):
            if value is not None:
                check_positive_finite(flag, value)
        check_choice("--sampler", self.sampler, SAMPLERS)
        if self.rollout_correction is not None:
            check_choice("--rollout-correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_positive_finite("--rollout-correction-cap", self.rollout_correction_cap)
        check_positive_finite("--max-rollout-mismatch", self.max_rollout_mismatch)
        if self.rollout_correction_cap < 1:
            raise UserError(f"--rollout-correction-cap must be >= 1 (a weight truncated below 1 down-weights every "
                            f"sample), got {self.rollout_correction_cap}")
        check_choice("--rollout-mode", self.vllm_mode, ROLLOUT_MODES)
        check_rollout_engine(self)
        check_staleness(self)
        if not 0 <= self.max_refills <= MAX_REFILLS:
            raise UserError(f"--max-refills must be in 0..{MAX_REFILLS} (each refill is a sampling round of the step), "
                            f"got {self.max_refills}")
        if self.dynamic_sampling and algorithm.needs_greedy:
            raise UserError(f"--dynamic-sampling with {self.algorithm} is not built (a refilled prompt would need its "
                            "greedy baseline too)")
        if not (0 < self.top_p <= 1):
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        check_non_negative_finite("--weight-decay", self.weight_decay)
        check_loss(self, algorithm)
        for flag, value, allowed in (("--lr-schedule", self.lr_schedule, SCHEDULES),
                                     ("--verifier", self.verifier, VERIFIERS)):
            check_choice(flag, value, allowed)
        if kl_shapes_reward(self.kl_in) and not kl_shapes_reward(algorithm.kl) and self.beta > 0:
            raise UserError(f"--kl-in reward: {self.algorithm}'s advantage does not use the shaped reward; "
                            "use --kl-in loss (or --beta 0)")
        if kl_in_loss(self.kl_in) and self.kl_estimator == "k1":
            raise UserError("--kl-estimator k1 with --kl-in loss: the expected gradient of a k1 loss term is zero, "
                            "so the penalty would do nothing; use k3 (the default there) or k2")
        if self.prompts_per_step is not None and self.prompts_per_step % self.ppo_mini_batches:
            raise UserError(f"--ppo-mini-batches {self.ppo_mini_batches} must divide --prompts-per-step "
                            f"{self.prompts_per_step} (each mini-batch holds whole groups)")
        if not (math.isfinite(self.gae_lambda) and 0 <= self.gae_lambda <= 1):
            raise UserError(f"--gae-lambda must be in [0, 1], got {self.gae_lambda}")
        check_non_negative_finite("--vf-coef", self.vf_coef)
        if self.critic_model is not None and not algorithm.needs_critic:
            with_critic = [name for name, record in REGISTRY.items() if record.needs_critic]
            raise UserError(f"--critic-model applies to {', '.join(with_critic)} only; {self.algorithm} has no critic")
        if self.dtype in ("float16", "fp16"):
            raise UserError("--dtype float16 would need loss scaling; use bfloat16 (fp32 master weights, bf16 compute) "
                            "or float32")
        if self.lora_r is None:
            for flag, value in (("--lora-alpha", self.lora_alpha), ("--lora-target-modules", self.lora_target_modules)):
                if value is not None:
                    raise UserError(f"{flag} needs --lora-r (LoRA is off without it)")
            if self.merge_lora:
                raise UserError("--merge-lora needs --lora-r (LoRA is off without it)")
        if self.offload_reference and self.lora_r:
            raise UserError("--offload-reference with --lora-r: the reference is the policy with its adapters off, "
                            "it has no weights of its own to offload")
        if self.offload_reference and self.fsdp:
            raise UserError("--offload-reference with --fsdp is not built (FSDP already shards the reference over "
                            "the ranks)")
        if not (0 <= self.lora_dropout < 1):
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None and not [name for name in self.lora_target_modules.split(",") if name.strip()]:
            raise UserError("--lora-target-modules is empty; give module names such as q_proj,v_proj")
        if self.dataset in PREFERENCE_DATASETS and not self.reward_model and not self.reward:
            raise UserError(f"{self.dataset} is optimised against a learned reward model: give --reward-model "
                            "(auto-research rlhf samples the preference pairs and trains one), or --reward")
        if self.judge is not None and self.judge != "gold":
            from auto_research.user_code import FORMS, split_spec  # noqa: PLC0415

            split_spec(self.judge, "--judge", f"gold or {FORMS}")  # the loader's own check, before any work
        for weight in self.reward_weights or ():
            if not math.isfinite(weight):
                raise UserError(f"--reward-weights must be finite numbers, got {weight}")
        from auto_research.report.trackers import parse_report_to

        parse_report_to(self.report_to)
        return self

    def validate_dataset(self) -> None:
        check_generation_dataset(self.dataset)
        if not is_data_source(self.dataset) and not self.dataset.startswith(IN_MEMORY):
            for flag, value in (("--prompt-field", self.prompt_field), ("--answer-field", self.answer_field),
                                ("--verifier", self.verifier)):
                if value is not None:
                    raise UserError(f"{flag} applies to .jsonl datasets only; {self.dataset} has fixed fields")

    def to_json(self) -> dict:
        return json_ready(asdict(self))
