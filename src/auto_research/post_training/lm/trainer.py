"""The generation-level loop: what runs in one step, and around it.

One step (``Trainer.step``) is a row of named phases, each a short method:

    collect            draw prompts, sample K completions each (one generate call)
    score              rewards; None leaves a sample out of its group's baseline, NaN stops
    reference          log π_ref of every completion token (no grad; when a KL is used)
    old log-probs      log π of the policy that sampled, entropy, and PPO's values (no grad)
    advantages         per-token rewards (score on the last token, −β·kl per token when the KL
                       shapes the reward) → the registered estimator (core.py)
    update actor       epochs × mini-batches of whole groups × micro-batches: the registered
                       policy loss, aggregated with the batch's global counts, AdamW
    update critic      PPO only: clipped value loss on the GAE returns, its own AdamW
    metrics            one row of metrics.jsonl

RLOO (the default) is the paper's: r̃_i = r_i − β Σ_t kl_t, the leave-one-out baseline,
loss −1/(groups·K) Σ_i A_i Σ_t log π(y_i,t). Weights and optimizer states are float32
(master weights); ``--dtype bfloat16`` runs the forward passes under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from auto_research.errors import TrainingInterrupted, UserError
from auto_research.files import atomic_write_text
from auto_research.post_training import estimators
from auto_research.post_training.algorithms import get_algorithm
from auto_research.post_training.config import GenerationConfig
from auto_research.post_training.lm import checkpoint as checkpoints
from auto_research.post_training.lm import core
from auto_research.post_training.lm.evaluation import evaluate
from auto_research.post_training.lm.distributed import World
from auto_research.post_training.lm.logprobs import completion_values, kl_per_token, token_logprobs
from auto_research.post_training.lm.models import (context_length, format_prompt, load_critic, load_policy,
                                                   resolve_device, resolve_dtype)
from auto_research.post_training.lm.rewards import RewardError, build_reward
from auto_research.post_training.lm.rollout import Rollout, concatenate, prompt_seed, sample
from auto_research.post_training.lm.tasks import load_task

# The estimator each algorithm uses at the generation level (core.ADVANTAGE_ESTIMATORS).
ESTIMATOR = {"rloo": "rloo", "grpo": "grpo", "reinforce": "reinforce", "vanilla-pg": "vanilla-pg",
             "remax": "remax", "raft": "raft", "ppo-rlhf": "gae"}


def learning_rate_at(config: GenerationConfig, update: int, total_updates: int) -> float:
    """Linear warmup, then constant or cosine decay to zero (update counted from 0)."""
    if config.warmup_steps and update < config.warmup_steps:
        return config.learning_rate * (update + 1) / config.warmup_steps
    if config.lr_schedule == "cosine":
        span = max(1, total_updates - config.warmup_steps)
        progress = min(1.0, (update - config.warmup_steps) / span)
        return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.learning_rate


@dataclass
class Trajectory:
    """One step's rollout and everything computed from it without gradient (B completions, T tokens)."""

    rollout: Rollout
    prompts: list[str]  # the G prompts, as the model saw them
    examples: list  # their dataset rows
    rewards: torch.Tensor | None = None  # (B,) task reward, 0 where unscored
    scored: torch.Tensor | None = None  # (B,) bool
    greedy_rewards: torch.Tensor | None = None  # (B,) ReMax's baseline
    reference_logprobs: torch.Tensor | None = None  # (B, T)
    old_logprobs: torch.Tensor | None = None  # (B, T) the policy that sampled
    entropy: torch.Tensor | None = None  # (B, T)
    values: torch.Tensor | None = None  # (B, T) PPO's critic
    kl: torch.Tensor | None = None  # (B, T) per-token KL estimate against the reference
    token_rewards: torch.Tensor | None = None  # (B, T) what the estimator sees
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.completion_mask.float()


