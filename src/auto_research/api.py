"""The Python API: the command line's generation-level training as one function (``post_train``), or in TRL's
trainer shape (``Trainer``); examples in docs/generation-level.md, "From Python". Both check everything the command
line checks, with the same one-line ``UserError`` messages, write the same run folder and return the metrics.json
payload.
"""

from __future__ import annotations

from dataclasses import replace
from os import PathLike
from typing import Callable, Sequence

from auto_research.config.fields import IN_MEMORY
from auto_research.config.generation import GenerationConfig
from auto_research.errors import UserError


def post_train(dataset: str | Sequence[dict] | None = None, *, reward: Callable | Sequence[Callable] | None = None,
               config: GenerationConfig | None = None, name: str = "rows", log: Callable[[str], None] = print,
               environment: Callable | None = None, tools: Sequence[Callable] = (),
               rollout_function: Callable | None = None, **settings) -> dict:
    """Train with RL on a causal LM and return the run's metrics (docs/generation-level.md, "From Python").

    ``dataset``: a dataset name, a ``.jsonl`` path, or a list of dicts with ``prompt`` and ``answer`` (or the
    config's ``prompt_field`` and ``answer_field``), whose last rows are held out, ``name`` naming them (the run
    folder ``<algorithm>-<name>-seed<seed>``). ``reward``: one function or several, each called as
    ``reward(prompts, completions, rows)`` (or TRL's ``reward(prompts, completions, **columns)``), a float or None
    per completion, added to ``config.reward``'s. ``settings`` override fields of ``config``, by our names or
    TRL's (docs/trl.md). ``environment`` (``make_env(row)``), ``tools`` and ``rollout_function`` (``fn(rows,
    context)``): as --environment, --tools and --rollout-function (docs/environments.md).
    """
    # Imported here: ``import auto_research`` stays light, and the run's checks come before torch's import.
    from auto_research.recipes.post_train import post_train_generation

    config, rows, named = _inputs(dataset, reward, config, name, settings)
    return post_train_generation(config, log=log, rows=rows, reward_functions=named, environment=environment,
                                 tools=tools, rollout_function=rollout_function)["runs"][0]


def _inputs(dataset, reward, config: GenerationConfig | None, name: str, settings: dict) -> tuple:
    """``post_train``'s arguments as a run takes them: the config (``settings`` over it, ours or TRL's names), the
    rows in memory (None for a dataset named by text) and the reward functions by name."""
    config = GenerationConfig.from_trl(settings, config) if settings else (config or GenerationConfig())
    rows = None
    if isinstance(dataset, str):
        config = replace(config, dataset=dataset)
    elif dataset is not None:
        rows = list(dataset)
        config = replace(config, dataset=f"{IN_MEMORY}{name}")
    functions = [] if reward is None else [reward] if callable(reward) else list(reward)
    named = [(getattr(function, "__name__", f"reward{index}"), function) for index, function in enumerate(functions)]
    if not all(callable(function) for _, function in named):
        raise UserError("reward: give a function, or a list of functions, called as reward(prompts, completions, rows)")
    return config, rows, named


TRAINER_ARGUMENTS = {
    "peft_config": "LoRA is given as settings here: lora_r, lora_alpha, lora_dropout, lora_target_modules",
    "processing_class": "the tokenizer is the model's own (its folder's or hub id's)",
    "reward_processing_classes": "a reward model's tokenizer is its own (reward_model=...)",
    "callbacks": "not built: each step's figures are in <run>/metrics.jsonl, and report_to sends them to trackers",
    "optimizers": "not built: AdamW, set by learning_rate, weight_decay, lr_schedule and warmup_steps",
}
"""TRL trainers' arguments that are not settings, and what to give here instead (refused in one line)."""


