"""One RL step at the generation level, as phases that hand frozen values on; touches no disk. The rollout side
hands the step a frozen batch; the trainer side (experience → advantages → update → publish weights) trains on it,
as the algorithm's record says. Each phase is timed (``time_<phase>`` in the row).
"""

from __future__ import annotations

import contextlib
import time

import torch

from auto_research.algorithms.correction import check_weights, drops_samples
from auto_research.engine.heap import release_free_memory
from auto_research.errors import RewardError, RolloutEngineError
from auto_research.train.components import Drawing, Models, RunContext
from auto_research.train.experience import build_experience
from auto_research.train.dynamic import REFILL_WARNING
from auto_research.train.metrics import drift_figures, step_metrics
from auto_research.train.rollouts import agreed_scores, rollout_figures, unscored_reasons
from auto_research.train.sides import RolloutSide
from auto_research.train.state import LoopState
from auto_research.train.update import estimate_advantages, moving_average_after, update_actor, update_critic


def rl_step(run: RunContext, models: Models, drawing: Drawing, state: LoopState, step: int, side: RolloutSide,
            log=print) -> dict:
    """take the batch from the run's rollout side → agree on its scores → experience → advantages → update →
    publish; the step's row. ``state`` (the loop's) moves on: its counters and moving-average baseline."""
    started, seconds = time.perf_counter(), {}
    timed = _timer(run, seconds)
    with timed("waiting_for_rollouts"):  # at --max-staleness 0, the trainer idles while the batch is drawn
        drawn = _take(run, side, step)
    with timed("score"):
        scores = agreed_scores(run.world, drawn, step, run.config.sampling.group_size)
    _warn_unscored(state, scores, step, log)
    with timed("experience"):
        experience = build_experience(run, models, drawn.rollout, scores, step - 1, drawn.reference_logprobs)
        drift = drift_figures(run, experience)
    _check_sampler(run, experience, drift, step)
    with timed("advantages"):
        advantages = estimate_advantages(run, experience, state.moving_average)
        if run.algorithm.moving_average is not None:  # the loop's baseline moves after the advantages used it
            state.moving_average = moving_average_after(advantages.inputs, state.moving_average,
                                                        run.algorithm.moving_average, run.world.total)
    with timed("update_actor"):
        actor = update_actor(run, models, experience, advantages, state.updates)
        state.updates += run.updates_per_step
    with timed("update_critic"):
        critic = update_critic(run, models, experience, advantages, state.updates)
        state.critic_updates += run.updates_per_step if models.critic is not None else 0
    with timed("weight_sync"):
        side.publish(step, models.policy)
    row = step_metrics(run, models.optimizer, step, experience, advantages, actor, critic,
                       time.perf_counter() - started, state.totals, drift)
    return {**row, **_rollout_row(run, drawing.sampler, state, drawn, seconds, step, log)}


def _take(run: RunContext, side: RolloutSide, step: int):
    """The step's drawn batch; a rollout function's bad return on this rank is told to the others (the collective
    ``agreed_scores`` holds on every other rank) before it is raised."""
    try:
        return side.take(step)
    except RewardError as error:
        run.world.agree(error, RewardError)
        raise


def _check_sampler(run: RunContext, experience, drift: dict, step: int) -> None:
    """Before the update: the sampler's log-probs within --max-rollout-mismatch, some correction weights alive."""
    check_mismatch(drift, run.config.rollout.max_rollout_mismatch, step, run.world.main)
    # sequence-mask's 0 drops a sequence on purpose (a step whose every sequence is dropped trains on nothing, as
    # in TRL), where a vanishing weight is a mismatch the run would learn nothing from without a word.
    if experience.rollout_weights is not None and not drops_samples(run.config.rollout.rollout_correction):
        check_weights(run.world, experience.rollout_weights, experience.mask)


