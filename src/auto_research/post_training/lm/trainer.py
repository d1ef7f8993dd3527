"""The generation-level loop: what runs in one RLOO step, and around it.

One step (``Trainer.step``):

1. draw ``prompts_per_step`` prompts; sample K completions each in one
   ``generate`` call (rollout.py);
2. score them (rewards.py); a None reward leaves that sample out of its group's
   baseline, a NaN saves the last good step and stops;
3. one no-grad forward of the frozen reference (when β > 0);
4. per micro-batch of whole groups, one forward/backward of the policy: the
   log-probs give the sampled KL, the shaped reward r̃ = r − β·KL, the
   advantages from the registered estimator (leave-one-out for RLOO), and the
   loss −1/(groups·K) Σ_i A_i Σ_t log π(y_i,t) (the paper's: the whole response
   is one action);
5. clip the gradient norm, step AdamW, log a metrics row.

With ``--updates-per-batch`` > 1 the same rollout is reused with PPO-style
clipped importance ratios; the old log-probs are those of the first pass, so
no extra forward is needed.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from auto_research.errors import TrainingInterrupted, UserError
from auto_research.files import atomic_write_text
from auto_research.post_training import estimators
from auto_research.post_training.algorithms import AdvantageInputs, get_algorithm
from auto_research.post_training.config import GenerationConfig
from auto_research.post_training.lm import checkpoint as checkpoints
from auto_research.post_training.lm.evaluation import evaluate
from auto_research.post_training.lm.logprobs import kl_per_token, token_logprobs
from auto_research.post_training.lm.models import context_length, format_prompt, load_policy, resolve_device, resolve_dtype
from auto_research.post_training.lm.rewards import RewardError, build_reward
from auto_research.post_training.lm.rollout import sample
from auto_research.post_training.lm.tasks import load_task


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
class StepBatch:
    """The rollout of one step and everything computed from it without gradient."""

    rollout: object
    rewards: np.ndarray  # (G, K), 0 where unscored
    scored: np.ndarray  # (G, K) bool
    greedy_rewards: np.ndarray | None
    reference_logprobs: torch.Tensor | None  # (B, C)


def policy_loss(config: GenerationConfig, algorithm, logprobs, old_logprobs, reference_logprobs, mask, advantages,
                sequences_in_batch: int, groups_in_batch: int, tokens_in_batch: float):
    """This micro-batch's share of the batch loss (summing the shares gives the batch mean).

    ``advantages`` (n,) are per sequence and carry no gradient. With ratio = 1
    (on-policy), the gradient is −Σ_i A_i ∇ Σ_t log π(y_i,t) / normaliser: REINFORCE.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = estimators.clipped_surrogate(ratio, advantages.unsqueeze(1), config.clip_range) * mask
    if config.loss_aggregation == "token-mean":
        loss = -surrogate.sum() / tokens_in_batch
    else:
        denominator = groups_in_batch if algorithm.reduction == "sum" else sequences_in_batch
        loss = -surrogate.sum() / denominator
    if config.kl_in == "loss" and reference_logprobs is not None and config.beta > 0:
        kl = kl_per_token(logprobs, reference_logprobs, config.kl_estimator) * mask
        denominator = tokens_in_batch if config.loss_aggregation == "token-mean" else sequences_in_batch
        loss = loss + config.beta * kl.sum() / denominator
    return loss


def _figure(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3f}"


