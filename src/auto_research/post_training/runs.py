"""Entry points behind the command line: post-train one or several seeds, compare algorithms.

Everything that can fail on a user's input (settings, output directory, data
files) is checked for every run before the first one trains, and outputs are
written only once all runs have finished.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from auto_research.errors import UserError
from auto_research.files import atomic_write_json, atomic_write_text, check_writable_directory
from auto_research.post_training import report
from auto_research.post_training.config import DEVICE_PATTERN, CandidateConfig

COMPARISON_TAGS = {"gsm8k-candidate": "gsm8k", "arithmetic-smoke": "arithmetic"}
"""Short names in comparison files: classic-post-training-<tag>-seed42.json."""


def _progress(items, description: str):
    from tqdm import tqdm

    # Shown on a terminal only; logs and tests stay clean.
    return tqdm(items, desc=description, leave=False, disable=None)


def _run_all(configs: list[CandidateConfig]) -> list[dict]:
    from auto_research.post_training.candidate.trainer import load_data, train

    for config in configs:
        config.validate()
    prepared = [(config, load_data(config)) for config in configs]
    check_writable_directory(configs[0].output_dir)
    if len(prepared) == 1:
        return [train(*prepared[0])]
    return [train(config, data) for config, data in _progress(prepared, "runs")]


def _write_runs(configs: list[CandidateConfig], runs: list[dict]) -> list[Path]:
    """Each run's folder, written under its lock."""
    from auto_research.locks import FolderLock

    paths: list[Path] = []
    for run_config, metrics in zip(configs, runs):
        with FolderLock(run_config.run_dir) as lock:
            try:
                paths += report.write_run(run_config.run_dir, metrics)
            except BaseException:
                lock.remove_created()
                raise
    return paths


def _check_unlocked(configs) -> None:
    from auto_research.locks import check_unlocked

    for config in configs:
        check_unlocked(config.run_dir)


def post_train(config: CandidateConfig, seeds: list[int] | None = None) -> dict:
    """Train one run per seed; write each run directory and, for several seeds, a summary.

    Returns ``{"runs": [...metrics...], "paths": [...], "summary": dict | None}``.
    """
    configs = [replace(config, seed=seed) for seed in seeds] if seeds else [config]
    _check_unlocked(configs)
    runs = _run_all(configs)
    paths = _write_runs(configs, runs)
    summary = None
    if len(configs) > 1:
        stem = Path(config.output_dir) / f"{config.algorithm}-{config.dataset}-{report.seeds_tag(seeds)}-summary"
        paths += report.write_seed_summary(stem, config.algorithm, config.dataset, runs)
        summary = report.summarise_seeds(runs)
    return {"runs": runs, "paths": paths, "summary": summary}


def compare(config: CandidateConfig, algorithms: list[str], seeds: list[int]) -> dict:
    """Run every algorithm on identical data and settings; write one summary, table and plot."""
    configs = [replace(config, algorithm=name, seed=seed) for name in algorithms for seed in seeds]
    _check_unlocked(configs)
    runs = _run_all(configs)
    paths = _write_runs(configs, runs)

    by_algorithm = {name: [run for run in runs if run["algorithm"] == name] for name in algorithms}
    summaries = {name: report.summarise_seeds(group) for name, group in by_algorithm.items()}
    stem = Path(config.output_dir) / f"classic-post-training-{COMPARISON_TAGS[config.dataset]}-{report.seeds_tag(seeds)}"
    payload = {
        "dataset": config.dataset,
        "seeds": seeds,
        "settings": {
            "maximum_examples": config.maximum_examples,
            "steps": config.steps,
            "group_size": config.group_size,
            "learning_rate": config.learning_rate,
            "beta": config.beta,
        },
        "data_source": runs[0]["training"]["data_source"],
        "algorithms": {
            name: {
                **summaries[name],
                "runs": {
                    str(run["seed"]): {
                        "final": run["final"],
                        "relative_accuracy": run["relative_accuracy"],
                        "run_dir": str(replace(config, algorithm=name, seed=run["seed"]).run_dir),
                    }
                    for run in by_algorithm[name]
                },
            }
            for name in algorithms
        },
    }
    title = f"{config.dataset}: {config.steps} steps, K={config.group_size}, {report.seeds_tag(seeds)}"
    table = report.summary_table(summaries)
    paths.append(atomic_write_json(stem.with_suffix(".json"), payload))
    paths.append(atomic_write_text(stem.with_suffix(".md"), f"# {title}\n\n{table}\n"))
    # Step 0 is the untrained policy, so every curve starts where training did.
    histories = {
        name: [[{"step": 0.0, **run["baseline"]}, *run["history"]] for run in group]
        for name, group in by_algorithm.items()
    }
    paths.append(report.comparison_plot(stem.with_suffix(".png"), histories, title))
    return {"runs": runs, "paths": paths, "summaries": summaries, "table": table}


