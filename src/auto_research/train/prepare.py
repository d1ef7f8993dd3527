"""Everything a generation-level run checks and loads before torch: done once, and handed on.

In the order a user would fix them: settings, output folder, an earlier run there, the checkpoint to
resume, the model's source, the rewards (user modules imported here, once), the data, the judge.
Light: nothing here imports torch or transformers, so a mistake costs a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from auto_research.algorithms.registry import get_algorithm
from auto_research.config.generation import RENAMED, GenerationConfig
from auto_research.data.tasks import check_answers, load_task
from auto_research.data.types import Task
from auto_research.engine import run_folder
from auto_research.engine.launch import check_world
from auto_research.engine.samplers import sampler_record
from auto_research.engine.sources import check_model_source
from auto_research.errors import UserError
from auto_research.files import check_writable_directory
from auto_research.rewards.gold import load_judge
from auto_research.rewards.loading import resolve_rewards


@dataclass(frozen=True)
class Prepared:
    config: GenerationConfig
    task: Task
    resume_from: Path | None
    """The verified checkpoint ``--resume`` continues from."""
    rewards: list[tuple[str, Callable, bool]]
    """The named reward components, user callables already imported (rewards/loading.py)."""
    judge: Callable | None
    environment: object | None = None
    """--environment's factory, checked on a training row (envs.EnvironmentFactory), or None."""
    tools: dict | None = None
    """--tools' functions by name, each with a schema."""
    rollout_function: tuple[str, Callable] | None = None
    """--rollout-function's (name, function), found and callable (envs.custom), or None."""

    @property
    def multi_turn(self) -> bool:
        """A sample may be longer than one completion: an environment, tools or a rollout function, given on the
        command line or from Python (``config.multi_turn`` sees the command line's only)."""
        return self.environment is not None or bool(self.tools) or self.rollout_function is not None


def check_settings(config: GenerationConfig, world_size: int) -> None:
    """The checks that read nothing: settings, the number of processes, the output folder."""
    config.validate()
    sampler_record(config).check_settings()
    check_world(config.fsdp, config.prompts_per_step, config.ppo_mini_batches, world_size)
    check_writable_directory(config.output_dir)


def recorded_settings(config: GenerationConfig) -> dict:
    """The run's flat settings as a checkpoint records them, under their former names too (a checkpoint saved
    before ``RENAMED`` holds those), so that a resume compares them all."""
    settings = config.to_json()
    return {**settings, **{old: settings[new] for old, new in RENAMED.items()}}


def prepare(config: GenerationConfig, log=print, rows: list[dict] | None = None, reward_functions=(),
            world_size: int = 1, environment=None, tools=(), rollout_function=None) -> Prepared:
    """Every check of a run that needs no torch; reads the run folder (lock it first), writes nothing."""
    check_settings(config, world_size)
    if config.max_staleness and config.rollout_correction == "none":
        log(f"warning: --max-staleness {config.max_staleness} with --rollout-correction none: batches drawn by older "
            "weights are trained on as if the current policy had drawn them (uncorrected; docs/async.md)")
    run_folder.check_run_folder(config.run_dir, config.resume, config.overwrite)
    resume_from = (run_folder.resumable_checkpoint(config.run_dir, recorded_settings(config), log, world_size)
                   if config.resume else None)
    for source, flag in ((config.model, "--model"), (config.reward_model, "--reward-model"),
                         (config.critic_model, "--critic-model")):
        if source is not None:
            check_model_source(source, config.offline, flag)
    rewards = resolve_rewards(config.reward, config.reward_weights, config.reward_model, list(reward_functions),
                              config.reward_url)
    task = load_task(config, rows)
    if config.prompts_per_step > len(task.train):
        raise UserError(f"--prompts-per-step {config.prompts_per_step}: a step draws distinct prompts, and "
                        f"{task.name} has {len(task.train)} training prompts")
    judge = load_judge(config.judge, task) if config.judge else None
    factory, functions, own = None, {}, None
    if rollout_function is not None or config.rollout_function:
        from auto_research.envs.custom import load_rollout_function  # noqa: PLC0415 - user code, on demand

        config.turns.check_loops(get_algorithm(config.algorithm), environment is not None or bool(tools),
                                 rollout_function is not None)
        own = load_rollout_function(rollout_function or config.rollout_function)
    if config.environment or config.tools or environment is not None or tools:
        from auto_research.envs.rollout import load_environment, row_of  # noqa: PLC0415 - user code, on demand

        factory, functions = load_environment(environment or config.environment, list(tools) + [config.tools or ""],
                                              row_of(task.train[0]), config.env_timeout)
    check_answers(task, rewards, config.reward_model, factory is not None or own is not None)
    return Prepared(config, task, resume_from, rewards, judge, factory, functions, own)