def _rollout_row(run: RunContext, sampler, state: LoopState, drawn, seconds: dict, step: int, log) -> dict:
    """The rollout side's figures of the step (groups, refills, the weight sync's time) and its phases' times."""
    sampling = run.config.sampling
    extra = {"weight_sync_seconds": seconds["weight_sync"]} if run.engine.pushes_weights else {}
    if run.engine.pushes_weights and sampler.pushed_bytes is not None:  # a server's client
        extra["weight_sync_bytes"] = sampler.pushed_bytes
    seconds["score"] += drawn.seconds["score"]
    figures = rollout_figures(run.world, drawn, step, sampling.dynamic_sampling)
    if "task" not in run.algorithm.rewards:  # no_signal_* count groups of equal task rewards, which opd never reads
        figures = {key: value for key, value in figures.items() if not key.startswith("no_signal_")}
    state.totals["no_signal_groups"] += figures.get("no_signal_groups", 0)
    if sampling.dynamic_sampling:
        _warn_refills(state, figures, sampling.prompts_per_step, step, log)
    return {**extra, **figures, **{f"time_{phase}": value for phase, value in seconds.items()}}


def check_mismatch(drift: dict, bound: float, step: int, main: bool = True) -> None:
    """Stop before the update when the sampler's log-probs are more than ``bound`` nats a token (mean) from the
    trainer's: its samples do not come from the policy being trained (healthy runs stay below 0.2, docs/vllm.md).
    NaN is never within a bound. Every rank stops; rank 0 (``main``) says why."""
    mean = drift.get("rollout_logprob_diff_mean")
    if mean is None or mean <= bound:
        return
    error = RolloutEngineError(
        f"step {step}: the sampler's log-probs are {mean:.3g} nats a token from the trainer's on its samples "
        f"(rollout_logprob_diff_mean; the largest {drift['rollout_logprob_diff_max']:.3g}), above "
        f"--max-rollout-mismatch {bound:g}: they were not drawn by the policy being trained (its weights went wrong "
        "on the rollout side, or another process changed them), so the step was not trained on them")
    error.quiet = not main
    raise error


def _warn_unscored(state: LoopState, scores, step: int, log) -> None:
    if scores.unscored and not state.warned_unscored:
        state.warned_unscored = True
        invalid = ", those with an invalid value also in invalid_rewards" if scores.invalid else ""
        log(f"warning: {unscored_reasons(scores.causes, scores.unscored, scores.samples, 'samples')} at step {step}; "
            f"they are left out of their groups' baselines (counted in unscored_samples{invalid}; warned once per run)")


def _warn_refills(state: LoopState, figures: dict, prompts_per_step: int, step: int, log) -> None:
    """Dynamic sampling that refilled more than ``REFILL_WARNING`` groups per slot: most groups have no signal."""
    if figures["refills"] > REFILL_WARNING * prompts_per_step and not state.warned_refills:
        state.warned_refills = True
        log(f"warning: step {step} refilled {figures['refills']} groups for {prompts_per_step} prompt slots, and "
            f"{figures['no_signal_groups']} of the {figures['prompts_sampled']} groups sampled had no signal (all K "
            "rewards equal): is the reward constant on most prompts? (--max-refills bounds it; warned once per run)")


HEAP_RETURNED_BEFORE = ("waiting_for_rollouts", "update_actor")
"""The phases that start by giving the C heap's free memory back on the CPU (``engine/heap.py``): sampling and the
update, so that the step's peak is the update's own. Not every phase: the pages fault in again when next used
(about 0.4 ms a call on a tiny model, a fifth of its step at seven a step)."""


def _timer(run: RunContext, seconds: dict):
    """A phase's clock (and, on the CPU, the heap given back before the phases of ``HEAP_RETURNED_BEFORE``)."""
    cuda = run.device.startswith("cuda")

    @contextlib.contextmanager
    def timed(phase: str):
        if cuda:  # kernels run asynchronously: a phase ends when its work does
            torch.cuda.synchronize()
        elif phase in HEAP_RETURNED_BEFORE:
            release_free_memory()
        started = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        seconds[phase] = time.perf_counter() - started

    return timed