def check_generation_run(config, log=print, rows: list[dict] | None = None, reward_functions=(),
                         world_size: int | None = None):
    """Every check of a generation-level run that needs no torch, in the order a user would fix them:
    settings, output folder, an earlier run there, the model's source, rewards, the data.

    Returns ``(task, checkpoint to resume from or None)``. Nothing is written.
    """
    from auto_research.post_training.lm import checkpoint as checkpoints
    from auto_research.post_training.lm.models import check_model_source
    from auto_research.post_training.lm.rewards import check_rewards
    from auto_research.post_training.lm.tasks import load_task

    from auto_research.post_training.lm.distributed import check_world, environment_world_size

    config.validate()
    check_world(config)
    check_writable_directory(config.output_dir)
    checkpoints.check_run_folder(config)
    world_size = environment_world_size() if world_size is None else world_size
    resume_from = checkpoints.resumable_checkpoint(config, log, world_size) if config.resume else None
    if config.model is not None:
        check_model_source(config.model, config.offline)
    if config.reward_model is not None:
        check_model_source(config.reward_model, config.offline, "--reward-model")
    if config.critic_model is not None:
        check_model_source(config.critic_model, config.offline, "--critic-model")
    check_rewards(config.reward, config.reward_weights, config.reward_model, reward_functions)
    task = load_task(config, rows)
    if config.judge:
        from auto_research.post_training.lm.preference import load_judge

        load_judge(config.judge, task)
    return task, resume_from


def _silent(text: str) -> None:
    pass


def post_train_generation(config, log=print, rows: list[dict] | None = None, reward_functions=()) -> dict:
    """One generation-level run: input checks, train, write metrics, report and plot.

    The run folder is locked (``locks.FolderLock``) before anything in it is read, deleted or
    written, and stays locked until the run ends; under torchrun rank 0 holds the lock and every
    rank learns the outcome before any work. torch is imported only once every check that can be
    made without it has passed (one process), so a mistyped flag costs a fraction of a second,
    not torch's start-up.
    """
    from auto_research.locks import FolderLock
    from auto_research.post_training.lm import checkpoint as checkpoints
    from auto_research.post_training.lm.distributed import World, check_world

    config = config.filled()
    world = World.from_environment(config.fsdp)
    if not world.main:  # under torchrun every rank runs this; rank 0 alone speaks and writes
        log = _silent
    config.validate()
    check_world(config)
    check_writable_directory(config.output_dir)
    if world.distributed:
        from auto_research.post_training.lm.models import resolve_device

        world.start(world.device(resolve_device(config.device)))
    lock, failure = None, None
    if world.main:
        try:
            lock = FolderLock(config.run_dir).acquire()
        except UserError as error:
            failure = error
    try:
        world.agree(failure)
        task, resume_from = check_generation_run(config, log, rows, reward_functions, world.size)
        from auto_research.post_training.lm.trainer import Trainer

        memory = MemoryMeter(config.device)
        trainer = Trainer(config, log=log, task=task, resume_from=resume_from, reward_functions=reward_functions,
                          world=world, lock=lock)
        trainer.setup()
        metrics = trainer.train()
        if config.merge_lora:
            trainer.save_merged()
        # Every rank leaves the process group together, before rank 0 writes the reports (gloo aborts a
        # rank whose peer tears its connections down while it is still busy).
        world.stop()
        metrics["training"].update(memory.read())
        metrics["training"]["processes"] = world.size
        if not world.main:
            return {"runs": [metrics], "paths": [], "summary": None}
        lock.check()
        rows = report.read_jsonl(config.run_dir / "metrics.jsonl")
        try:
            paths = report.write_run(config.run_dir, metrics)
            paths.append(report.training_curves_plot(config.run_dir / "curves.png", rows, metrics))
        except OSError as error:
            raise UserError(f"cannot write the results to {config.run_dir}: {error.strerror or error}; the last "
                            f"checkpoint in {config.run_dir / 'checkpoints'} holds the trained model") from None
        return {"runs": [metrics], "paths": paths, "summary": None}
    except BaseException:
        # A run that fails before it saved anything resumable leaves no folder it created behind.
        if lock is not None and not checkpoints.checkpoint_dirs(config.run_dir):
            lock.remove_created()
        raise
    finally:
        if lock is not None:
            lock.release()
        world.stop()


