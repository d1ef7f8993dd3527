"""One generation-level run's settings, in frozen sections (``SECTIONS``) that own their fields and checks; the
rules that join sections are ``check_across``'s. Users keep the flat names: ``GenerationConfig(temperature=0.7)``
sets, and ``config.temperature`` reads, the field of that name in its section. ``validate`` imports neither
NumPy nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from auto_research.algorithms.registry import RATIO_FREE_LOSSES, check_group_size, get_algorithm
from auto_research.config.environment import TurnsSection
from auto_research.config.fields import EMBEDDED_MODEL_DATASETS, PREFERENCE_DATASETS, json_ready
from auto_research.config.loss import CriticSection, LossSection, served
from auto_research.config.rollout import RolloutSection
from auto_research.config.sampling import OptimisationSection, SamplingSection
from auto_research.config.sections import (DataSection, LoggingSection, LoraSection, PolicySection, RewardSection,
                                           RunSection)
from auto_research.data.registry import generation_presets
from auto_research.errors import UserError

# Per-dataset defaults for settings the user leaves unset: each task record's, and a data file's (data/registry.py).
GENERATION_PRESETS = generation_presets()
WARMUP_SHARE = 10
"""A preset's warmup is at most steps // WARMUP_SHARE updates (a short run is not spent warming up)."""
FROM_STEPS = frozenset({"warmup_steps"})
"""The settings ``filled`` derives from --steps that a resumed run compares (--eval-every may change anyway)."""

SECTIONS = {"run": RunSection, "data": DataSection, "policy": PolicySection, "rewards": RewardSection,
            "sampling": SamplingSection, "loss": LossSection, "critic": CriticSection, "rollout": RolloutSection,
            "turns": TurnsSection, "optimisation": OptimisationSection, "lora": LoraSection,
            "logging": LoggingSection}
OWNER = {item.name: section for section, cls in SECTIONS.items() for item in fields(cls)}  # flat name → section
RENAMED = {"vllm_mode": "rollout_mode", "vllm_server": "rollout_server", "vllm_memory": "rollout_memory"}
"""Settings named after vLLM until the builtin engine could serve too: their old names still set them."""


