"""TRL's names for this project's settings (docs/trl.md has the whole table and says where our defaults differ).

Every field of TRL 1.16's ``RLOOConfig`` and ``GRPOConfig`` (and ``TrainingArguments``) that one of ours means is
accepted under TRL's name, as a flag, a config-file key and a Python keyword; ``translate`` turns them into ours
exactly. A field we have no equivalent for is refused in one line, never dropped; one whose value asks for nothing
different (``optim: adamw_torch``) is accepted at that value only (``trl_neutral.py``).

The batch: TRL counts completions an optimizer step (per_device_train_batch_size × gradient_accumulation_steps ×
processes); we count prompts a step. So per_device_train_batch_size is our ``micro_batch_size`` and the product
over K is ``prompts_per_step``, refused when K does not divide it (``finish``: K is known only once every source
of settings is merged). Light: no torch, no transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlparse

from auto_research.config.trl_neutral import ANY, NEUTRAL, REASONS
from auto_research.engine.launch import environment_world_size
from auto_research.errors import UserError

# Settings that wait for ``finish`` (K, the steps and every source merged): TRL's batch, its server address, its
# epochs. Their names start with "_" and never reach a config.
_PER_DEVICE, _ACCUMULATION, _STEPS_PER_GENERATION = "_per_device", "_accumulation", "_steps_per_generation"
_HOST, _PORT, _EPOCHS, _CONSTANT = "_vllm_host", "_vllm_port", "_epochs", "_constant_schedule"
_BIAS_CORRECTED_KL, _DISTILLATION = "_bias_corrected_kl", "_distillation"
TRL_DEFAULT_PER_DEVICE = 8
"""TrainingArguments' per_device_train_batch_size when only gradient_accumulation_steps is given."""


@dataclass(frozen=True)
class TrlField:
    kind: str
    """How a flag's text is read: int, float, bool, text, floats, texts, number (int or float), bool-or-text."""
    ours: str
    """What it sets, for the docs and --help (our flag)."""
    to_ours: Callable[[Any], dict]


def _same(field: str) -> Callable[[Any], dict]:
    return lambda value: {field: value}


def _refuse(name: str, why: str) -> UserError:
    return UserError(f"TRL's {name}: {why}")


def _choice(name: str, table: dict, refused: dict | None = None) -> Callable[[Any], dict]:
    """A TRL value → our settings by ``table``; a value in ``refused`` says why it is not built."""
    def convert(value):
        key = value if not isinstance(value, str) else value.strip()
        if key in table:
            return dict(table[key])
        if refused and key in refused:
            raise _refuse(name, f"{value!r} {refused[key]}")
        allowed = ", ".join(str(choice) for choice in table)
        raise _refuse(name, f"{value!r} has no equivalent here; accepted: {allowed}")
    return convert


def _warmup_steps(value) -> dict:
    """transformers 5: an integer is a step count, a float in [0, 1) a share of the steps."""
    if isinstance(value, float) and 0 <= value < 1:
        return {"warmup_ratio": value}
    if value != int(value) or value < 0:
        raise _refuse("warmup_steps", f"{value} is neither a step count nor a share of the steps in [0, 1)")
    return {"warmup_steps": int(value)}


def _save_steps(value) -> dict:
    if value != int(value) or value < 1:
        raise _refuse("save_steps", f"{value}: give a whole number of steps (a share of the run is not built)")
    return {"checkpoint_every": int(value)}


def _report_to(value) -> dict:
    names = [value] if isinstance(value, str) else list(value or ["none"])
    names = [part.strip() for name in names for part in str(name).split(",") if part.strip()]
    if "all" in names:
        raise _refuse("report_to", "'all' has no equivalent here: name the trackers (tensorboard, wandb, trackio, "
                                   "mlflow)")
    return {"report_to": ",".join(names) or "none"}


def _server_url(value) -> dict:
    parsed = urlparse(str(value))
    if not parsed.hostname or not parsed.port:
        raise _refuse("vllm_server_base_url", f"{value!r}: expected http://HOST:PORT")
    return {"rollout_server": f"{parsed.hostname}:{parsed.port}"}