def supervised(model: str | None, dataset: str, output_dir: Path, steps: int, batch_size: int, learning_rate: float,
               seed: int, dataset_dir: Path, offline: bool, chat_template: bool, device: str, overwrite: bool = False,
               threads: int | None = None, **task_options) -> dict:
    """``auto-research sft``: supervised fine-tuning of any causal LM on a dataset's demonstrations."""
    from auto_research.locks import locked
    from auto_research.post_training.config import GenerationConfig

    config = GenerationConfig(model=model, dataset=dataset, dataset_dir=dataset_dir, offline=offline, seed=seed,
                              chat_template=chat_template, device=device, threads=threads, **task_options)
    config.validate_dataset()
    config = config.filled()
    if not DEVICE_PATTERN.fullmatch(device):
        raise UserError(f"--device {device!r}: choose auto, cpu, cuda, cuda:N or mps")
    if threads is not None and threads <= 0:
        raise UserError(f"--threads must be a positive integer, got {threads}")
    check_writable_directory(output_dir)
    output_dir = Path(output_dir)
    with locked(output_dir, "sft"):
        return _supervised(model, config, task_options, output_dir, steps, batch_size, learning_rate, seed, offline,
                           chat_template, device, overwrite, threads)


def _supervised(model, config, task_options, output_dir, steps, batch_size, learning_rate, seed, offline,
                chat_template, device, overwrite, threads) -> dict:
    from auto_research.locks import entries
    from auto_research.post_training.lm.models import check_model_source
    from auto_research.post_training.lm.tasks import load_task

    if not overwrite and entries(output_dir):
        raise UserError(f"--output-dir {output_dir} is not empty; choose another folder, or --overwrite to replace "
                        "what is there")
    if model is not None:
        check_model_source(model, offline)
    task = load_task(config)

    import torch

    from auto_research.post_training.lm.evaluation import greedy_accuracy
    from auto_research.post_training.lm.models import (format_prompt, load_policy, quiet_transformers, resolve_device,
                                                       resolve_dtype)
    from auto_research.post_training.lm.sft import supervised_fine_tune
    from auto_research.post_training.lm.tiny import build_model, build_tokenizer

    quiet_transformers()
    if threads:
        torch.set_num_threads(threads)
    device_name = resolve_device(device)
    if model is None:
        tokenizer = build_tokenizer()
        policy = build_model(tokenizer, seed=seed).to(device_name)
    else:
        policy, tokenizer = load_policy(model, device_name, resolve_dtype(config.dtype, device_name), offline)
    pairs = [(format_prompt(tokenizer, example.prompt, chat_template), example.solution or example.answer)
             for example in task.demonstrations]
    # Held-out prompts go through the chat template too, as the model will see them.
    formatted = replace(task, evaluation=[replace(e, prompt=format_prompt(tokenizer, e.prompt, chat_template))
                                          for e in task.evaluation])
    history = supervised_fine_tune(
        policy, tokenizer, pairs, steps=steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed,
        evaluate=lambda: {"held_out_accuracy": greedy_accuracy(policy, tokenizer, formatted, config.max_new_tokens)},
        eval_every=max(1, steps // 4),
    )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        policy.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        atomic_write_json(output_dir / "sft.json", {"model": model or "embedded tiny (random init)", "dataset": task.name,
                                                    "demonstrations": len(pairs), "steps": steps, "history": history})
    except OSError as error:
        raise UserError(f"cannot save the model to {output_dir}: {error.strerror or error}") from None
    return {"history": history, "output_dir": output_dir}


class MemoryMeter:
    """Peak memory of the training that follows its creation.

    On CUDA: ``torch.cuda.max_memory_allocated`` (reset here). On the CPU: the
    process's peak resident memory (``ru_maxrss``) minus its resident memory
    now, right before the models are loaded; so it counts models, optimizer
    states and activations, and is a fair comparison only between runs that
    each have a process of their own (``compare`` gives them one).
    """

    def __init__(self, device: str):
        import torch

        self.cuda = torch.cuda.is_available() and device != "cpu" and not device.startswith("mps")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.before = _resident_bytes()

    def read(self) -> dict:
        import resource

        import torch

        if self.cuda:
            return {"peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
                    "peak_memory_kind": "CUDA max_memory_allocated"}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
        return {"peak_memory_mb": (peak - self.before) / 2**20,
                "peak_memory_kind": "CPU: peak resident memory of the process minus its resident memory before the "
                                    "models were loaded"}


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compare_generation(make_config, output_dir: Path, algorithms: list[str], seeds: list[int], group_sizes: list[int],
                       passthrough: list[str], log=print) -> dict:
    """The paper's comparison at the generation level: every (K, algorithm, seed) in a process of its own.

    ``make_config(algorithm, K, seed, output_dir)`` gives each run's settings; ``passthrough`` holds the
    command-line words that reproduce them. Writes ``classic-post-training-<dataset>-<seeds>.json``,
    ``.md`` and ``.png`` (held-out accuracy against samples generated; reward against KL) in ``output_dir``.
    """
    import json
    import statistics
    import subprocess
    import sys
    import time

    from auto_research.locks import check_unlocked

    output = Path(output_dir)
    # Every run's settings are checked before the first one starts.
    planned = []
    for K in group_sizes:
        for algorithm in algorithms:
            for seed in seeds:
                config = make_config(algorithm, K, seed, output / f"k{K}" if len(group_sizes) > 1 else output).filled()
                check_generation_run(config, log)
                check_unlocked(config.run_dir)
                planned.append(config)
    if planned[0].model is None:
        # Warm-start the embedded model once, here, so that no run's time or memory includes it.
        from auto_research.post_training.lm.tasks import load_task
        from auto_research.post_training.lm.tiny import ensure_warm_started

        ensure_warm_started(load_task(planned[0]), log=log)
    results: dict[tuple[int, str], list[dict]] = {}
    for index, config in enumerate(planned, start=1):
        command = [sys.executable, "-m", "auto_research", "post-train", "--algorithm", config.algorithm,
                   "--dataset", config.dataset, "--group-size", str(config.group_size), "--seed", str(config.seed),
                   "--output-dir", str(config.output_dir), "--dataset-dir", str(config.dataset_dir),
                   *(["--offline"] if config.offline else []), *passthrough]
        if "--no-progress" not in passthrough:
            command.append("--no-progress")
        started = time.perf_counter()
        log(f"run {index}/{len(planned)}: {config.algorithm}, K = {config.group_size}, seed {config.seed}")
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"compare: {config.algorithm} (K = {config.group_size}, seed {config.seed}) failed: {last}")
        metrics = json.loads((config.run_dir / "metrics.json").read_text())
        rows = report.read_jsonl(config.run_dir / "metrics.jsonl")
        metrics["step_seconds_median"] = statistics.median(row["step_seconds"] for row in rows)
        metrics["samples_per_step"] = config.prompts_per_step * config.group_size
        metrics["samples"] = metrics["samples_per_step"] * config.steps
        metrics["wall_seconds"] = time.perf_counter() - started
        metrics["run_dir"] = str(config.run_dir)
        results.setdefault((config.group_size, config.algorithm), []).append(metrics)
        log(f"  held-out accuracy {metrics['baseline']['accuracy']:.3f} -> {metrics['final']['accuracy']:.3f}, "
            f"median step {metrics['step_seconds_median']:.3f} s, peak memory "
            f"{metrics['training']['peak_memory_mb']:.1f} MB ({metrics['wall_seconds']:.0f} s)")
    return report.write_generation_comparison(output, planned[0].dataset_name, seeds, results)