class Trainer:
    """TRL's trainer shape over ``post_train``'s one path: ``trainer.train()`` returns the metrics.json payload,
    ``trainer.evaluate()`` the held-out evaluation of the model as it now is.

    ``config`` (or ``args``, TRL's name for it): a ``GenerationConfig``, a dict of settings (ours or TRL's names) or
    TRL's config object (``RLOOConfig(...)``: its ``to_dict()``, as ``GenerationConfig.from_trl`` takes it); keywords
    set over it. ``reward_funcs``: functions (as post_train's ``reward``), and names (``"match"``, ``"module:name"``:
    TRL's ``reward_funcs`` setting). ``train_dataset``: rows (a list of dicts, a ``datasets.Dataset``), a ``.jsonl``
    path or a dataset name. ``eval_dataset``: rows held out after the training rows (the held-out evaluation)."""

    def __init__(self, config=None, *, args=None, model=None, reward_funcs=None, train_dataset=None,
                 eval_dataset=None, name: str = "rows", log: Callable[[str], None] = print,
                 environment: Callable | None = None, tools: Sequence[Callable] = (),
                 rollout_function: Callable | None = None, **settings):
        refused = next((key for key in settings if key in TRAINER_ARGUMENTS), None)
        if refused:
            raise UserError(f"{refused}: {TRAINER_ARGUMENTS[refused]}")
        if config is not None and args is not None:
            raise UserError("give the settings as config or as args (TRL's name for it), not both")
        config = args if config is None else config
        if config is not None and not isinstance(config, GenerationConfig):
            settings, config = {**_settings_of(config), **settings}, None
        if model is not None:
            if not isinstance(model, (str, PathLike)):
                raise UserError(f"model: give a hub id or a folder, not a {type(model).__name__} (save it with "
                                "save_pretrained(folder), then give the folder)")
            settings["model"] = str(model)
        functions = [] if reward_funcs is None else [reward_funcs] if isinstance(reward_funcs, str) or callable(
            reward_funcs) else list(reward_funcs)
        if any(isinstance(function, str) for function in functions):
            settings["reward_funcs"] = [function for function in functions if isinstance(function, str)]
        rows, held = _with_held_out(train_dataset, eval_dataset)
        self.config, self.rows, self.reward_functions = _inputs(
            rows, [function for function in functions if not isinstance(function, str)], config, name, settings)
        if held:
            if self.config.evaluation_examples not in (None, held):
                raise UserError(f"evaluation_examples {self.config.evaluation_examples} and eval_dataset's {held} "
                                "rows differ: give one")
            self.config = replace(self.config, evaluation_examples=held)
        self.log, self.environment, self.tools, self.rollout_function = log, environment, tools, rollout_function
        self.metrics: dict | None = None

    @property
    def run_dir(self):
        """The run folder (metrics.json, metrics.jsonl, report.md, curves.png, checkpoints/)."""
        return self.config.run_dir

    def train(self) -> dict:
        """Train, write the run folder and return the metrics.json payload (``post_train``'s return)."""
        from auto_research.recipes.post_train import post_train_generation

        self.metrics = post_train_generation(self.config, log=self.log, rows=self.rows,
                                             reward_functions=self.reward_functions, environment=self.environment,
                                             tools=self.tools, rollout_function=self.rollout_function)["runs"][0]
        return self.metrics

    def evaluate(self) -> dict:
        """The held-out evaluation (accuracy, mean_reward, entropy, kl_from_reference): after ``train``, the trained
        model's, as the run measured it at its end (metrics.json's ``final``); before, the starting model's, built
        as the run builds it (nothing is trained or written)."""
        if self.metrics is not None:
            return dict(self.metrics["final"])
        from auto_research.recipes.post_train import evaluate_generation

        return evaluate_generation(self.config, log=self.log, rows=self.rows, reward_functions=self.reward_functions,
                                   environment=self.environment, tools=self.tools,
                                   rollout_function=self.rollout_function)


def _settings_of(config) -> dict:
    """A dict of settings, or TRL's config object's fields (``to_dict()``)."""
    if isinstance(config, dict):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    hint = " (the model is model=...)" if isinstance(config, (str, PathLike)) else ""
    raise UserError(f"config: give a GenerationConfig, a dict of settings (ours or TRL's names) or TRL's config "
                    f"object, not a {type(config).__name__}{hint}")


def _with_held_out(train_dataset, eval_dataset) -> tuple:
    """TRL's ``eval_dataset`` as the held-out rows: put after the training rows, which a run holds out the last of;
    returns the rows and how many are held out (0 without ``eval_dataset``)."""
    if eval_dataset is None:
        return train_dataset, 0
    if train_dataset is None or isinstance(train_dataset, (str, PathLike)):
        raise UserError("eval_dataset: a dataset named by text holds out its own last rows; give train_dataset as "
                        "rows (a list of dicts, a datasets.Dataset) to hold out eval_dataset's")
    held = list(eval_dataset)
    if not held:
        raise UserError("eval_dataset is empty: give at least one row, or leave it out (the last rows of "
                        "train_dataset are held out then)")
    return [*train_dataset, *held], len(held)
