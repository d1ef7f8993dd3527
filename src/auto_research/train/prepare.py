"""Everything a generation-level run checks and loads before torch, once, in the order a user would fix them
(settings, folders, the checkpoint, the model's source, the rewards, the data, the judge): a mistake costs a fraction
of a second."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from auto_research.algorithms.registry import get_algorithm
from auto_research.config.fields import flag_of
from auto_research.config.generation import RENAMED, GenerationConfig
from auto_research.config.loss import served
from auto_research.data.tasks import check_answers, check_teacher_column, load_task
from auto_research.data.types import Task
from auto_research.engine import run_folder
from auto_research.engine.launch import check_world
from auto_research.engine.packaged import is_packaged, with_tools
from auto_research.engine.samplers import sampler_record
from auto_research.engine.sources import check_model_source
from auto_research.errors import UserError
from auto_research.files import check_writable_directory
from auto_research.rewards.gold import load_judge
from auto_research.rewards.loading import check_columns, resolve_rewards
from auto_research.user_code import spec_of


@dataclass(frozen=True)
class Prepared:
    config: GenerationConfig
    task: Task
    resume_from: Path | None
    rewards: list[tuple[str, Callable, bool]]
    """The named reward components, user callables already imported (rewards/loading.py)."""
    judge: Callable | None
    environment: object | None = None
    """--environment's factory, checked on a training row (envs.EnvironmentFactory), or None."""
    tools: dict | None = None
    rollout_function: tuple[str, Callable] | None = None
    python_rewards: tuple = ()
    """The rewards given from Python as (name, the spec that imports it or None): what config.yaml names them by."""

    @property
    def multi_turn(self) -> bool:
        """An environment, tools or a rollout function, from the command line or from Python."""
        return self.environment is not None or bool(self.tools) or self.rollout_function is not None


def check_settings(config: GenerationConfig, world_size: int) -> None:
    """The checks that read nothing: settings, the number of processes, the output folder."""
    config.validate()
    sampler_record(config.rollout).check_settings()
    check_world(config.policy.fsdp, config.sampling.prompts_per_step, config.loss.ppo_mini_batches, world_size)
    check_writable_directory(config.run.output_dir)


def columns_of(task: Task) -> set[str]:
    """The columns a reward called TRL's way receives from the data (``rewards.combine.with_row_fields``): any row's
    fields and ``answer``, not ``prompt`` (passed as ``prompts``)."""
    columns = {"answer"}
    for example in (*task.train, *task.evaluation):
        columns.update(example.fields)
    return columns - {"prompt"}


def _resumed(config: GenerationConfig, log, world_size: int) -> tuple[GenerationConfig, Path]:
    """The checkpoint ``--resume`` continues from, and the config with the run's own values of what ``filled``
    derived from --steps (``from_steps``): extending a run changes its length only."""
    derived, settings = getattr(config, "from_steps", frozenset()), config.to_json()
    flags = {item.name: flag_of(item) for item in GenerationConfig.flat_fields()}
    # Compared under their former names too: a checkpoint saved before ``RENAMED`` holds those.
    recorded = {**settings, **{old: settings[new] for old, new in RENAMED.items()}}
    folder = run_folder.resumable_checkpoint(config.run_dir, recorded, log, world_size, derived, flags)
    saved = run_folder.saved_settings(folder)
    kept = {key: saved[key] for key in sorted(derived) if key in saved and saved[key] != getattr(config, key)}
    if kept:
        log("--resume: keeps the run's " + ", ".join(f"{key} {value} (derived from its --steps, not given)"
                                                        for key, value in kept.items()))
        config = replace(config, **kept)
    return config, folder


def prepare(config: GenerationConfig, log=print, rows: list[dict] | None = None, reward_functions=(),
            world_size: int = 1, environment=None, tools=(), rollout_function=None) -> Prepared:
    """Every check of a run that needs no torch; reads the run folder (lock it first), writes nothing."""
    check_settings(config, world_size)
    rollout = config.rollout
    if rollout.max_staleness and rollout.rollout_correction == "none":
        log(f"warning: --max-staleness {rollout.max_staleness} with --rollout-correction none: batches drawn by "
            "older weights are trained on as if the current policy had drawn them (uncorrected; docs/async.md)")
    run_folder.check_run_folder(config.run_dir, config.run.resume, config.run.overwrite)
    resume_from = None
    if config.run.resume:
        config, resume_from = _resumed(config, log, world_size)
    model, loss, given, turns = config.policy.model, config.loss, config.rewards, config.turns
    for source, flag in ((model, "--model"), (given.reward_model, "--reward-model"),
                         (config.critic.critic_model, "--critic-model"), (loss.reference_model, "--reference-model"),
                         *((teacher, "--teacher-model") for teacher in loss.teachers.values())):
        if source is not None and not (flag == "--teacher-model" and served(source)):
            check_model_source(source, config.data.offline, flag)
    rewards = resolve_rewards(given.reward, given.reward_weights, given.reward_model, list(reward_functions),
                              given.reward_url)
    task = load_task(config.data, rows)
    check_columns(rewards, columns_of(task), task.name)
    check_teacher_column(task, loss.teachers)
    if config.sampling.prompts_per_step > len(task.train):
        raise UserError(f"--prompts-per-step {config.sampling.prompts_per_step}: a step draws distinct prompts, and "
                        f"{task.name} has {len(task.train)} training prompts")
    judge = load_judge(given.judge, task) if given.judge else None
    factory, functions, own, algorithm = None, {}, None, get_algorithm(config.run.algorithm)
    if rollout_function is not None or turns.rollout_function:
        from auto_research.envs.custom import load_rollout_function  # noqa: PLC0415 - user code, on demand

        turns.check_loops(algorithm, environment is not None or bool(tools), rollout_function is not None)
        own = load_rollout_function(rollout_function or turns.rollout_function)
    if (turns.tools or tools) and model is not None and is_packaged(model) and with_tools(model):
        raise UserError(f"--tools: {model}'s chat template does not show tools to the model; "
                        f"--model {with_tools(model)} is the same weights with a template that does")
    if turns.environment or turns.tools or environment is not None or tools:
        from auto_research.envs.rollout import load_environment, row_of  # noqa: PLC0415 - user code, on demand

        factory, functions = load_environment(environment or turns.environment, list(tools) + [turns.tools or ""],
                                              row_of(task.train[0]), turns.env_timeout)
    check_answers(task, rewards, given.reward_model, factory is not None or own is not None,
                  "task" in algorithm.rewards)
    return Prepared(config, task, resume_from, rewards, judge, factory, functions, own,
                    tuple((name, spec_of(function)) for name, function in reward_functions))