# --- the RLHF pipeline: reward-model training, then RL against it ----------------------------------------


def reward_model(args) -> dict:
    """``auto-research reward-model``: preference pairs → a one-scalar reward model in --output-dir.

    Every input is checked before training; the model is written to a staging folder and renamed
    into place, so a failure leaves nothing half-written.
    """
    import math

    from auto_research.post_training.config import check_positive_finite

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--evaluation-examples", args.evaluation_examples), ("--max-length", args.max_length)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    check_positive_finite("--learning-rate", args.learning_rate)
    if not (math.isfinite(args.center_rewards_coefficient) and args.center_rewards_coefficient >= 0):
        raise UserError(f"--center-rewards-coefficient must be a finite number >= 0, got {args.center_rewards_coefficient}")
    if not DEVICE_PATTERN.fullmatch(args.device):
        raise UserError(f"--device {args.device!r}: choose auto, cpu, cuda, cuda:N or mps")
    output = Path(args.output_dir)
    check_writable_directory(output)
    from auto_research.locks import locked

    with locked(output, "reward-model"):
        return _reward_model(args, output)


def _reward_model(args, output: Path) -> dict:
    import shutil
    import sys

    from auto_research.locks import entries
    from auto_research.post_training.lm.models import check_model_source, resolve_device
    from auto_research.post_training.lm.reward_model import load_rows, preference_pairs, train_reward_model

    if entries(output) and not args.overwrite:
        raise UserError(f"{output} is not empty: choose another --output-dir, or --overwrite to replace it")
    if args.model is not None:
        check_model_source(args.model, args.offline)
    rows = load_rows(args.dataset, args.offline)
    tokenizer = _tokenizer_for(args.model, args.offline)
    prompt_field = None if args.prompt_field in (None, "", "none") else args.prompt_field
    pairs = preference_pairs(rows, args.dataset, prompt_field, args.chosen_field, args.rejected_field, args.margin_field,
                             tokenizer, log=lambda text: print(text, file=sys.stderr))
    held = args.evaluation_examples or max(1, min(500, len(pairs) // 10))
    if held >= len(pairs):
        raise UserError(f"--evaluation-examples {held}: the dataset has {len(pairs)} usable pairs, and some must be "
                        "left to train on")
    # Trained beside the earlier model (inside the locked folder), which is replaced only at the end.
    staging = output / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        metrics = train_reward_model(args.model, pairs, staging, args.steps, args.batch_size, args.learning_rate, held,
                                     args.seed, resolve_device(args.device), args.offline,
                                     args.center_rewards_coefficient, args.max_length, progress=args.progress,
                                     log=lambda text: print(text, file=sys.stderr))
        replace_contents(output, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metrics


def replace_contents(folder: Path, staging: Path) -> None:
    """The locked ``folder``'s contents replaced by ``staging``'s (a folder inside it), then ``staging`` removed."""
    import os
    import shutil

    from auto_research.locks import entries

    for path in entries(folder):
        if path != staging:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for path in staging.iterdir():
        os.replace(path, folder / path.name)
    staging.rmdir()


def _tokenizer_for(model: str | None, offline: bool):
    if model is None:
        from auto_research.post_training.lm.tiny import build_tokenizer

        return build_tokenizer()
    from pathlib import Path as _Path

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, local_files_only=offline or _Path(model).expanduser().exists())


RLHF_OUTPUTS = ("preferences.jsonl", "reward-model", "runs", "rlhf-summary.json", "rlhf-summary.md", "rlhf.png")


def rlhf(args, log=print) -> dict:
    """``auto-research rlhf``: warm start → sample and label pairs → reward model → RL (every
    algorithm × β × seed, each in its own process) against it → gold win rate, and the proxy and
    gold rewards against the KL."""
    import math

    from auto_research.post_training.config import ALGORITHMS

    algorithms = [name.strip() for name in args.algorithms.split(",") if name.strip()]
    unknown = [name for name in algorithms if name not in ALGORITHMS]
    if not algorithms or unknown:
        raise UserError(f"--algorithms {args.algorithms!r}: choose from {', '.join(ALGORITHMS)}")
    try:
        betas = [float(value) for value in args.betas.split(",")]
        seeds = [int(value) for value in args.seeds.split(",")]
    except ValueError:
        raise UserError("--betas takes numbers such as 0.01,0.05 and --seeds integers such as 42,43") from None
    if any(not (math.isfinite(b) and b >= 0) for b in betas):
        raise UserError(f"--betas must be finite numbers >= 0, got {args.betas}")
    for flag, value in (("--pairs", args.pairs), ("--reward-model-steps", args.reward_model_steps),
                        ("--steps", args.steps), ("--eval-every", args.eval_every)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if args.group_size < 2:
        raise UserError(f"--group-size {args.group_size}: K >= 2")
    output = Path(args.output_dir)
    check_writable_directory(output)
    from auto_research.locks import locked

    with locked(output, "rlhf pipeline"):
        return _rlhf(args, output, algorithms, betas, seeds, log)


def _rlhf(args, output: Path, algorithms, betas, seeds, log) -> dict:
    import json
    import shutil
    import subprocess
    import sys
    import time

    found = [name for name in RLHF_OUTPUTS if (output / name).exists()]
    if found and not args.overwrite:
        raise UserError(f"{output} holds an earlier pipeline ({', '.join(found)}): --overwrite replaces it")
    for name in found:
        target = output / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    started = time.perf_counter()
    from auto_research.post_training.lm import preference
    from auto_research.post_training.lm.reward_model import preference_pairs, train_reward_model
    from auto_research.post_training.lm.tasks import preference_task
    from auto_research.post_training.lm.tiny import build_tokenizer, ensure_warm_started

    dataset = "preference-generate" if args.gold == "length" else "preference-arithmetic"
    task = preference_task(dataset)
    if args.model is not None:
        from auto_research.post_training.lm.models import check_model_source

        check_model_source(args.model, True)
        warm = Path(args.model)
    else:
        warm = ensure_warm_started(task, progress=args.progress, log=log)
    stages = {"warm_start": time.perf_counter() - started}
    log(f"[1/3] sampling and labelling {args.pairs} preference pairs from the warm-started policy")
    label_stats = preference.make_preferences(warm, task, output / "preferences.jsonl", args.pairs, seed=0,
                                              temperature=preference.PAIR_TEMPERATURE, max_new_tokens=6, log=log)
    rows = [json.loads(line) for line in (output / "preferences.jsonl").read_text().splitlines()]
    pairs = preference_pairs(rows, "preferences.jsonl", "prompt", "chosen", "rejected", None, build_tokenizer(), log)
    held = max(1, min(500, len(pairs) // 10))
    stages["pairs"] = time.perf_counter() - started - sum(stages.values())
    log(f"[2/3] training the proxy reward model on {len(pairs) - held} pairs ({held} held out)")
    reward_metrics = train_reward_model(str(warm), pairs, output / "reward-model", args.reward_model_steps, 64, 1e-3,
                                        held, 0, "cpu", True, progress=args.progress, log=log)
    held_rows = [rows[i] for i in reward_metrics.pop("evaluation_indices")]
    reward_metrics["gold_order_accuracy"] = preference.gold_accuracy_of_reward_model(output / "reward-model", held_rows)
    reward_metrics["label_agreement"] = label_stats["label_agreement"]
    reward_metrics["label_ceiling"] = label_stats["label_ceiling"]
    atomic_write_json(output / "reward-model" / "metrics.json", reward_metrics)
    log(f"      held-out pairwise accuracy {reward_metrics['pairwise_accuracy']:.3f} against the noisy labels "
        f"(their own agreement with the gold order: {label_stats['label_agreement']:.3f}, expected "
        f"{label_stats['label_ceiling']:.3f}); {reward_metrics['gold_order_accuracy']:.3f} against the gold order")
    runs_dir = output / "runs"
    stages["reward_model"] = time.perf_counter() - started - sum(stages.values())
    stages["runs"] = []
    results = []
    combinations = [(a, b, s) for a in algorithms for b in betas for s in seeds]
    for index, (algorithm, beta, seed) in enumerate(combinations, 1):
        log(f"[3/3] RL against the proxy ({index}/{len(combinations)}): {algorithm}, β = {beta}, seed {seed}")
        folder = runs_dir / f"beta-{beta:g}"
        command = [sys.executable, "-m", "auto_research", "post-train", "--dataset", dataset,
                   "--reward-model", str(output / "reward-model"), "--judge", "gold", "--algorithm", algorithm,
                   "--beta", str(beta), "--seed", str(seed), "--group-size", str(args.group_size), "--offline",
                   "--output-dir", str(folder), "--device", "cpu",
                   *(["--model", str(args.model)] if args.model else []),
                   *(["--steps", str(args.steps)] if args.steps else []),
                   *(["--eval-every", str(args.eval_every)] if args.eval_every else []),
                   *([] if args.progress else ["--no-progress"])]
        run_started = time.perf_counter()
        finished = subprocess.run(command, stdout=subprocess.DEVNULL)
        stages["runs"].append(time.perf_counter() - run_started)
        if finished.returncode:
            raise UserError(f"the {algorithm} run (β = {beta}, seed {seed}) failed with status {finished.returncode}; "
                            f"its command: {' '.join(command[1:])}")
        metrics = json.loads((folder / f"{algorithm}-{dataset}-seed{seed}" / "metrics.json").read_text())
        results.append({"algorithm": algorithm, "beta": beta, "seed": seed, "metrics": metrics})
    seconds = time.perf_counter() - started
    summary = {"dataset": dataset, "seconds": seconds, "stage_seconds": stages, "labels": label_stats,
               "reward_model": {key: value for key, value in reward_metrics.items() if key != "history"},
               "runs": [{"algorithm": r["algorithm"], "beta": r["beta"], "seed": r["seed"],
                         "win_rate": r["metrics"]["final"].get("win_rate"),
                         "gold_reward": [r["metrics"]["baseline"].get("gold_reward"), r["metrics"]["final"].get("gold_reward")],
                         "proxy_reward": [r["metrics"]["baseline"].get("mean_reward"), r["metrics"]["final"].get("mean_reward")],
                         "accuracy": [r["metrics"]["baseline"]["accuracy"], r["metrics"]["final"]["accuracy"]],
                         "kl": r["metrics"]["final"]["kl_from_reference"],
                         "history": [{"step": 0.0, **r["metrics"]["baseline"]}, *r["metrics"]["history"]]}
                        for r in results]}
    atomic_write_json(output / "rlhf-summary.json", summary)
    table = report.rlhf_table(summary)
    atomic_write_text(output / "rlhf-summary.md", table + "\n")
    plot = report.over_optimisation_plot(output / "rlhf.png", summary)
    return {"summary": summary, "table": table,
            "paths": [output / "rlhf-summary.json", output / "rlhf-summary.md", plot, output / "reward-model"]}