_LOSS_TYPES = {"grpo": {"loss_aggregation": "sequence-mean-token-mean"}, "dr_grpo": {"loss_aggregation": "constant"},
               "dapo": {"loss_aggregation": "token-mean"},
               "cispo": {"policy_loss": "cispo", "loss_aggregation": "token-mean"}}
_LOSS_TYPES_REFUSED = {
    "bnpo": "normalises by each process's own tokens, so the numbers depend on the process count; dapo (token-mean "
            "over the global batch) is the same loss independent of it",
    "sapo": "(SAPO's soft gate) is not built", "luspo": "(LUSPO) is not built", "vespo": "(VESPO) is not built",
}
_SCHEDULES = {"constant": {"lr_schedule": "constant", _CONSTANT: True},
              "constant_with_warmup": {"lr_schedule": "constant"},
              "linear": {"lr_schedule": "linear"}, "cosine": {"lr_schedule": "cosine"}}
_CORRECTION_MODES = {"token_truncate": {"rollout_correction": "token-tis"},
                     "sequence_truncate": {"rollout_correction": "sequence-tis"},
                     "sequence_mask": {"rollout_correction": "sequence-mask"}}

MAPPED: dict[str, TrlField] = {
    # the group, the batch and the length
    "num_generations": TrlField("int", "--group-size", _same("group_size")),
    "per_device_train_batch_size": TrlField("int", "--micro-batch-size; with the next two, --prompts-per-step",
                                            lambda value: {"micro_batch_size": value, _PER_DEVICE: value}),
    "gradient_accumulation_steps": TrlField("int", "--prompts-per-step (with per_device_train_batch_size)",
                                            _same(_ACCUMULATION)),
    "steps_per_generation": TrlField("int", "one generation per optimizer step: must equal "
                                            "gradient_accumulation_steps", _same(_STEPS_PER_GENERATION)),
    "max_completion_length": TrlField("int", "--max-new-tokens", _same("max_new_tokens")),
    "max_steps": TrlField("int", "--steps (-1: unset)",
                          lambda value: {} if value is None or value < 0 else {"steps": value}),
    "num_train_epochs": TrlField("float", "ignored when max_steps is given, as in transformers; else refused",
                                 _same(_EPOCHS)),
    # the loss
    "beta": TrlField("float", "--beta", _same("beta")),
    "teacher_model_name_or_path": TrlField("text", "--teacher-model (DistillationConfig's; not with its beta)",
                                           lambda value: {"teacher_model": [value], _DISTILLATION: True}),
    "num_iterations": TrlField("int", "--ppo-epochs", _same("updates_per_batch")),
    "epsilon": TrlField("float", "--clip-range (both sides unless epsilon_high)", _same("clip_range")),
    "epsilon_high": TrlField("float", "--clip-high", _same("clip_high")),
    "loss_type": TrlField("text", "--loss-aggregation (cispo: and --policy-loss cispo)",
                          _choice("loss_type", _LOSS_TYPES, _LOSS_TYPES_REFUSED)),
    "scale_rewards": TrlField("bool-or-text", "--std unbiased (group, true) or none (none, false)",
                              _choice("scale_rewards", {"group": {"std": "unbiased"}, True: {"std": "unbiased"},
                                                        "none": {"std": "none"}, False: {"std": "none"}},
                                      {"batch": "(the batch's std, PPO Lite) is not built"})),
    "importance_sampling_level": TrlField("text", "sequence: --policy-loss gspo",
                                          _choice("importance_sampling_level", {"token": {},
                                                                                "sequence": {"policy_loss": "gspo"}})),
    "mask_truncated_completions": TrlField("bool", "--mask-truncated", _same("mask_truncated")),
    "normalize_advantages": TrlField("bool", "--normalize-advantages", _same("normalize_advantages")),
    "reward_weights": TrlField("floats", "--reward-weights", _same("reward_weights")),
    "reward_funcs": TrlField("texts", "--reward (each)", lambda value: {"reward": [value] if isinstance(value, str)
                                                                         else list(value)}),
    # sampling
    "temperature": TrlField("float", "--temperature", _same("temperature")),
    "top_p": TrlField("float", "--top-p", _same("top_p")),
    "top_k": TrlField("int", "--top-k", _same("top_k")),
    "use_vllm": TrlField("bool", "--sampler vllm (false: builtin)",
                         lambda value: {"sampler": "vllm" if value else "builtin"}),
    "vllm_mode": TrlField("text", "--rollout-mode", _choice("vllm_mode", {"colocate": {"rollout_mode": "colocate"},
                                                                          "server": {"rollout_mode": "server"}})),
    "vllm_server_base_url": TrlField("text", "--rollout-server", _server_url),
    "vllm_server_host": TrlField("text", "--rollout-server HOST (with vllm_server_port)", _same(_HOST)),
    "vllm_server_port": TrlField("int", "--rollout-server :PORT (with vllm_server_host)", _same(_PORT)),
    "vllm_gpu_memory_utilization": TrlField("float", "--rollout-memory", _same("rollout_memory")),
    "vllm_importance_sampling_correction": TrlField("bool", "false: --rollout-correction none",
                                                    lambda value: {} if value else {"rollout_correction": "none"}),
    "vllm_importance_sampling_mode": TrlField("text", "--rollout-correction",
                                              _choice("vllm_importance_sampling_mode", _CORRECTION_MODES,
                                                      {"token_mask": "(masking tokens) is not built"})),
    "vllm_importance_sampling_clip_max": TrlField("float", "--rollout-correction-cap", _same("rollout_correction_cap")),
    "vllm_importance_sampling_cap": TrlField("float", "--rollout-correction-cap", _same("rollout_correction_cap")),
    "max_tool_calling_iterations": TrlField("int", "--max-turns (iterations + 1)",
                                            lambda value: {} if value is None else {"max_turns": int(value) + 1}),
    # optimisation
    "learning_rate": TrlField("float", "--learning-rate", _same("learning_rate")),
    "lr_scheduler_type": TrlField("text", "--lr-schedule", _choice("lr_scheduler_type", _SCHEDULES)),
    "warmup_steps": TrlField("number", "--warmup-steps (a float in [0, 1): --warmup-ratio)", _warmup_steps),
    "warmup_ratio": TrlField("float", "--warmup-ratio", _same("warmup_ratio")),
    "weight_decay": TrlField("float", "--weight-decay", _same("weight_decay")),
    "max_grad_norm": TrlField("float", "--max-grad-norm", _same("max_grad_norm")),
    "bf16": TrlField("bool", "--dtype bfloat16 (false: float32)",
                     lambda value: {} if value is None else {"dtype": "bfloat16" if value else "float32"}),
    "fp16": TrlField("bool", "false only (float16 needs loss scaling: use bf16)",
                     _choice("fp16", {False: {}}, {True: "needs loss scaling, which is not built: use bf16 (fp32 "
                                                         "master weights, bf16 compute)"})),
    "gradient_checkpointing": TrlField("bool", "--gradient-checkpointing", _same("gradient_checkpointing")),
    "seed": TrlField("int", "--seed", _same("seed")),
    # the run
    "output_dir": TrlField("text", "--output-dir (ours holds the run's folder, see --run-name)", _same("output_dir")),
    "run_name": TrlField("text", "--run-name", _same("run_name")),
    "project": TrlField("text", "--tracker-project", _same("tracker_project")),
    "report_to": TrlField("texts", "--report-to", _report_to),
    "logging_steps": TrlField("int", "--log-every", _same("log_every")),
    "save_steps": TrlField("number", "--checkpoint-every", _save_steps),
    "save_total_limit": TrlField("int", "--keep-checkpoints", _same("keep_checkpoints")),
    "eval_steps": TrlField("int", "--eval-every", _same("eval_every")),
    "eval_strategy": TrlField("text", "steps: --eval-every eval_steps; no: --eval-every 0 (before and after only)",
                              _choice("eval_strategy", {"steps": {}, "no": {"eval_every": 0}},
                                      {"epoch": "has no equivalent here (steps draw fresh prompts, not epochs)"})),
    "log_completions": TrlField("bool", "false: --log-completions 0",
                                lambda value: {} if value else {"log_completions": 0}),
    "num_completions_to_print": TrlField("int", "--log-completions", _same("log_completions")),
    "disable_tqdm": TrlField("bool", "--no-progress", lambda value: {"progress": not value}),
    # TRL's script arguments (``trl grpo --config recipe.yaml`` files carry them beside the trainer's)
    "model_name_or_path": TrlField("text", "--model", _same("model")),
    "dataset_name": TrlField("text", "--dataset", _same("dataset")),
    "use_bias_correction_kl": TrlField("bool", "false, or true with beta 0 (the KL term is not multiplied by the "
                                               "importance ratio here)", _same(_BIAS_CORRECTED_KL)),
}


