"""The Python API: the command line's generation-level training as one function.

    from auto_research import GenerationConfig, post_train

    def shorter_is_better(prompts, completions, rows):
        return [1.0 / (1 + len(c)) for c in completions]

    metrics = post_train(
        [{"prompt": "2+3=", "answer": "5"}, ...],          # a list of dicts, a .jsonl path or a dataset name
        reward=shorter_is_better,                           # callables, as --reward module:function gets them
        config=GenerationConfig(model="path/or/hub-id", steps=100, output_dir="runs"),
    )

It checks everything the command line checks, in the same order and with the
same one-line ``UserError`` messages, writes the same run folder
(metrics.json, metrics.jsonl, report.md, curves.png, checkpoints/) and returns
the metrics.json payload.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from auto_research.config.fields import IN_MEMORY
from auto_research.config.generation import GenerationConfig
from auto_research.errors import UserError


def post_train(dataset: str | Sequence[dict] | None = None, *, reward: Callable | Sequence[Callable] | None = None,
               config: GenerationConfig | None = None, name: str = "rows", log: Callable[[str], None] = print,
               environment: Callable | None = None, tools: Sequence[Callable] = (),
               rollout_function: Callable | None = None, **settings) -> dict:
    """Train with RL on a causal LM and return the run's metrics.

    ``dataset``: ``arithmetic-generate``, ``gsm8k-generate``, a ``.jsonl`` path, or a list
    of dicts with ``prompt`` and ``answer`` (or the config's ``prompt_field`` and
    ``answer_field``); the last rows are held out as with a JSONL file, and ``name`` is
    their dataset's name (their run folder is ``<algorithm>-<name>-seed<seed>``; the
    ``run_name`` setting names the folder of any run). ``reward``: one function or several,
    each called as ``reward(prompts, completions, rows)`` (or TRL's
    ``reward(prompts, completions, **columns)``) and returning a float or None per
    completion; they add to ``config.reward`` and ``config.reward_model``. ``settings``
    override fields of ``config``: ``GenerationConfig``'s field names, or TRL's names
    (``num_generations=4, max_completion_length=64, per_device_train_batch_size=8``;
    docs/trl.md), translated as the command line translates them.
    ``environment`` (``make_env(row)``) and ``tools`` (functions): multi-turn rollouts, as --environment and
    --tools (docs/environments.md); ``rollout_function`` (``fn(rows, context)``): your own rollout loop, as
    --rollout-function.
    """
    # Imported here: ``import auto_research`` stays light, and the run's checks come before torch's import.
    from auto_research.recipes.post_train import post_train_generation

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
    return post_train_generation(config, log=log, rows=rows, reward_functions=named, environment=environment,
                                 tools=tools, rollout_function=rollout_function)["runs"][0]
