"""Each subcommand: its flags (and ``--config``) into a config, the recipe called, the outcome printed.

Recipes are imported inside each command, after its settings are checked: they import NumPy, torch or
matplotlib, which ``--help`` and a mistyped flag must not wait for.
"""

from __future__ import annotations

import argparse
import sys

from auto_research.algorithms.registry import candidate_algorithms
from auto_research.cli.flags import flag_names, given, load_config_file
from auto_research.config.candidate import CandidateConfig
from auto_research.config.generation import GenerationConfig
from auto_research.config.options import CompareOptions, PostTrainOptions
from auto_research.config.fields import GENERATION_DATASETS, check_candidate_dataset, is_generation_dataset
from auto_research.engine.launch import environment_rank
from auto_research.errors import UserError

CANDIDATE_FIELDS = set(flag_names(CandidateConfig))


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _levels(args, classes, several_runs: bool = False) -> tuple[dict, str]:
    """The run's settings from --config and the flags, under our names or TRL's. ``several_runs`` (compare): K is
    each run's own, so a setting of K and TRL's batch (counted in completions of one K) are refused."""
    from auto_research.config import trl

    load_config_file(args, classes, trl_names=True)
    settings = given(args, GenerationConfig, trl_names=True)
    if several_runs and ("group_size" in settings or trl.has_batch(settings)):
        raise UserError("compare runs each algorithm at its own K: give --group-size (several, e.g. 2,4, or per "
                        "algorithm, rloo:2) and --samples-per-step (completions a step, at every K), not K or TRL's "
                        "per-device batch in a config file or TRL's names")
    settings = trl.finish(settings, GenerationConfig())
    return settings, settings.get("dataset", "arithmetic-smoke")


def _candidate(settings: dict, dataset: str) -> CandidateConfig:
    check_candidate_dataset(dataset)
    extra = [name for name in settings if name not in CANDIDATE_FIELDS]
    if extra:
        flag = flag_names(GenerationConfig)[extra[0]]
        raise UserError(f"{flag} applies to the generation level only ({', '.join(GENERATION_DATASETS)}, .jsonl); "
                        f"{dataset} is a candidate-level dataset")
    return CandidateConfig(**{**settings, "dataset": dataset})


def _print_runs(result: dict, summary_name: str | None = None) -> None:
    from auto_research.report import tables

    for metrics in result["runs"]:
        training = metrics["training"]
        print(f"{metrics['algorithm']} on {metrics['dataset']}: seed {metrics['seed']}, {training['steps']} steps, "
              f"K={training['group_size']}, {training['train_examples']} train / "
              f"{training['validation_examples']} validation problems")
        if metrics.get("model"):
            print(f"model: {metrics['model']}")
        print(tables.console_table(metrics))
        print()
    if result["summary"] is not None:
        print(tables.summary_table({summary_name: result["summary"]}))
        print()
    for path in result["paths"]:
        print(f"wrote {path}")


def post_train(args: argparse.Namespace) -> int:
    settings, dataset = _levels(args, [GenerationConfig, PostTrainOptions])
    options = PostTrainOptions(**given(args, PostTrainOptions))
    if is_generation_dataset(dataset):
        if options.seeds:
            raise UserError("--seeds runs several seeds at the candidate level only; at the generation level run one "
                            "--seed per command")
        from auto_research.recipes.post_train import post_train_generation

        result = post_train_generation(GenerationConfig(**settings), log=_stderr)
        if environment_rank() != 0:  # under torchrun, rank 0 reports
            return 0
    else:
        config = _candidate(settings, dataset).validate()
        seeds = options.seed_list()
        from auto_research.recipes.candidate import post_train as candidate_post_train

        result = candidate_post_train(config, seeds)
    _print_runs(result, settings.get("algorithm", "rloo"))
    return 0