def kind_of(name: str) -> str:
    return MAPPED[name].kind if name in MAPPED else "any"


def is_trl_name(name: str) -> bool:
    return name in MAPPED or name in NEUTRAL


def _neutral(name: str, value) -> dict:
    allowed = NEUTRAL[name]
    if ANY in allowed or value in allowed:
        return {}
    why = REASONS.get(name, "has no equivalent here")
    accepted = " or ".join(repr(choice) for choice in allowed)
    raise _refuse(name, f"{value!r}: {why} (accepted only as {accepted}, which asks for nothing different)")


def translate(trl: dict) -> dict:
    """TRL's settings (name → value) → ours, with what waits for ``finish`` under names starting with "_"."""
    ours: dict = {}
    for name, value in trl.items():
        if name in MAPPED and value is None:
            continue  # TRL's "unset": ours decides
        if name in MAPPED:
            settings = MAPPED[name].to_ours(value)
        elif name in NEUTRAL:
            settings = _neutral(name, value)
        else:
            raise UserError(f"{name!r} is not a setting of TRL's RLOOConfig or GRPOConfig, nor of auto-research")
        for key, setting in settings.items():
            if key in ours and ours[key] != setting:
                raise UserError(f"TRL's {name} sets {key.lstrip('_')} to {setting!r}, another of the given TRL "
                                f"settings to {ours[key]!r}: give one")
            ours[key] = setting
    return ours