@dataclass(frozen=True, init=False)
class GenerationConfig:
    """One generation-level run: RL on a causal LM (the paper's setting), in sections.

    Takes flat names and whole sections (``sampling=SamplingSection(...)``, flat names set over them), as
    ``dataclasses.replace`` does. None means the dataset's preset or the algorithm's own, filled by ``filled()``.
    """

    run: RunSection
    data: DataSection
    policy: PolicySection
    rewards: RewardSection
    sampling: SamplingSection
    loss: LossSection
    critic: CriticSection
    rollout: RolloutSection
    turns: TurnsSection
    optimisation: OptimisationSection
    lora: LoraSection
    logging: LoggingSection

    def __init__(self, **settings):
        flat = {RENAMED.get(name, name): value for name, value in settings.items() if name not in SECTIONS}
        if any(name not in OWNER for name in flat):
            flat = _with_trl_names(flat, {name: value for name, value in settings.items() if name in SECTIONS})
        for section, cls in SECTIONS.items():
            own = {name: value for name, value in flat.items() if OWNER[name] == section}
            base = settings.get(section) or cls()
            object.__setattr__(self, section, replace(base, **own) if own else base)

    def __getattr__(self, name: str):
        """A flat setting, read from its section (``config.temperature`` is ``config.sampling.temperature``)."""
        name = RENAMED.get(name, name)
        section = OWNER.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"'GenerationConfig' has no setting {name!r}")
        return getattr(self.__dict__[section], name)

    @staticmethod
    def flat_fields() -> list:
        """Every setting's field, section by section (the flags and config-file keys are made from these)."""
        return [item for cls in SECTIONS.values() for item in fields(cls)]

    @staticmethod
    def section_of(name: str) -> str:
        return OWNER[name]

    # --- what several sections make together --------------------------------------------------------------

    @property
    def dataset_name(self) -> str:
        return self.data.name

    @property
    def run_dir(self) -> Path:
        run = self.run
        return Path(run.output_dir) / (run.run_name or f"{run.algorithm}-{self.data.name}-seed{run.seed}")

    @property
    def policy_loss_in_use(self) -> str:
        """--policy-loss, else the record's loss for this many updates per batch (``Algorithm.loss_for``): resolved
        here, not filled, since a copy of a filled config may change the updates per batch."""
        return self.loss.policy_loss or get_algorithm(self.run.algorithm).loss_for(self.loss.several_updates)

    @property
    def multi_turn(self) -> bool:
        return self.turns.multi_turn

    def trajectory_tokens(self, multi_turn: bool | None = None) -> int:
        """The most tokens after the prompt a sample may hold (``TurnsSection.trajectory_tokens``)."""
        return self.turns.trajectory_tokens(self.sampling.max_new_tokens, multi_turn)

    def engine_tokens(self, multi_turn: bool | None = None) -> int:
        """The most tokens a sampling engine adds to a prompt (``TurnsSection.engine_tokens``)."""
        return self.turns.engine_tokens(self.sampling.max_new_tokens, multi_turn)

    def resolved_user_code(self) -> dict:
        """The settings that name user code, each in the form that finds it from any working folder, so that a
        run resumes from anywhere."""
        from auto_research.user_code import USER_CODE_SETTINGS, resolved_settings  # noqa: PLC0415

        return resolved_settings({key: getattr(self, key) for key in USER_CODE_SETTINGS})

    @classmethod
    def from_trl(cls, settings: dict, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """A config from TRL's names (an ``RLOOConfig``'s ``to_dict()``) or ours, over ``base``: the same table as
        the flags and config files (``config/trl.py``)."""
        base = base or cls()
        return replace(base, **_keywords(settings, base))

    def filled(self) -> "GenerationConfig":
        """A copy with the dataset's presets and the algorithm record's defaults in place of unset (None) settings.
        The settings computed from --steps (a preset's or --warmup-ratio's warmup) are named in the copy's
        ``from_steps``, so that ``--resume --steps`` keeps the run's own; a copy made by ``replace`` names none."""
        preset = GENERATION_PRESETS[self.dataset if self.dataset in GENERATION_PRESETS else "jsonl"]
        filled = replace(self, **{key: value for key, value in preset.items() if getattr(self, key) is None})
        filled = replace(filled, **filled.resolved_user_code())
        schedule = _schedule_defaults(self, filled)
        filled = replace(filled, **schedule, **_record_defaults(filled))
        object.__setattr__(filled, "from_steps", frozenset(schedule) & FROM_STEPS)
        return filled

    def validate(self) -> "GenerationConfig":
        """Every check that needs neither torch nor the data: each section's, then ``check_across``."""
        for section in SECTIONS:
            getattr(self, section).check()
        check_across(self)
        return self

    def reported_settings(self, critic: bool) -> dict:
        """The settings metrics.json reports beside a run's figures: its length and the sections that shape its
        updates, flat, less the loss settings the algorithm leaves unused."""
        sections = ("sampling", "loss", "optimisation", *(("critic",) if critic else ()))
        unused = _unused_settings(get_algorithm(self.run.algorithm), self.policy_loss_in_use)
        return json_ready({"steps": self.run.steps, **{item.name: getattr(getattr(self, section), item.name)
                                                         for section in sections
                                                         for item in fields(SECTIONS[section])
                                                         if item.name not in unused}})

    def to_json(self) -> dict:
        """The flat settings (name → value, paths as text): what a checkpoint records and a resume compares."""
        return json_ready({item.name: getattr(self, item.name) for item in self.flat_fields()})


def _keywords(settings: dict, base: GenerationConfig) -> dict:
    """Python keywords, ours or TRL's, as our settings (``trl.keywords``); ``base`` gives the defaults TRL's batch
    is counted in."""
    from auto_research.config import trl
    from auto_research.config.files import takes

    ours = {item.name: item for item in GenerationConfig.flat_fields()}
    return trl.keywords(settings, lambda name, value: takes(ours[name], value) if name in ours else None, base)


def _with_trl_names(flat: dict, sections: dict) -> dict:
    """``GenerationConfig(num_generations=4)``: TRL's names translated; a name neither ours nor TRL's is a
    TypeError, as for any class."""
    from auto_research.config.trl import is_trl_name

    unknown = [name for name in flat if name not in OWNER and not is_trl_name(name)]
    if unknown:
        raise TypeError(f"GenerationConfig() got an unexpected keyword argument {unknown[0]!r}")
    return _keywords(flat, GenerationConfig(**sections))


def _unused_settings(algorithm, policy_loss: str) -> set[str]:
    """The loss settings a run of ``algorithm`` (its record) with ``policy_loss`` does not read."""
    unused = {"normalize_advantages"} if algorithm.whiten else {"whiten_advantages"}
    if algorithm.std is None:
        unused.add("std")
    if policy_loss in RATIO_FREE_LOSSES:
        unused |= {"clip_range", "clip_low", "clip_high"}
    return unused


def _schedule_defaults(given: GenerationConfig, filled: GenerationConfig) -> dict:
    """The evaluations' cadence and the warmup, from the steps (a preset's warmup capped at a tenth of them)."""
    values = {}
    if filled.eval_every is None:
        values["eval_every"] = max(1, filled.steps // 10)
    if given.warmup_ratio is not None:
        values["warmup_steps"] = math.ceil(filled.steps * given.warmup_ratio)
    elif given.warmup_steps is None:
        values["warmup_steps"] = min(filled.warmup_steps, filled.steps // WARMUP_SHARE)
    return values


def _record_defaults(config: GenerationConfig) -> dict:
    """The algorithm record's defaults for the loss and rollout settings left unset."""
    record, loss = get_algorithm(config.algorithm), config.loss
    kl_in = loss.kl_in or ("none" if loss.teacher_model else record.kl)  # a teacher's signal replaces the KL's
    values = {"kl_in": kl_in, "kl_estimator": loss.kl_estimator or record.kl_estimator_for(kl_in),
              "loss_aggregation": loss.loss_aggregation or record.aggregation,
              "clip_low": _first(loss.clip_low, loss.clip_range, record.clip_low),
              "clip_high": _first(loss.clip_high, loss.clip_range, record.clip_high),
              "std": loss.std or record.std,
              "rollout_correction": config.rollout_correction or record.rollout_correction,
              "dynamic_sampling": _first(config.dynamic_sampling, record.dynamic_sampling)}
    buffer = loss.overlong_buffer
    if buffer is None and isinstance(config.max_new_tokens, int):
        buffer = values["overlong_buffer"] = int(record.overlong_buffer_fraction * config.max_new_tokens)
    if loss.overlong_penalty is None and buffer:
        values["overlong_penalty"] = 1.0
    return values


def _first(*values):
    return next((value for value in values if value is not None), None)


# --- the rules that join sections ------------------------------------------------------------------------


def check_across(config: GenerationConfig) -> None:
    """The rules that read more than one section, each naming those it joins."""
    algorithm = get_algorithm(config.run.algorithm)
    _check_data_and_model(config.data, config.policy, config.rewards)
    _check_algorithm(algorithm, config)
    _check_batch(config.sampling, config.loss)
    _check_memory(config.optimisation, config.lora, config.policy)
    if config.lora.lora_r and config.loss.reference_model:  # lora × loss
        raise UserError("--reference-model with --lora-r is not built: under LoRA the reference is the policy with "
                        "its adapters off")
    loaded = [name for name, source in config.loss.teachers.items() if not served(source)]
    if config.policy.fsdp and len(config.loss.teachers) > 1 and loaded:  # policy × loss
        raise UserError(f"several --teacher-model entries with --fsdp: teacher {loaded[0]!r} would be loaded and "
                        "sharded, and a rank whose rows name no teacher of its would miss its collectives; serve it "
                        "(NAME=http://HOST:PORT, auto-research rollout-serve) or leave out --fsdp")
    config.rollout.check_staleness(config.run.steps, algorithm, config.policy.fsdp)
    _check_in_flight(config)


def _check_in_flight(config: GenerationConfig) -> None:
    """rollout × sampling, turns: what partial rollouts cannot take yet."""
    if not config.rollout.in_flight_updates:
        return
    if config.sampling.dynamic_sampling:
        raise UserError("--in-flight-updates with --dynamic-sampling is not built (a refill would wait for a whole "
                        "draw)")
    if config.turns.multi_turn:
        raise UserError("--in-flight-updates is built for single-turn completions, not --environment, --tools or "
                        "--rollout-function")


def _check_data_and_model(data: DataSection, policy: PolicySection, rewards: RewardSection) -> None:
    """data × policy, rewards: a model without an embedded one, a preference dataset's reward."""
    if policy.model is None and data.dataset not in EMBEDDED_MODEL_DATASETS:
        raise UserError(f"--model is required for {data.dataset} (only {' and '.join(EMBEDDED_MODEL_DATASETS)} have "
                        "an embedded model; give a local folder or hub id, or an 'auto-research sft' output)")
    if data.dataset in PREFERENCE_DATASETS and not rewards.reward_model and not rewards.reward:
        raise UserError(f"{data.dataset} is optimised against a learned reward model: give --reward-model "
                        "(auto-research rlhf samples the preference pairs and trains one), or --reward")


def _check_algorithm(algorithm, config: GenerationConfig) -> None:
    """run (its algorithm's record) × sampling, turns, loss, critic: what the record cannot take."""
    check_group_size(algorithm, config.sampling.group_size)
    config.turns.check_loops(algorithm)
    if config.sampling.dynamic_sampling and algorithm.needs_greedy:
        raise UserError(f"--dynamic-sampling with {algorithm.name} is not built (a refilled prompt would need its "
                        "greedy baseline too)")
    if config.sampling.dynamic_sampling and "task" not in algorithm.rewards:
        raise UserError(f"--dynamic-sampling drops groups whose task rewards are equal; {algorithm.name} takes no "
                        "task reward")
    config.loss.check_with(algorithm)
    config.critic.check_with(algorithm)


def _check_batch(sampling: SamplingSection, loss: LossSection) -> None:
    """sampling × loss: mini-batches of whole groups, and the overlong punishment inside the length limit."""
    if sampling.prompts_per_step is not None and sampling.prompts_per_step % loss.ppo_mini_batches:
        raise UserError(f"--ppo-mini-batches {loss.ppo_mini_batches} must divide --prompts-per-step "
                        f"{sampling.prompts_per_step} (each mini-batch holds whole groups)")
    if loss.overlong_buffer and sampling.max_new_tokens is not None and loss.overlong_buffer >= sampling.max_new_tokens:
        raise UserError(f"--overlong-buffer {loss.overlong_buffer} must be below --max-new-tokens "
                        f"{sampling.max_new_tokens}: the punishment starts at max-new-tokens − buffer tokens")


def _check_memory(optimisation: OptimisationSection, lora: LoraSection, policy: PolicySection) -> None:
    """optimisation × lora, policy: a reference of its own to offload."""
    if optimisation.offload_reference and lora.lora_r:
        raise UserError("--offload-reference with --lora-r: the reference is the policy with its adapters off, "
                        "it has no weights of its own to offload")
    if optimisation.offload_reference and policy.fsdp:
        raise UserError("--offload-reference with --fsdp is not built (FSDP already shards the reference over "
                        "the ranks)")