class Trainer:
    def __init__(self, config: GenerationConfig, log=print, task=None, resume_from: Path | None = None):
        self.config = config
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
        if config.resume and self.resume_from is None:
            self.resume_from = checkpoints.resumable_checkpoint(config, self.log)
        if self.task is None:
            self.task = load_task(config)
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        model_name = config.model
        if model_name is None:
            from auto_research.post_training.lm.tiny import ensure_warm_started

            model_name = str(ensure_warm_started(self.task, progress=config.progress, log=self.log))
        self.model_name = model_name
        self.model, self.tokenizer = load_policy(model_name, self.device, dtype, config.offline, log=self.log)
        if config.gradient_checkpointing:
            # transformers 5 renamed it; the old name still works on older releases.
            enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            enable()
        # The frozen reference is the initial policy; with β = 0 it is not needed at all.
        self.reference = None
        if config.beta > 0:
            self.reference, _ = load_policy(model_name, self.device, dtype, config.offline)
            self.reference.eval().requires_grad_(False)
        self.reward = build_reward(config.reward, config.reward_weights, config.reward_model, self.task.verifier,
                                   self.device, config.offline)
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
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.rng = np.random.default_rng(config.seed)
        self.algorithm_state: dict = {}
        self.history: list[dict] = []
        self.baseline: dict | None = None
        self.updates = 0
        self.start_step = 1
        self.totals = {"no_signal_groups": 0, "unscored_samples": 0, "generated_tokens": 0, "seconds": 0.0}
        if self.resume_from is not None:
            state, rng = checkpoints.load_checkpoint(self.resume_from, self.model, self.optimizer)
            checkpoints.restore_rng(rng, self.rng)
            self.algorithm_state = state["algorithm_state"]
            self.history, self.baseline = state["history"], state["baseline"]
            self.updates, self.totals = state["updates"], state["totals"]
            self.start_step = state["step"] + 1
            self.run_dir_ready = True
            self._truncate_metrics(state["step"])
            self.log(f"resumed from {self.resume_from} (step {state['step']})")
        self.writer = None

    # --- one step --------------------------------------------------------------------

    def collect(self) -> tuple[StepBatch, list]:
        """Rollout, rewards and reference log-probs: everything without gradient."""
        config = self.config
        picks = self.rng.choice(len(self.task.train), size=min(config.prompts_per_step, len(self.task.train)), replace=False)
        prompts = [self.train_prompts[i] for i in picks]
        examples = [self.task.train[i] for i in picks]
        K = config.group_size
        rollout = sample(self.model, self.tokenizer, prompts, K, config.max_new_tokens,
                         config.temperature, config.top_p, config.top_k)
        repeated_prompts = [prompt for prompt in prompts for _ in range(K)]
        repeated_examples = [example for example in examples for _ in range(K)]
        values = self.reward(repeated_prompts, rollout.completions, repeated_examples)
        scored = np.array([value is not None for value in values]).reshape(-1, K)
        rewards = np.array([0.0 if value is None else value for value in values]).reshape(-1, K)
        greedy_rewards = None
        if self.algorithm.needs_greedy:
            greedy = sample(self.model, self.tokenizer, prompts, 1, config.max_new_tokens, greedy=True)
            greedy_values = self.reward(prompts, greedy.completions, examples)
            greedy_rewards = np.array([[0.0 if value is None else value] for value in greedy_values])
        reference_logprobs = None
        if self.reference is not None:
            with torch.no_grad():
                reference_logprobs = torch.cat([
                    token_logprobs(self.reference, chunk.sequences, chunk.prompt_mask, chunk.completion_mask, config.temperature)
                    for chunk in self._chunks(rollout)
                ])
        return StepBatch(rollout, rewards, scored, greedy_rewards, reference_logprobs), examples

    def _chunk_size(self) -> int:
        K = self.config.group_size
        return self.config.micro_batch_size or self.config.prompts_per_step * K

    def _chunks(self, rollout):
        size = self._chunk_size()
        for start in range(0, rollout.sequences.shape[0], size):
            yield rollout.rows(start, start + size)

    def _sampled_kl(self, batch: StepBatch, groups: slice, logprobs: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        """(groups, K) sampled KL of each completion: the chosen estimator summed over its tokens."""
        K = self.config.group_size
        if batch.reference_logprobs is None:
            return np.zeros((groups.stop - groups.start, K))
        rows = slice(groups.start * K, groups.stop * K)
        kl = (kl_per_token(logprobs, batch.reference_logprobs[rows], self.config.kl_estimator) * mask).sum(1)
        return kl.double().cpu().numpy().reshape(-1, K)

    def _advantages(self, batch: StepBatch, groups: slice, kl: np.ndarray, state: dict) -> np.ndarray:
        """Advantages of the given groups from the registered estimator."""
        inputs = AdvantageInputs(
            rewards=batch.rewards[groups],
            log_ratio=kl,
            beta=self.config.beta if self.config.kl_in == "reward" else 0.0,
            mask=batch.scored[groups],
            greedy_rewards=None if batch.greedy_rewards is None else batch.greedy_rewards[groups],
        )
        return self.algorithm.advantages(inputs, state)

    def step(self, step: int) -> dict:
        config = self.config
        started = time.perf_counter()
        batch, examples = self.collect()
        unscored = int((~batch.scored).sum())
        if unscored == batch.scored.size:
            raise RewardError(f"no sample of step {step} could be scored: the reward returned None for all {unscored} "
                              "completions")
        if unscored and not self.warned_unscored:
            self.warned_unscored = True
            self.log(f"warning: the reward returned None for {unscored} of {batch.scored.size} samples at step {step}; "
                     "they are left out of their groups' baselines (counted in unscored_samples; warned once per run)")
        rollout = batch.rollout
        K = config.group_size
        groups_total = batch.rewards.shape[0]
        sequences_total = groups_total * K
        tokens_total = float(rollout.completion_mask.sum().clamp(min=1))
        size = self._chunk_size()
        whole_groups = size % K == 0
        advantages = np.zeros((groups_total, K))
        kls = np.zeros((groups_total, K))
        old = [None] * math.ceil(sequences_total / size)
        # Micro-batches read the algorithm's state as it was when the step began (a
        # moving-average baseline must not move between them); it advances once, below.
        state_at_start = json.loads(json.dumps(self.algorithm_state))
        if not whole_groups:
            # A group does not fit in one micro-batch: score every group once without
            # gradient so that its baseline sees all K log-probs.
            with torch.no_grad():
                for g in range(groups_total):
                    group = rollout.rows(g * K, (g + 1) * K)
                    logprobs = token_logprobs(self.model, group.sequences, group.prompt_mask, group.completion_mask, config.temperature)
                    kls[g] = self._sampled_kl(batch, slice(g, g + 1), logprobs, group.completion_mask.float())[0]
            advantages = self._advantages(batch, slice(0, groups_total), kls, self.algorithm_state)
        entropy_sum, losses, grad_norm = 0.0, [], 0.0
        for epoch in range(config.updates_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            loss_value = 0.0
            for index, start in enumerate(range(0, sequences_total, size)):
                chunk = rollout.rows(start, start + size)
                mask = chunk.completion_mask.float()
                logprobs, entropy = token_logprobs(self.model, chunk.sequences, chunk.prompt_mask, chunk.completion_mask,
                                                   config.temperature, with_entropy=True)
                if epoch == 0:
                    old[index] = logprobs.detach()
                    entropy_sum += float(entropy.sum())
                    if whole_groups:
                        groups = slice(start // K, (start + size) // K)
                        kls[groups] = self._sampled_kl(batch, groups, logprobs.detach(), mask)
                        advantages[groups] = self._advantages(batch, groups, kls[groups], dict(state_at_start))
                flat = torch.as_tensor(advantages.reshape(-1)[start : start + size], dtype=logprobs.dtype, device=logprobs.device)
                reference = None if batch.reference_logprobs is None else batch.reference_logprobs[start : start + size]
                loss = policy_loss(config, self.algorithm, logprobs, old[index], reference, mask, flat,
                                   sequences_total, groups_total, tokens_total)
                loss.backward()
                loss_value += float(loss.detach())
            if epoch == 0 and whole_groups:
                # Recomputed over the whole batch: the same advantages, and the state advances once.
                advantages = self._advantages(batch, slice(0, groups_total), kls, self.algorithm_state)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm))
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate_at(config, self.updates, config.steps * config.updates_per_batch)
            self.optimizer.step()
            self.updates += 1
            losses.append(loss_value)
        elapsed = time.perf_counter() - started
        generated = int(rollout.completion_mask.sum())
        scored = batch.scored
        valid_rewards = batch.rewards[scored]
        no_signal = estimators.groups_without_signal(advantages)
        self.totals["no_signal_groups"] += no_signal
        self.totals["unscored_samples"] += int((~scored).sum())
        self.totals["generated_tokens"] += generated
        self.totals["seconds"] += elapsed
        return {
            "step": step,
            "loss": losses[0],
            "reward_mean": float(valid_rewards.mean()) if valid_rewards.size else float("nan"),
            "reward_std": float(valid_rewards.std()) if valid_rewards.size else float("nan"),
            "kl": float(kls.mean()),
            "entropy": entropy_sum / tokens_total,
            "completion_length": generated / sequences_total,
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std()),
            "advantage_abs_max": float(np.abs(advantages).max()),
            "no_signal_fraction": no_signal / groups_total,
            "unscored_samples": int((~scored).sum()),
            "grad_norm": grad_norm,
            "learning_rate": self.optimizer.param_groups[0]["lr"],
            "tokens_per_second": generated / elapsed,
            "step_seconds": elapsed,
        }

    # --- evaluation, checkpoints, metrics ----------------------------------------------

    def evaluate(self) -> dict:
        return evaluate(self.model, self.reference, self.tokenizer, self.eval_prompts, self.task.evaluation,
                        self.task.verifier, self.reward, self.config.max_new_tokens, self.config.temperature)

    def trainer_state(self, step: int) -> dict:
        return {"config": self.config.to_json(), "algorithm_state": self.algorithm_state, "history": self.history,
                "baseline": self.baseline, "updates": self.updates, "totals": self.totals, "model": self.model_name}

    def save(self, step: int, rng: dict | None = None) -> Path:
        self._open_run_dir()
        return checkpoints.save_checkpoint(self.run_dir, step, self.model, self.tokenizer, self.optimizer,
                                           rng or checkpoints.capture_rng(self.rng), self.trainer_state(step),
                                           self.config.keep_checkpoints)

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
        if self.run_dir_ready:
            return
        # The outermost folder this run creates: removed again if nothing resumable gets written.
        self.created_root = None
        for folder in (self.run_dir, *self.run_dir.parents):
            if folder.exists():
                break
            self.created_root = folder
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
        if last_saved is not None:
            kept = f"the last good checkpoint is {self.run_dir / 'checkpoints' / f'{checkpoints.PREFIX}{last_saved:06d}'}"
        else:
            kept = "no checkpoint had been saved yet"
            # Nothing resumable was written: do not leave a lone metrics.jsonl for --resume to trip on.
            if getattr(self, "created_root", None) is not None:
                shutil.rmtree(self.created_root, ignore_errors=True)
            else:
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
        return UserError(f"cannot write to {self.run_dir}: {reason} (errno {error.errno}); {kept}")

    # --- the loop ---------------------------------------------------------------------

    def train(self) -> dict:
        from auto_research.progress import Progress

        config = self.config
        if self.resume_from is None:
            try:
                self.baseline = self.evaluate()
            except RewardError as error:
                raise UserError(f"{error} (evaluation before training)") from None
            self.log(f"before training: held-out accuracy {self.baseline['accuracy']:.3f}, "
                     f"mean reward {_figure(self.baseline['mean_reward'])}")
        handlers = {signum: signal.signal(signum, self._request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        bar = Progress(config.steps, f"{config.algorithm} on {self.task.name}", initial=self.start_step - 1,
                       enabled=config.progress, write=self.log)
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
                    raise UserError(f"{error}; {where}") from None
                last_step = step
                self._append_metrics(row)
                postfix = {"reward": _figure(row["reward_mean"]), "kl": f"{row['kl']:.3f}"}
                if config.eval_every and (step % config.eval_every == 0 or step == config.steps):
                    try:
                        metrics = self.evaluate()
                    except RewardError as error:
                        raise UserError(f"{error} (held-out evaluation); saved step {step} in {self.save(step)}") from None
                    self.history.append({"step": float(step), "loss": row["loss"], **metrics})
                    if self.writer is not None:
                        for key, value in metrics.items():
                            if value is not None:
                                self.writer.add_scalar(f"eval/{key}", value, step)
                if self.history:
                    postfix["acc"] = f"{self.history[-1]['accuracy']:.3f}"
                bar.update(postfix)
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
            final = {key: self.history[-1][key] for key in ("accuracy", "mean_reward", "entropy", "kl_from_reference")}
        else:
            try:
                final = self.evaluate()
            except RewardError as error:
                raise UserError(f"{error} (final evaluation; the last checkpoint holds the trained model)") from None
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
                "temperature": config.temperature,
                "max_new_tokens": config.max_new_tokens,
                "optimizer_updates": self.updates,
                "no_signal_groups": self.totals["no_signal_groups"],
                "unscored_samples": self.totals["unscored_samples"],
                "training_seconds": self.totals["seconds"],
                "tokens_per_second": self.totals["generated_tokens"] / max(self.totals["seconds"], 1e-9),
                "critic_updates": 0,
            },
            "history": self.history,
        }