def has_batch(settings: dict) -> bool:
    """Whether ``settings`` (merged, before ``finish``) hold TRL's batch, which ``finish`` counts in K's completions."""
    return bool({_PER_DEVICE, _ACCUMULATION, _STEPS_PER_GENERATION} & set(settings))


def finish(settings: dict, defaults) -> dict:
    """Our settings only, with what waited for every source resolved (TRL's batch, server address, epochs,
    schedule, bias-corrected KL). ``defaults``: our settings' defaults (a ``GenerationConfig``, or the class)."""
    settings = dict(settings)
    pending = {key: settings.pop(key) for key in list(settings) if key.startswith("_")}
    if pending.get(_BIAS_CORRECTED_KL) and settings.get("beta", defaults.beta) > 0:
        raise _refuse("use_bias_correction_kl", f"true with beta {settings.get('beta', defaults.beta)}: the KL term "
                                                "is not multiplied by the importance ratio here; set it false (or "
                                                "beta 0)")
    if pending.get(_DISTILLATION) and "beta" in settings:
        raise _refuse("beta", "beside teacher_model_name_or_path it is the JSD's interpolation, here the KL's "
                              "weight: leave it out (the reverse KL, its beta 1, is built) or use --teacher-model")
    if _EPOCHS in pending and "steps" not in settings:
        raise _refuse("num_train_epochs", "steps here draw fresh prompts, not passes over the data: give max_steps "
                                          "(--steps)")
    if _HOST in pending or _PORT in pending:
        address = f"{pending.get(_HOST, '127.0.0.1')}:{pending.get(_PORT, 8000)}"
        if settings.setdefault("rollout_server", address) != address:
            raise UserError(f"--rollout-server {settings['rollout_server']} and TRL's vllm_server_host/port {address} "
                            "differ: give one")
    if pending.get(_CONSTANT) and (settings.get("warmup_steps") or settings.get("warmup_ratio")):
        raise _refuse("lr_scheduler_type", "'constant' ignores warmup in transformers: give constant_with_warmup "
                                           "for a warmup")
    if pending.get(_CONSTANT):
        settings.setdefault("warmup_steps", 0)
    if has_batch(pending):
        _batch(settings, pending, settings.get("group_size", defaults.group_size))
    return settings