def compare(args: argparse.Namespace) -> int:
    settings, dataset = _levels(args, [GenerationConfig, CompareOptions], several_runs=True)
    options = CompareOptions(**given(args, CompareOptions))
    group_sizes = options.group_size_list()
    seeds = options.seed_list() or [settings.get("seed", 42)]
    if is_generation_dataset(dataset):
        runs = options.generation_runs(group_sizes)
        from auto_research.recipes.compare import compare_generation

        result = compare_generation(GenerationConfig(**settings), runs, seeds, log=_stderr,
                                    samples_per_step=options.samples_per_step,
                                    drop_checkpoints=options.drop_checkpoints)
        print(result["table"])
        print()
        for path in result["paths"]:
            print(f"wrote {path}")
        return 0
    if len(group_sizes) > 1:
        raise UserError("several --group-size values are for the generation level; the candidate level takes one")
    if options.samples_per_step is not None or options.drop_checkpoints:
        raise UserError("--samples-per-step and --drop-checkpoints are for the generation level; the candidate level "
                        "has neither prompts per step nor checkpoints")
    config = _candidate({**settings, "group_size": group_sizes[0]}, dataset)
    algorithms = options.algorithm_list(candidate_algorithms())
    for name in algorithms:
        CandidateConfig(**{**vars(config), "algorithm": name}).validate()
    from auto_research.recipes.candidate import compare as candidate_compare

    result = candidate_compare(config, algorithms, seeds)
    print(result["table"])
    print()
    for path in result["paths"][-3:]:
        print(f"wrote {path}")
    print(f"and {len(result['paths']) - 3} files in per-run directories under {config.output_dir}")
    return 0


def _recipe_config(args: argparse.Namespace, name: str):
    """The command's settings (``config/recipes.py``'s class ``name``) from --config and the flags, validated."""
    from auto_research.config import recipes

    cls = getattr(recipes, name)
    load_config_file(args, [cls])
    return cls(**given(args, cls)).validate()


def sft(args: argparse.Namespace) -> int:
    config = _recipe_config(args, "SFTConfig")
    from auto_research.recipes import sft as recipe

    result = recipe.run(config)
    for row in result["history"]:
        accuracy = row["held_out_accuracy"]  # None: the rows have no answers to check
        print(f"step {row['step']:>6}  loss {row['loss']:.4f}  held-out accuracy "
              f"{'n/a' if accuracy is None else f'{accuracy:.3f}'}")
    print(f"wrote {result['output_dir']}")
    return 0


def reward_model(args: argparse.Namespace) -> int:
    config = _recipe_config(args, "RewardModelConfig")
    from auto_research.recipes import reward_model as recipe

    metrics = recipe.run(config)
    print(f"reward model on {metrics['train_pairs']} pairs ({metrics['evaluation_pairs']} held out): held-out pairwise "
          f"accuracy {metrics['pairwise_accuracy']:.3f}, mean reward gap {metrics['reward_gap']:.3f}")
    print(f"wrote {config.output_dir} (use it as --reward-model {config.output_dir}), metrics.json and calibration.png")
    return 0


def rlhf(args: argparse.Namespace) -> int:
    config = _recipe_config(args, "RLHFConfig")
    from auto_research.recipes import rlhf as recipe

    result = recipe.run(config, log=_stderr)
    print(result["table"])
    for path in result["paths"]:
        print(f"wrote {path}")
    return 0


def rollout_serve(args: argparse.Namespace) -> int:
    from auto_research.orphans import stop_with_trainer

    stop_with_trainer()  # a trainer's own rollout process (--rollout-mode process) ends with it, from its start
    config = _recipe_config(args, "ServeConfig")
    from auto_research.engine.machine import set_threads
    from auto_research.engine.rollout.serve import serve
    from auto_research.engine.samplers import SAMPLERS, sampler_key

    set_threads(config.threads)
    serve(config, SAMPLERS[sampler_key(config.engine, "server")].serve, log=_stderr)
    return 0


def data(args: argparse.Namespace) -> int:
    config = _recipe_config(args, "DataConfig")  # data has no --config: the flags alone
    from auto_research.data.gsm8k import ensure_gsm8k, gsm8k_dir

    directory = gsm8k_dir(config.dataset_dir)
    already = all((directory / name).is_file() for name in ("train.jsonl", "test.jsonl"))
    ensure_gsm8k(config.dataset_dir, offline=False, base_url=config.base_url)
    print(f"GSM8K {'already present' if already else 'downloaded'} in {directory}")
    return 0

