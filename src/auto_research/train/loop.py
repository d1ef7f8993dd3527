"""The run around the step (nanoGPT's loop): the evaluation before training, Ctrl-C and SIGTERM, the cadence of
evaluations, checkpoints and rows, failures answered in one line with the last good step kept, metrics.json."""

from __future__ import annotations

import signal
from pathlib import Path

from auto_research.engine import checkpoint as checkpoints
from auto_research.engine.run_folder import PREFIX, clear_run_folder
from auto_research.envs import deadline
from auto_research.errors import RewardError, RolloutEngineError, TrainingInterrupted, UserError
from auto_research.progress import Progress
from auto_research.report.tables import figure
from auto_research.rewards.combine import MAX_REWARD
from auto_research.train.components import parameter_counts
from auto_research.config.files import resolved_settings, write_resolved_config
from auto_research.train.evaluation import held_out, win_rate
from auto_research.train.rollouts import Drawn
from auto_research.train.schedule import rollout_source
from auto_research.train.metrics import MetricsLog
from auto_research.train.drawn_files import from_files, to_files
from auto_research.train.state import LoopState
from auto_research.train.step import rl_step


def _user_error(message: str, cause: BaseException) -> UserError:
    """A UserError that stays quiet when its cause was another rank's failure (that rank reports it)."""
    error = UserError(message)
    error.quiet = getattr(cause, "quiet", False)
    return error


def restore(run, models, drawing, state: LoopState, folder: Path, log) -> tuple[list[Drawn], tuple[dict, dict] | None]:
    """Continue from a checkpoint: the loop's state, every random state and metrics.jsonl cut back to it; returns
    the batches in flight and the rollout side's state it saved, for ``schedule.open_side``."""
    saved, rng = checkpoints.read_trainer_state(folder)
    checkpoints.restore_rng(rng, state.rng)
    state.restore(saved)
    in_flight = checkpoints.read_in_flight(folder)
    batches, side = [], None
    rollout, rank = run.config.rollout, run.world.rank
    if rollout.max_staleness:
        if in_flight is not None:  # this rank's: tensors keyed rank/index/name
            tensors, plain = in_flight
            prefix = f"{rank}/"
            mine = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
            mine_plain = list(plain[rank])
            if mine_plain and "side" in mine_plain[-1]:  # --in-flight-updates: the rollout side's own state
                side = ({key[len("side/"):]: value for key, value in mine.items() if key.startswith("side/")},
                        mine_plain.pop()["side"])
            source = rollout_source(run, drawing, drawing.sampler, models.policy, run.sampling(models.policy))
            batches = from_files(source, mine, mine_plain)
        depth = 1 if rollout.in_flight_updates else rollout.max_staleness  # batches drawn ahead of the trainer
        needed = min(depth, run.config.run.steps - state.step)
        batches = batches[:needed]  # a run shortened by --steps: the batches past its new end are not trained on
        if len(batches) != needed:  # their weights are gone: without them the rollout side would wait forever
            raise UserError(f"--resume: {folder} holds {len(batches)} batches in flight, and --max-staleness "
                            f"{rollout.max_staleness} needs {needed} there (a run drawn ahead is extended by "
                            "--steps only from a checkpoint that many steps before its end); resume from another "
                            "checkpoint")
    run.world.on_main(lambda: MetricsLog(run.config.run_dir).truncate(state.step))
    log(f"resumed from {folder} (step {state.step})")
    return batches, side