def _batch(settings: dict, pending: dict, group_size: int) -> None:
    """TRL's completions an optimizer step, per_device × accumulation × processes, as prompts a step."""
    per_device = pending.get(_PER_DEVICE, TRL_DEFAULT_PER_DEVICE)
    accumulation = pending.get(_ACCUMULATION, 1)
    processes = environment_world_size()
    if pending.get(_STEPS_PER_GENERATION, accumulation) != accumulation:
        raise _refuse("steps_per_generation", f"{pending[_STEPS_PER_GENERATION]}: one generation serves one "
                                              f"optimizer step here, so it must equal gradient_accumulation_steps "
                                              f"({accumulation})")
    completions = per_device * accumulation * processes
    if completions % group_size:
        raise UserError(f"TRL's batch, per_device_train_batch_size {per_device} × gradient_accumulation_steps "
                        f"{accumulation} × {processes} process{'es' if processes > 1 else ''} = {completions} "
                        f"completions, is not a multiple of the group size K = {group_size} (num_generations)")
    prompts = completions // group_size
    if settings.setdefault("prompts_per_step", prompts) != prompts:
        raise UserError(f"--prompts-per-step {settings['prompts_per_step']} and TRL's batch ({completions} "
                        f"completions = {prompts} prompts of K = {group_size}) differ: give one")


def keywords(settings: dict, fits: Callable[[str, Any], bool | None], defaults) -> dict:
    """Python keywords, ours or TRL's, as our settings. ``fits(name, value)``: whether our field takes the value
    (None: no such field); a name both have (``report_to``) is ours when the value fits ours, else TRL's."""
    ours = {name: value for name, value in settings.items()
            if fits(name, value) or (fits(name, value) is not None and not is_trl_name(name))}
    translated = translate({name: value for name, value in settings.items() if name not in ours})
    for name, value in translated.items():
        if name in ours and ours[name] != value:
            raise UserError(f"{name}={ours[name]!r} and a TRL setting that makes it {value!r} were both given: "
                            "give one")
    return finish({**translated, **ours}, defaults)


def parse_flag(name: str, words: list[str]):
    """A TRL flag's words (argparse's nargs) → its value, read as TRL's command line reads it."""
    kind = kind_of(name)
    if kind in ("floats", "texts"):
        parts = [part for word in words for part in word.split(",") if part.strip()]
        return [_number(name, part, float) for part in parts] if kind == "floats" else parts
    text = words[0] if words else "true"
    if kind == "bool" or (kind == "bool-or-text" and text.lower() in ("true", "false")):
        return _boolean(name, text)
    if kind == "int":
        return _number(name, text, int)
    if kind in ("float", "number"):
        value = _number(name, text, float)
        return int(value) if kind == "number" and value.is_integer() and value >= 1 else value
    return _literal(text)


def _boolean(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "y", "false", "no", "0", "n"):
        return lowered in ("true", "yes", "1", "y")
    raise UserError(f"--{name.replace('_', '-')} takes true or false, got {text!r}")


def _number(name: str, text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise UserError(f"--{name.replace('_', '-')} takes {'an integer' if kind is int else 'a number'}, "
                        f"got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise UserError(f"--{name.replace('_', '-')} must be finite, got {text!r}")
    return value


def _literal(text: str):
    """A neutral field's flag text as the value a config would hold (None, booleans, numbers, else the text)."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def trl_names() -> list[str]:
    return sorted({*MAPPED, *NEUTRAL})