def _user_error(message: str, cause: BaseException) -> UserError:
    """A UserError that stays quiet when its cause was another rank's failure (that rank reports it)."""
    error = UserError(message)
    error.quiet = getattr(cause, "quiet", False)
    return error


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    """(b, c) → (b, width), zeros on the right: a trimmed micro-batch's output at the batch's width."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1])) if values.shape[1] < width else values


def _figure(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


class Trainer:
    def __init__(self, config: GenerationConfig, log=print, task=None, resume_from: Path | None = None,
                 reward_functions: list[tuple[str, object]] = (), world: World | None = None, lock=None):
        self.config = config
        self.world = world
        self.lock = lock  # the run folder's FolderLock (rank 0), checked before every write
        self.reward_functions = list(reward_functions)
        self.log = log
        self.algorithm = get_algorithm(config.algorithm)
        self.run_dir = config.run_dir
        self.task = task
        self.resume_from = resume_from
        self.stop_signal: int | None = None
        self.run_dir_ready = False
        self.warned_unscored = False

    # --- setup: every check that can fail on user input happens here ---------------

    def setup(self) -> None:
        config = self.config
        self.world = self.world or World.from_environment(config.fsdp)
        if config.resume and self.resume_from is None:
            self.resume_from = checkpoints.resumable_checkpoint(config, self.log, self.world.size)
        if self.task is None:
            self.task = load_task(config)
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.device = self.world.device(resolve_device(config.device))
        self.world.start(self.device)
        # Master weights and optimizer states stay float32; bf16 is the compute dtype (autocast).
        self.compute_dtype = resolve_dtype(config.dtype, self.device)
        model_name = config.model
        if model_name is None:
            from auto_research.post_training.lm.tiny import ensure_warm_started

            # Rank 0 trains the embedded model once; the others wait, then read its cache.
            if self.world.main:
                model_name = str(ensure_warm_started(self.task, progress=config.progress, log=self.log))
            self.world.barrier()
            if not self.world.main:
                model_name = str(ensure_warm_started(self.task, progress=False, log=self.log))
        self.model_name = model_name
        self.model, self.tokenizer = load_policy(model_name, self.device, torch.float32, config.offline, log=self.log,
                                                 keep_adapter=bool(config.lora_r))
        if config.gradient_checkpointing:
            # transformers 5 renamed it; the old name still works on older releases.
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable()
        # The frozen reference is the initial policy (held in the compute dtype: it never trains);
        # with β = 0 it is not needed, unless the task measures over-optimisation against the KL (a
        # gold scorer). With LoRA it is the same model with its adapters off.
        self.reference = None
        measured = config.beta > 0 or self.task.gold is not None
        if config.lora_r:
            from auto_research.post_training.lm.lora import add_adapters

            self.model, self.reference = add_adapters(self.model, config, model_name)
            if not measured:
                self.reference = None
        elif measured:
            self.reference, _ = load_policy(model_name, self.device, self.compute_dtype, config.offline)
            self.reference.eval().requires_grad_(False)
        self.critic, self.critic_optimizer, self.critic_updates = None, None, 0
        if self.algorithm.needs_critic:
            source, flag = ((config.critic_model, "--critic-model") if config.critic_model else
                            (config.reward_model, "--reward-model (the critic's default start)") if config.reward_model
                            else (model_name, "--model"))
            self.critic = load_critic(source, self.device, config.offline, len(self.tokenizer), flag)
        self.updates_per_step = config.updates_per_batch * config.ppo_mini_batches
        self.reward = build_reward(config.reward, config.reward_weights, config.reward_model, self.task.verifier,
                                   self.device, config.offline, self.reward_functions)
        self.judge, self.baseline_completions, self.final_completions = None, None, {}
        if config.judge:
            from auto_research.post_training.lm.preference import load_judge

            self.judge = load_judge(config.judge, self.task)
        self.train_prompts = [format_prompt(self.tokenizer, example.prompt, config.chat_template) for example in self.task.train]
        self.eval_prompts = [format_prompt(self.tokenizer, example.prompt, config.chat_template) for example in self.task.evaluation]
        if config.prompts_per_step > len(self.train_prompts):
            raise UserError(f"--prompts-per-step {config.prompts_per_step}: a step draws distinct prompts, and "
                            f"{self.task.name} has {len(self.train_prompts)} training prompts")
        limit = context_length(self.model)
        if limit is not None:
            longest = max(len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
                          for prompt in self.train_prompts + self.eval_prompts)
            if longest + config.max_new_tokens > limit:
                raise UserError(f"prompts of up to {longest} tokens plus --max-new-tokens {config.max_new_tokens} "
                                f"exceed the model's context of {limit} tokens")
        state = rng = None
        if self.resume_from is not None:
            state, rng = checkpoints.read_trainer_state(self.resume_from)
            if config.lora_r:
                from auto_research.post_training.lm.lora import load_adapter_weights

                load_adapter_weights(self.resume_from, self.model)
            else:
                checkpoints.load_weights(self.resume_from, self.model)
            if self.critic is not None:
                checkpoints.load_weights(self.resume_from / "critic", self.critic)
        # Several processes: DDP around the models that train, or FSDP2 shards of every model.
        self.train_model = self.world.wrap(self.model)
        if self.reference is not None and not config.lora_r:
            self.world.wrap(self.reference, trains=False)
        self.optimizer = self._adamw(self.model)
        if self.critic is not None:
            self.train_critic = self.world.wrap(self.critic)
            self.critic_optimizer = self._adamw(self.critic)
        self.rng = np.random.default_rng(config.seed)
        self.algorithm_state: dict = {}
        self.history: list[dict] = []
        self.baseline: dict | None = None
        self.updates = 0
        self.start_step = 1
        self.totals = {"no_signal_groups": 0, "unscored_samples": 0, "generated_tokens": 0, "seconds": 0.0}
        if self.resume_from is not None:
            self._load_optimizer(self.train_model, self.optimizer, self.resume_from)
            if self.critic is not None:
                self._load_optimizer(self.train_critic, self.critic_optimizer, self.resume_from / "critic")
            checkpoints.restore_rng(rng, self.rng)
            self.algorithm_state = state["algorithm_state"]
            self.history, self.baseline = state["history"], state["baseline"]
            self.updates, self.totals = state["updates"], state["totals"]
            self.critic_updates = state.get("critic_updates", 0)
            self.baseline_completions = state.get("baseline_completions")
            self.start_step = state["step"] + 1
            self.run_dir_ready = True
            self.world.on_main(lambda: self._truncate_metrics(state["step"]))
            self.log(f"resumed from {self.resume_from} (step {state['step']})")
        self.writer = None

    def _adamw(self, model):
        """AdamW over the weights that train, in its multi-tensor (foreach) form: one kernel per
        operation for all parameters instead of a Python loop over them, the same arithmetic."""
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.config.learning_rate, weight_decay=self.config.weight_decay,
                                 foreach=True)

    def _load_optimizer(self, model, optimizer, folder: Path) -> None:
        saved = checkpoints.read_optimizer_state(folder)
        if all(isinstance(key, int) for key in saved["state"]):  # a checkpoint from before names
            optimizer.load_state_dict(saved)
        else:
            self.world.load_optimizer_state(model, optimizer, saved)

    # --- one step --------------------------------------------------------------------

    def _autocast(self):
        """bf16 compute over float32 master weights when --dtype bfloat16; nothing otherwise."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=self.compute_dtype)

    def _forward(self, model, trajectory: Trajectory, function, **options):
        """``function`` over the rollout in micro-batches, without gradient, concatenated.

        Each micro-batch is trimmed to its own longest prompt and completion (``Rollout.rows``), so
        no compute goes to columns that are padding in every row, and a micro-batch has the same
        shape whichever process holds it; outputs are padded back to the batch's width with zeros.
        """
        size = self.config.micro_batch_size or trajectory.rollout.sequences.shape[0]
        width = trajectory.rollout.completion_mask.shape[1]
        outputs = []
        with torch.no_grad(), self._autocast():
            for start in range(0, trajectory.rollout.sequences.shape[0], size):
                chunk = trajectory.rollout.rows(start, start + size, trim=True)
                result = function(model, chunk.sequences, chunk.prompt_mask, chunk.completion_mask, **options)
                outputs.append(tuple(_widen(part, width) for part in result) if isinstance(result, tuple)
                               else _widen(result, width))
        if isinstance(outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        return torch.cat(outputs)

    # --- one step: the phases --------------------------------------------------------

    def collect(self, step: int) -> Trajectory:
        """Draw distinct prompts (the same on every rank), keep this rank's share, and sample K
        completions for each from the prompt's own seed (the run's seed, the step, its index)."""
        config = self.config
        picks = self.rng.choice(len(self.task.train), size=config.prompts_per_step, replace=False)
        picks = [int(index) for index in self.world.share(list(picks), config.ppo_mini_batches)]
        prompts = [self.train_prompts[i] for i in picks]
        seeds = [prompt_seed(config.seed, step, index) for index in picks]
        # With --micro-batch-size, sampling runs in chunks of that many completions too: the same
        # chunks on 1 or N processes, hence the same floating-point numbers.
        chunk = max(1, config.micro_batch_size // config.group_size) if config.micro_batch_size else len(prompts)
        parts = []
        with self._autocast(), self.world.gathered(self.model):
            for start in range(0, len(prompts), chunk):
                parts.append(sample(self.model, self.tokenizer, prompts[start: start + chunk], config.group_size,
                                    config.max_new_tokens, config.temperature, config.top_p, config.top_k,
                                    seeds=seeds[start: start + chunk]))
        rollout = concatenate(parts, self.tokenizer.pad_token_id)
        return Trajectory(rollout, prompts, [self.task.train[i] for i in picks])

    def score(self, trajectory: Trajectory, step: int) -> None:
        """Task rewards of every completion (and of the greedy ones, for ReMax)."""
        K = self.config.group_size
        prompts = [prompt for prompt in trajectory.prompts for _ in range(K)]
        examples = [example for example in trajectory.examples for _ in range(K)]
        greedy = None
        if self.algorithm.needs_greedy:
            with self._autocast(), self.world.gathered(self.model):
                greedy = sample(self.model, self.tokenizer, trajectory.prompts, 1, self.config.max_new_tokens, greedy=True)
        failure = None
        try:
            values = self.reward(prompts, trajectory.rollout.completions, examples)
            greedy_values = self.reward(trajectory.prompts, greedy.completions, trajectory.examples) if greedy else None
        except RewardError as error:
            failure = error
        # A reward that fails on one rank stops every rank (each would otherwise wait for the others).
        self.world.agree(failure, RewardError)
        trajectory.scored = torch.tensor([value is not None for value in values])
        trajectory.rewards = torch.tensor([0.0 if value is None else value for value in values])
        unscored, total = (int(x) for x in self.world.total(torch.tensor([int((~trajectory.scored).sum()), len(values)])))
        if unscored == total:
            raise RewardError(f"no sample of step {step} could be scored: the reward returned None for all {unscored} "
                              "completions")
        if unscored and not self.warned_unscored:
            self.warned_unscored = True
            self.log(f"warning: the reward returned None for {unscored} of {total} samples at step {step}; "
                     "they are left out of their groups' baselines (counted in unscored_samples; warned once per run)")
        if greedy_values is not None:
            trajectory.greedy_rewards = torch.tensor([0.0 if v is None else v for v in greedy_values]).repeat_interleave(K)

    def reference_logprobs(self, trajectory: Trajectory) -> None:
        if self.reference is not None:
            trajectory.reference_logprobs = self._forward(self.reference, trajectory, token_logprobs,
                                                          temperature=self.config.temperature)

    def old_logprobs(self, trajectory: Trajectory) -> None:
        """log π of the policy that sampled (the ratios' denominator and the KL), its entropy, PPO's values."""
        trajectory.old_logprobs, trajectory.entropy = self._forward(
            self.model, trajectory, token_logprobs, temperature=self.config.temperature, with_entropy=True)
        if trajectory.reference_logprobs is not None:
            trajectory.kl = kl_per_token(trajectory.old_logprobs, trajectory.reference_logprobs,
                                         self.config.kl_estimator) * trajectory.mask
        else:
            trajectory.kl = torch.zeros_like(trajectory.old_logprobs)
        if self.critic is not None:
            trajectory.values = self._forward(self.critic, trajectory, completion_values) * trajectory.mask

    def estimate_advantages(self, trajectory: Trajectory) -> None:
        """Per-token rewards → the registered estimator → advantages and returns."""
        config, mask = self.config, trajectory.mask
        token_rewards = core.last_token(mask) * trajectory.rewards.unsqueeze(1)
        if config.kl_in == "reward":
            token_rewards = token_rewards - config.beta * trajectory.kl
        inputs = core.AdvantageInputs(token_rewards, mask, config.group_size, trajectory.scored,
                                      trajectory.greedy_rewards, trajectory.values, 1.0, config.gae_lambda,
                                      self.algorithm_state, total=self.world.total)
        advantages, returns = core.ADVANTAGE_ESTIMATORS[ESTIMATOR[config.algorithm]](inputs)
        if self.critic is not None and config.whiten_advantages:
            advantages = core.whiten(advantages, mask * trajectory.scored.float().unsqueeze(1), total=self.world.total)
        trajectory.advantages, trajectory.returns, trajectory.token_rewards = advantages, returns, token_rewards

    def _mini_batches(self, trajectory: Trajectory):
        """Slices of whole groups, one optimizer step each."""
        rows = trajectory.rollout.sequences.shape[0]
        size = rows // self.config.ppo_mini_batches
        return [slice(start, start + size) for start in range(0, rows, size)]

    def _micro_batches(self, rows: slice):
        size = self.config.micro_batch_size or (rows.stop - rows.start)
        return [slice(start, min(start + size, rows.stop)) for start in range(rows.start, rows.stop, size)]

    def _accumulating(self, trajectory: Trajectory, rows: slice, wrapped):
        """The trimmed micro-batches of one optimizer step, each body run inside DDP's ``no_sync``
        except the last, whose backward then all-reduces the accumulated gradient once."""
        parts = self._micro_batches(rows)
        for index, part in enumerate(parts):
            with self.world.no_sync(wrapped, last=index == len(parts) - 1):
                yield part, trajectory.rollout.rows(part.start, part.stop, trim=True)

    def _optimizer_step(self, model, optimizer) -> float:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], self.config.max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
        for group in optimizer.param_groups:
            group["lr"] = learning_rate_at(self.config, self.updates, self.config.steps * self.updates_per_step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def update_actor(self, trajectory: Trajectory) -> dict:
        """Epochs × mini-batches × micro-batches of the registered policy loss (plus the KL term in the loss)."""
        config, mask = self.config, trajectory.mask
        clipped = (self.algorithm.objective == "clipped" or config.updates_per_batch > 1 or config.ppo_mini_batches > 1)
        loss_function = core.POLICY_LOSSES[f"clipped-{config.ratio_level}" if clipped else "vanilla"]
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl_loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0}
        world, width = self.world, mask.shape[1]
        all_tokens = float(world.total(mask.sum()).clamp(min=1))
        for epoch in range(config.updates_per_batch):
            for rows in self._mini_batches(trajectory):
                # Global counts of this optimizer step (over every rank): micro-batch shares sum to its
                # exact loss. DDP and FSDP average gradients over ranks, hence the loss × N.
                sequences = (rows.stop - rows.start) * world.size
                counts = dict(sequences=float(sequences), tokens=float(world.total(mask[rows].sum()).clamp(min=1)),
                              groups=float(sequences // config.group_size))
                for part, chunk in self._accumulating(trajectory, rows, self.train_model):
                    with self._autocast():
                        logprobs = _widen(token_logprobs(self.train_model, chunk.sequences, chunk.prompt_mask,
                                                         chunk.completion_mask, config.temperature), width)
                    inputs = core.LossInputs(logprobs, trajectory.old_logprobs[part], trajectory.advantages[part],
                                             mask[part], config.clip_range)
                    pg = core.aggregate(loss_function(inputs), mask[part], config.loss_aggregation, **counts,
                                        per_group_sum=self.algorithm.reduction == "sum")
                    loss = pg
                    if config.kl_in == "loss" and trajectory.reference_logprobs is not None and config.beta > 0:
                        kl = kl_per_token(logprobs, trajectory.reference_logprobs[part], config.kl_estimator)
                        kl_loss = config.beta * core.aggregate(kl, mask[part], config.loss_aggregation, **counts)
                        loss = loss + kl_loss
                        totals["kl_loss"] += float(kl_loss.detach())
                    (loss * world.size if world.distributed else loss).backward()
                    totals["loss"] += float(loss.detach())
                    totals["pg_loss"] += float(pg.detach())
                    if clipped:
                        ratio = torch.exp(logprobs.detach() - trajectory.old_logprobs[part])
                        outside = ((ratio - 1).abs() > config.clip_range).float() * mask[part]
                        totals["clip_fraction"] += float(outside.sum()) / all_tokens
                totals["grad_norm"] = self._optimizer_step(self.model, self.optimizer)
                self.updates += 1
        # Losses are reported per optimizer step (averaged, summed over ranks); the gradient norm is the last step's.
        summed = world.total(torch.tensor([totals[key] for key in ("loss", "pg_loss", "kl_loss", "clip_fraction")],
                                          dtype=torch.float64))
        for key, value in zip(("loss", "pg_loss", "kl_loss", "clip_fraction"), summed.tolist()):
            totals[key] = value / self.updates_per_step
        return totals

    def update_critic(self, trajectory: Trajectory) -> dict:
        """PPO's critic: ½·max((V − R)², (V_clip − R)²) on the GAE returns, token-mean, times --vf-coef."""
        if self.critic is None:
            return {}
        config, mask = self.config, trajectory.mask * trajectory.scored.float().unsqueeze(1)
        world, width = self.world, mask.shape[1]
        value_loss = 0.0
        for epoch in range(config.updates_per_batch):
            for rows in self._mini_batches(trajectory):
                tokens = float(world.total(mask[rows].sum()).clamp(min=1))
                for part, chunk in self._accumulating(trajectory, rows, self.train_critic):
                    with self._autocast():
                        values = _widen(completion_values(self.train_critic, chunk.sequences, chunk.prompt_mask,
                                                          chunk.completion_mask), width)
                    terms = core.clipped_value_loss(values, trajectory.values[part], trajectory.returns[part],
                                                    config.value_clip)
                    loss = config.vf_coef * (terms * mask[part]).sum() / tokens
                    (loss * world.size if world.distributed else loss).backward()
                    value_loss += float(loss.detach()) / max(config.vf_coef, 1e-12)
                self._optimizer_step(self.critic, self.critic_optimizer)
        count = world.total(mask.sum()).clamp(min=1)
        mean = world.total((trajectory.returns * mask).sum()) / count
        sums = world.total(torch.stack([((trajectory.returns - trajectory.values) * mask).square().sum(),
                                        ((trajectory.returns - mean) * mask).square().sum(),
                                        torch.tensor(value_loss, dtype=torch.float32)]).double())
        residual, variance, value_loss = sums.tolist()
        explained = 1.0 - residual / max(variance, 1e-12)
        self.critic_updates += self.updates_per_step
        return {"value_loss": value_loss / self.updates_per_step,
                "explained_variance": explained}

    def step(self, step: int) -> dict:
        started = time.perf_counter()
        trajectory = self.collect(step)
        self.score(trajectory, step)
        self.reference_logprobs(trajectory)
        self.old_logprobs(trajectory)
        self.estimate_advantages(trajectory)
        actor = self.update_actor(trajectory)
        critic = self.update_critic(trajectory)
        return self.step_metrics(step, trajectory, actor, critic, time.perf_counter() - started)

    def step_metrics(self, step: int, trajectory: Trajectory, actor: dict, critic: dict, elapsed: float) -> dict:
        config, mask, K = self.config, trajectory.mask, self.config.group_size
        # Per-sequence figures of every rank, in rank order (each rank holds whole groups).
        gather = self.world.gather
        scored = gather(trajectory.scored)
        all_rewards = gather(trajectory.rewards.double())
        rewards = all_rewards[scored]
        kl_sequence = gather(trajectory.kl.sum(1).double())
        # The RL objective of the paper: E[r − β·KL], over the scored samples.
        objective = (all_rewards - config.beta * kl_sequence)[scored]
        sequence_advantages = gather(((trajectory.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)).double())
        no_signal = estimators.groups_without_signal(sequence_advantages.view(-1, K).numpy())
        lengths = gather(mask.sum(1).double())
        entropy = float(gather(trajectory.entropy.sum(1).double()).sum())
        generated = int(lengths.sum())
        sequences = lengths.shape[0]
        self.totals["no_signal_groups"] += no_signal
        self.totals["unscored_samples"] += int((~scored).sum())
        self.totals["generated_tokens"] += generated
        self.totals["seconds"] += elapsed
        return {
            "step": step,
            **actor,
            "objective": float(objective.mean()),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)) if rewards.numel() else float("nan"),
            "kl": float(kl_sequence.mean()),
            "entropy": entropy / max(generated, 1),
            "completion_length": generated / sequences,
            "advantage_mean": float(sequence_advantages.mean()),
            "advantage_std": float(sequence_advantages.double().std(unbiased=False)),
            "advantage_abs_max": float(sequence_advantages.abs().max()),
            "no_signal_fraction": no_signal / (sequences // K),
            "unscored_samples": int((~scored).sum()),
            **critic,
            "learning_rate": self.optimizer.param_groups[0]["lr"],
            "tokens_per_second": generated / elapsed,
            "step_seconds": elapsed,
        }

    def save_merged(self) -> Path | None:
        """--merge-lora: base weights with the trained adapter folded in, in <run>/merged (rank 0)."""
        from auto_research.post_training.lm.lora import save_merged

        folder = self.run_dir / "merged"
        if self.world.main:
            save_merged(self.model, self.tokenizer, folder)
            self.log(f"wrote the merged model to {folder}")
        self.world.barrier()
        return folder

    # --- evaluation, checkpoints, metrics ----------------------------------------------

    def evaluate(self, completions: dict | None = None) -> dict:
        """Held-out evaluation, its batches dealt out to the ranks and the sums added up. With
        ``completions`` (a dict), it receives every held-out prompt's greedy completion by index."""
        failure, result, mine = None, None, {}
        with self._autocast(), self.world.gathered(self.model, self.reference):
            try:
                result = evaluate(self.model, self.reference, self.tokenizer, self.eval_prompts, self.task.evaluation,
                                  self.task.verifier, self.reward, self.config.max_new_tokens, self.config.temperature,
                                  shard=(self.world.rank, self.world.size), total=self.world.total,
                                  gold=self.task.gold, completions=mine if completions is not None else None)
            except RewardError as error:
                failure = error
        self.world.agree(failure, RewardError)
        if completions is not None:
            for part in self.world.gather_objects(mine):
                completions.update(part)
        return result

    def win_rate(self, new: list[str]) -> float:
        """Held-out win rate of ``new`` greedy completions against the starting policy's, judged both ways round."""
        from auto_research.post_training.lm.preference import win_rate

        total, count = win_rate(self.judge, self.config.judge, self.eval_prompts, self.task.evaluation, new,
                                self.baseline_completions)
        return total / max(count, 1.0)

    def _completions(self) -> list[str]:
        """The final policy's greedy held-out completions: those of the last evaluation when the loop
        made one at the final step (and this process ran it), else from a fresh evaluation."""
        found = self.final_completions
        if len(found) < len(self.eval_prompts):
            found = {}
            self.evaluate(found)
        return [found[index] for index in range(len(self.eval_prompts))]

    def parameter_counts(self) -> dict:
        """Trainable and total parameters of every model held: policy, critic, reference, reward model."""
        def count(model):
            return sum(parameter.numel() for parameter in model.parameters()) if model is not None else 0

        def trainable(model):
            return sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else 0

        reward_model = next((f for _, f, _ in self.reward.components if hasattr(f, "model")), None)
        # With LoRA the reference is the policy with its adapters off: no weights of its own.
        reference = None if self.config.lora_r else self.reference
        held = {"policy": count(self.model), "critic": count(self.critic), "reference": count(reference),
                "reward_model": count(getattr(reward_model, "model", None))}
        return {**held, "trainable": trainable(self.model) + trainable(self.critic), "total": sum(held.values())}

    def trainer_state(self, step: int) -> dict:
        return {"config": self.config.to_json(), "algorithm_state": self.algorithm_state, "history": self.history,
                "baseline": self.baseline, "updates": self.updates, "totals": self.totals, "model": self.model_name,
                "critic_updates": self.critic_updates, "world_size": self.world.size,
                "baseline_completions": self.baseline_completions}

    def save(self, step: int, rng: dict | None = None) -> Path:
        """One checkpoint: every rank helps gather sharded state (FSDP), rank 0 writes it."""
        world = self.world
        model_state = world.full_state(self.model)
        optimizer_state = world.optimizer_state(self.train_model, self.optimizer)
        critic_state = critic_optimizer_state = None
        if self.critic is not None:
            critic_state = world.full_state(self.critic)
            critic_optimizer_state = world.optimizer_state(self.train_critic, self.critic_optimizer)
        rng = rng or checkpoints.capture_rng(self.rng)

        def write():
            self._open_run_dir()
            return checkpoints.save_checkpoint(self.run_dir, step, self.model, self.tokenizer, optimizer_state, rng,
                                               self.trainer_state(step), self.config.keep_checkpoints, self.critic,
                                               critic_optimizer_state, model_state, critic_state)

        world.on_main(write)
        return self.run_dir / "checkpoints" / f"{checkpoints.PREFIX}{step:06d}"

    def _truncate_metrics(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
            atomic_write_text(path, "".join(line + "\n" for line in kept))

    def _open_run_dir(self) -> None:
        """Create the run folder at the first write, once the inputs have proved themselves on a real step.

        A run that fails on its first batch (a reward that raises, returns
        nothing usable) leaves no folder behind. ``--overwrite`` deletes the
        earlier run's outputs here, not before.
        """
        if self.lock is not None:
            self.lock.check()
        if self.run_dir_ready:
            return
        if self.config.overwrite:
            checkpoints.clear_run_folder(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir_ready = True

    def _append_metrics(self, row: dict) -> None:
        self._open_run_dir()
        if self.config.report_to == "tensorboard" and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        # JSON has no NaN: a figure that could not be computed is written as null.
        clean = {key: value if not isinstance(value, float) or math.isfinite(value) else None for key, value in row.items()}
        with (self.run_dir / "metrics.jsonl").open("a") as stream:
            stream.write(json.dumps(clean, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, row["step"])

    def _request_stop(self, signum, frame) -> None:
        if self.stop_signal is not None:  # a second Ctrl-C (or SIGTERM) stops at once
            raise KeyboardInterrupt
        self.stop_signal = signum
        name = "interrupt" if signum == signal.SIGINT else "SIGTERM"
        self.log(f"\n{name}: finishing this step, saving a checkpoint, then stopping (send it again to abort)")

    def _write_failed(self, error: OSError, last_saved: int | None) -> UserError:
        """A full disk (or any failed write): one line, and the last good checkpoint left as it was."""
        reason = error.strerror or str(error)
        if not self.world.main:
            kept = "rank 0 reports it"
        elif last_saved is not None:
            kept = f"the last good checkpoint is {self.run_dir / 'checkpoints' / f'{checkpoints.PREFIX}{last_saved:06d}'}"
        else:
            kept = "no checkpoint had been saved yet"
            # Nothing resumable was written: do not leave a lone metrics.jsonl for --resume to trip on.
            if self.lock is not None and self.lock.created is not None:
                self.lock.remove_created()
            else:
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        return _user_error(f"cannot write to {self.run_dir}: {reason} (errno {error.errno}); {kept}", error)

    # --- the loop ---------------------------------------------------------------------

    def train(self) -> dict:
        from auto_research.progress import Progress

        config = self.config
        if self.resume_from is None:
            try:
                if self.judge is not None:
                    found: dict = {}
                    self.baseline = self.evaluate(found)
                    self.baseline_completions = [found[index] for index in range(len(self.eval_prompts))]
                    # The judge on the starting policy against itself: a judge that fails fails now, not at the end.
                    self.baseline["win_rate"] = self.win_rate(self.baseline_completions)
                else:
                    self.baseline = self.evaluate()
            except RewardError as error:
                raise _user_error(f"{error} (evaluation before training)", error) from None
            self.log(f"before training: held-out accuracy {self.baseline['accuracy']:.3f}, "
                     f"mean reward {_figure(self.baseline['mean_reward'])}")
        handlers = {signum: signal.signal(signum, self._request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        bar = Progress(config.steps, f"{config.algorithm} on {self.task.name}", initial=self.start_step - 1,
                       enabled=config.progress and self.world.main, write=self.log)
        last_step = self.start_step - 1
        last_saved = last_step if self.resume_from is not None else None
        try:
            for step in range(self.start_step, config.steps + 1):
                rng_before = checkpoints.capture_rng(self.rng)
                try:
                    row = self.step(step)
                except RewardError as error:
                    if last_step > 0:
                        saved = self.save(last_step, rng_before)
                        where = f"saved the last good step ({last_step}) in {saved}"
                    else:
                        where = "nothing was written"
                    raise _user_error(f"{error}; {where}", error) from None
                last_step = step
                self.world.on_main(lambda: self._append_metrics(row))
                postfix = {"reward": _figure(row["reward_mean"]), "kl": f"{row['kl']:.3f}"}
                if config.eval_every and (step % config.eval_every == 0 or step == config.steps):
                    try:
                        # The last evaluation keeps its greedy completions for the judge's win rate.
                        last = self.judge is not None and step == config.steps
                        metrics = self.evaluate(self.final_completions if last else None)
                    except RewardError as error:
                        raise _user_error(f"{error} (held-out evaluation); saved step {step} in {self.save(step)}",
                                          error) from None
                    self.history.append({"step": float(step), "loss": row["loss"], **metrics})
                    if self.writer is not None:
                        for key, value in metrics.items():
                            if value is not None:
                                self.writer.add_scalar(f"eval/{key}", value, step)
                if self.history:
                    postfix["acc"] = f"{self.history[-1]['accuracy']:.3f}"
                bar.update(postfix)
                # A signal that reached one rank stops them all after this step.
                if self.world.any(self.stop_signal is not None) and self.stop_signal is None:
                    self.stop_signal = signal.SIGTERM
                if (step == config.steps or (config.checkpoint_every and step % config.checkpoint_every == 0)
                        or self.stop_signal is not None):
                    self.save(step)
                    last_saved = step
                if self.stop_signal is not None:
                    raise TrainingInterrupted(
                        f"interrupted after step {step}; checkpoint saved in {self.run_dir / 'checkpoints'}: "
                        "continue with the same command and --resume", 128 + self.stop_signal)
        except OSError as error:
            raise self._write_failed(error, last_saved) from None
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            bar.close()
            if self.writer is not None:
                self.writer.close()
        if self.totals["unscored_samples"]:
            self.log(f"warning: {self.totals['unscored_samples']} samples of this run could not be scored (reward None)")
        return self.metrics()

    def metrics(self) -> dict:
        config = self.config
        if self.history and self.history[-1]["step"] == config.steps:
            final = {key: self.history[-1][key] for key in ("accuracy", "mean_reward", "entropy", "kl_from_reference",
                                                            "gold_reward") if key in self.history[-1]}
        else:
            try:
                final = self.evaluate()
            except RewardError as error:
                raise _user_error(f"{error} (final evaluation; the last checkpoint holds the trained model)",
                                  error) from None
        if self.judge is not None:
            try:
                final["win_rate"] = self.win_rate(self._completions())
            except RewardError as error:
                raise _user_error(f"{error} (win rate; the last checkpoint holds the trained model)", error) from None
        return {
            "algorithm": config.algorithm,
            "dataset": self.task.name,
            "level": "generation",
            "seed": config.seed,
            "model": self.model_name,
            "baseline": self.baseline,
            "final": final,
            "relative_accuracy": (final["accuracy"] - self.baseline["accuracy"]) / max(self.baseline["accuracy"], 1e-12),
            "training": {
                "steps": config.steps,
                "learning_rate": config.learning_rate,
                "group_size": config.group_size,
                "beta": config.beta,
                "train_examples": len(self.task.train),
                "validation_examples": len(self.task.evaluation),
                "data_source": self.task.source,
                "prompts_per_step": config.prompts_per_step,
                "kl_estimator": config.kl_estimator,
                "kl_in": config.kl_in,
                "loss_aggregation": config.loss_aggregation,
                "updates_per_batch": config.updates_per_batch,
                "ppo_mini_batches": config.ppo_mini_batches,
                "ratio_level": config.ratio_level,
                "dtype": str(self.compute_dtype).replace("torch.", ""),
                "temperature": config.temperature,
                "max_new_tokens": config.max_new_tokens,
                "optimizer_updates": self.updates,
                "no_signal_groups": self.totals["no_signal_groups"],
                "unscored_samples": self.totals["unscored_samples"],
                "training_seconds": self.totals["seconds"],
                "tokens_per_second": self.totals["generated_tokens"] / max(self.totals["seconds"], 1e-9),
                "critic_updates": self.critic_updates,
                **({"gae_lambda": config.gae_lambda, "vf_coef": config.vf_coef, "value_clip": config.value_clip,
                    "whiten_advantages": config.whiten_advantages} if self.critic is not None else {}),
                "parameters": self.parameter_counts(),
            },
            "history": self.history,
        }