class RunLoop:
    """The loop owns the run's rollout side (``open_run`` built it) and its state, and hands them to each step."""

    def __init__(self, run, models, drawing, side, state: LoopState, lock=None, log=print, resumed: bool = False):
        self.context, self.models, self.drawing, self.side = run, models, drawing, side
        self.state, self.lock, self.log = state, lock, log
        self.run_dir = run.config.run_dir
        self.metrics_log = MetricsLog(self.run_dir, run.config.logging, resolved_settings(run.config))
        self.resumed = resumed
        self.run_dir_ready = False
        self.stop_signal: int | None = None
        self.final_completions: dict = {}
        self.last_saved: int | None = None  # the last checkpoint saved (or resumed from): the one a failure names

    # --- writes (rank 0) ------------------------------------------------------------------------------

    def _open_run_dir(self) -> None:
        """Before every write: the folder is still this run's; at the first, ``--overwrite`` deletes the earlier
        run's outputs (the inputs have proved themselves on a real step) and the trackers start."""
        if self.lock is not None:
            self.lock.check()
        if self.run_dir_ready:
            return
        if not self.resumed and self.context.config.run.overwrite:
            clear_run_folder(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Resumed too: --steps and the other settings a resumption may change are the run's now.
        write_resolved_config(self.run_dir / "config.yaml", self.context.config, self.context.python_rewards)
        self.run_dir_ready = True
        self.metrics_log.open(self.resumed, self.log)

    def _append(self, row: dict) -> None:
        self._open_run_dir()
        self.metrics_log.append(row)

    def trainer_state(self) -> dict:
        run = self.context
        return {"config": run.config.to_json(), **self.state.saved(run.algorithm.moving_average is not None),
                "model": run.model_name, "world_size": run.world.size}

    def save(self, step: int, rng: dict | None = None) -> Path:
        """One checkpoint: every rank helps gather sharded state (FSDP), rank 0 writes it."""
        models, run, config, world = self.models, self.context, self.context.config, self.context.world
        model_state = world.full_state(models.policy)
        optimizer_state = world.optimizer_state(models.train_policy, models.optimizer)
        critic_state = critic_optimizer_state = None
        if models.critic is not None:
            critic_state = world.full_state(models.critic)
            critic_optimizer_state = world.optimizer_state(models.train_critic, models.critic_optimizer)
        rng, in_flight = rng or checkpoints.capture_rng(self.state.rng), None
        if config.rollout.max_staleness:  # the batches drawn ahead, every rank's
            batches, rng["numpy"] = self.side.checkpoint(step)
            tensors, plain = to_files(batches)
            if self.side.carries_state:  # --in-flight-updates: the groups still decoding, after the batches
                side_tensors, side = self.side.state(step)
                tensors.update({f"side/{key}": value for key, value in side_tensors.items()})
                plain.append({"side": side})
            shares = world.gather_objects((tensors, plain))
            in_flight = ({f"{rank}/{key}": value for rank, (tensors, _) in enumerate(shares)
                          for key, value in tensors.items()}, [plain for _, plain in shares])

        def write():
            self._open_run_dir()
            return checkpoints.save_checkpoint(self.run_dir, step, models.policy, run.tokenizer, optimizer_state,
                                               rng, self.trainer_state(), config.run.keep_checkpoints, models.critic,
                                               critic_optimizer_state, model_state, critic_state, in_flight)

        world.on_main(write)
        return self._checkpoint(step)

    def _checkpoint(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"{PREFIX}{step:06d}"

    def _write_failed(self, error: OSError, last_saved: int | None) -> UserError:
        """A full disk (or any failed write): one line, and the last good checkpoint left as it was."""
        reason = error.strerror or str(error)
        if not self.context.world.main:
            kept = "rank 0 reports it"
        elif last_saved is not None:
            kept = f"the last good checkpoint is {self._checkpoint(last_saved)}"
        else:  # the figures so far stay (a failure never deletes them); the folder goes only if it holds none
            kept = "no checkpoint had been saved yet"
        return _user_error(f"cannot write to {self.run_dir}: {reason} (errno {error.errno}); {kept}", error)

    def _request_stop(self, signum, frame) -> None:
        if self.stop_signal is not None:  # a second Ctrl-C (or SIGTERM) stops at once
            raise KeyboardInterrupt
        self.stop_signal = signum
        deadline.request_stop()  # a hung environment call stops the step at its timeout (envs/deadline.py)
        name = "interrupt" if signum == signal.SIGINT else "SIGTERM"
        self.log(f"\n{name}: finishing this step, saving a checkpoint, then stopping (send it again to abort)")

    # --- the loop ---------------------------------------------------------------------------------------

    def _evaluate_baseline(self) -> None:
        run, drawing, state = self.context, self.drawing, self.state
        if run.config.logging.shows_progress:
            self.log(f"evaluating the starting policy on {len(drawing.eval_prompts)} held-out prompts (greedy), "
                     "before training")
        try:
            table: list = []
            found = {} if drawing.judge is not None else None
            state.baseline = held_out(run, self.models, drawing, found, table)
            if found is not None:
                state.baseline_completions = [found[index] for index in range(len(drawing.eval_prompts))]
                # The judge on the starting policy against itself: a judge that fails fails now, not at the end.
                state.baseline["win_rate"] = win_rate(run, drawing, state.baseline_completions,
                                                      state.baseline_completions)
        except RewardError as error:
            raise _user_error(f"{error} (evaluation before training)", error) from None
        run.world.on_main(lambda: self.metrics_log.evaluation(0, state.baseline))
        self._completions(0, table)
        self.log(f"before training: held-out accuracy {figure(state.baseline['accuracy'], 3)}, "
                 f"mean reward {figure(state.baseline['mean_reward'], 3)}")

    def run(self) -> dict:
        """The evaluation before training (unless resuming), then the steps up to --steps; metrics.json's payload."""
        run, state, config = self.context, self.state, self.context.config
        if not self.resumed:
            if config.optimisation.warmup_steps:
                self.log(f"warmup: the learning rate rises linearly to {config.optimisation.learning_rate:g} over the "
                         f"first {config.optimisation.warmup_steps} of {config.run.steps} steps")
            self._evaluate_baseline()
        handlers = {signum: signal.signal(signum, self._request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
        bar = Progress(config.run.steps, f"{config.run.algorithm} on {run.task.name}", initial=state.step,
                       enabled=config.logging.shows_progress and run.world.main, write=self.log,
                       every=config.logging.log_every, bar=config.logging.progress)
        self.last_saved = state.step if self.resumed else None
        try:
            for step in range(state.step + 1, config.run.steps + 1):
                self._train_step(step, bar)
        except (RolloutEngineError, RewardError) as error:  # a server gone, in a step or while a checkpoint read
            raise self._engine_gone(error) from None  # the rollout side; or that side's reward failed meanwhile
        except OSError as error:
            raise self._write_failed(error, self.last_saved) from None
        finally:
            self._finish(handlers, bar)
        self._warn_unscored()
        return self.payload()

    def _train_step(self, step: int, bar: Progress) -> None:
        """One step, its row, its evaluation and checkpoint when due; a stop on any rank ends every rank's loop here."""
        world, state, config = self.context.world, self.state, self.context.config
        row = self._step(step)
        state.step = step
        world.on_main(lambda: self._append(row))
        postfix = {"reward": figure(row["reward_mean"], 3), "kl": f"{row['kl']:.3f}"}
        if config.run.eval_every and (step % config.run.eval_every == 0 or step == config.run.steps):
            self._evaluate(step, row)
        if state.history:
            postfix["acc"] = figure(state.history[-1]["accuracy"], 3)
        bar.update(postfix)
        # A signal that reached one rank stops them all after this step.
        if world.any(self.stop_signal is not None) and self.stop_signal is None:
            self.stop_signal = signal.SIGTERM
        if (step == config.run.steps or (config.run.checkpoint_every and step % config.run.checkpoint_every == 0)
                or self.stop_signal is not None):
            self.save(step)
            self.last_saved = step
        if self.stop_signal is not None:
            raise TrainingInterrupted(
                f"interrupted after step {step}; checkpoint saved in {self.run_dir / 'checkpoints'}: "
                "continue with the same command and --resume", 128 + self.stop_signal)

    def _step(self, step: int) -> dict:
        """``rl_step``'s row; a bad reward answered in one line that says what was kept (the last good step saved)."""
        state = self.state
        # In flight, the generator runs ahead in the rollout side's thread: a failed step saves nothing
        # (the batches after the last good step were drawn by weights no longer held).
        rng_before = None if self.context.config.rollout.max_staleness else checkpoints.capture_rng(state.rng)
        try:
            return rl_step(self.context, self.models, self.drawing, state, step, self.side, self.log)
        except RewardError as error:
            where = (f"saved the last good step ({state.step}) in {self.save(state.step, rng_before)}"
                     if state.step > 0 and rng_before is not None else
                     "kept the last checkpoint" if state.step > 0 else "nothing was written")
            raise _user_error(f"{error}; {where}", error) from None

    def _engine_gone(self, error: RolloutEngineError | RewardError) -> UserError:
        """A server gone mid-step (the weights may be a step ahead), or a failure raised while a checkpoint read
        the rollout side's state (nothing of it written yet): one line naming the checkpoint to resume from."""
        gone = isinstance(error, RolloutEngineError) and self.context.engine.started_by_the_user
        again = "restart the server, then continue" if gone else \
            "continue"  # the run's own engine (its process too) starts anew with it
        kept = (f"the last good checkpoint is {self._checkpoint(self.last_saved)} ({again} with the same command and "
                "--resume)"
                if self.last_saved is not None else "no checkpoint had been saved yet")
        return _user_error(f"{error}; {kept}", error)

    def _finish(self, handlers: dict, bar: Progress) -> None:
        """However the loop ended: signal handlers back, the environments' stop cleared, side, bar and log closed."""
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        deadline.clear_stop()
        self.side.close()
        bar.close()
        self.metrics_log.close()

    def _warn_unscored(self) -> None:
        """How many samples the reward could not score: a reward that failed often is not one that scored low."""
        totals = self.state.totals
        if totals["unscored_samples"]:
            invalid = totals["invalid_rewards"]
            why = f"; {invalid} of them for a value not a finite number within ±{MAX_REWARD:,.0f}" if invalid else ""
            self.log(f"warning: {totals['unscored_samples']} samples of this run could not be scored (reward "
                     f"None{why})")

    def _evaluate(self, step: int, row: dict) -> None:
        state, run, drawing = self.state, self.context, self.drawing
        try:
            # The last evaluation keeps its greedy completions for the judge's win rate.
            last = drawing.judge is not None and step == run.config.run.steps
            table: list = []
            metrics = held_out(run, self.models, drawing, self.final_completions if last else None, table)
        except RewardError as error:
            raise _user_error(f"{error} (held-out evaluation); saved step {step} in {self.save(step)}", error) from None
        state.history.append({"step": float(step), "loss": row["loss"], **metrics})
        run.world.on_main(lambda: self.metrics_log.evaluation(step, metrics))
        self._completions(step, table)

    def _completions(self, step: int, table: list) -> None:
        """--log-completions: the evaluation's completion table, to completions.jsonl and report.md."""
        if not self.context.config.logging.log_completions:
            return
        self.state.completions = {"step": step, "rows": table}
        self.context.world.on_main(lambda: self.metrics_log.completions(step, table))

    def _final_completions(self) -> list[str]:
        """The final policy's greedy held-out completions: the last evaluation's if at the final step, else fresh."""
        found = self.final_completions
        if len(found) < len(self.drawing.eval_prompts):
            found = {}
            held_out(self.context, self.models, self.drawing, found)
        return [found[index] for index in range(len(self.drawing.eval_prompts))]

    def payload(self) -> dict:
        """metrics.json."""
        run, models, drawing, state, config = self.context, self.models, self.drawing, self.state, self.context.config
        if state.history and state.history[-1]["step"] == config.run.steps:
            final = {key: state.history[-1][key] for key in ("accuracy", "mean_reward", "entropy", "kl_from_reference",
                                                             "gold_reward", "turns_mean") if key in state.history[-1]}
        else:
            try:
                final = held_out(run, models, drawing)
            except RewardError as error:
                raise _user_error(f"{error} (final evaluation; the last checkpoint holds the trained model)",
                                  error) from None
        if drawing.judge is not None:
            try:
                final["win_rate"] = win_rate(run, drawing, state.baseline_completions, self._final_completions())
            except RewardError as error:
                raise _user_error(f"{error} (win rate; the last checkpoint holds the trained model)", error) from None
        baseline = state.baseline
        return {
            "algorithm": config.run.algorithm, "dataset": run.task.name, "level": "generation",
            "seed": config.run.seed, "model": run.model_name, "baseline": baseline, "final": final,
            # None for rows without answers (no accuracy measured).
            "relative_accuracy": None if baseline["accuracy"] is None else
            (final["accuracy"] - baseline["accuracy"]) / max(baseline["accuracy"], 1e-12),
            "training": {
                **config.reported_settings(critic=models.critic is not None),
                "policy_loss": config.policy_loss_in_use, "dtype": str(run.compute_dtype).replace("torch.", ""),
                "train_examples": len(run.task.train), "validation_examples": len(run.task.evaluation),
                "data_source": run.task.source, "optimizer_updates": state.updates,
                "critic_updates": state.critic_updates,
                **{key: state.totals[key] for key in ("no_signal_groups", "unscored_samples", "invalid_rewards")},
                "training_seconds": state.totals["seconds"],
                "tokens_per_second": state.totals["generated_tokens"] / max(state.totals["seconds"], 1e-9),
                "parameters": parameter_counts(models, drawing, config.lora.lora_r),
            },
            "history": state.history,
            **({"completions": state.completions} if state.completions else {}),
        }
