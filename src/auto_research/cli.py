"""The ``auto-research`` command line: parse, validate, call, print.

No training logic lives here, and nothing heavy is imported at module level so
that ``auto-research --help`` stays fast and candidate-level runs never import
torch or transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from auto_research.errors import TrainingInterrupted, UserError
from auto_research.post_training.config import (ALGORITHMS, CANDIDATE_DATASETS, DATASETS, GENERATION_DATASETS,
                                                SECTIONS, CandidateConfig, GenerationConfig, is_generation_dataset)

# Candidate-level defaults of the flags both levels share, read from the dataclass (written once there).
CANDIDATE_DEFAULTS = {name: CandidateConfig.__dataclass_fields__[name].default
                      for name in ("steps", "learning_rate", "beta", "maximum_examples")}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def _seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        try:
            seeds.append(int(part.strip()))
        except ValueError:
            raise UserError(f"--seeds takes comma-separated integers such as 42,43,44; got {part.strip()!r}") from None
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds lists a seed twice: {text}")
    return seeds


def _add_run_flags(parser: argparse.ArgumentParser, datasets: str, several_group_sizes: bool = False) -> None:
    parser.add_argument("--dataset", default="arithmetic-smoke", help=f"{datasets} (default: %(default)s)")
    parser.add_argument("--maximum-examples", type=int, default=None,
                        help="N train problems or prompts (default: 512 candidate level, all at the generation level)")
    parser.add_argument("--steps", type=int, default=None, help="policy updates (default: 100 candidate level, per dataset at the generation level)")
    if several_group_sizes:
        parser.add_argument("--group-size", default="4", help="K samples per prompt; several, e.g. 2,4, at the "
                                                              "generation level (default: %(default)s)")
    else:
        parser.add_argument("--group-size", type=int, default=4, help="K samples per prompt (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=None, help="step size (default: 0.08 candidate level, per dataset at the generation level)")
    parser.add_argument("--beta", type=float, default=None, help="β, weight of the KL penalty (default: 0.02 candidate level, 0.05 generation level)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: %(default)s)")
    parser.add_argument("--dataset-dir", type=Path, default=None, help="folder holding gsm8k/{train,test}.jsonl (default: $AUTO_RESEARCH_DATA, else data)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/post-training"), help="where run directories go (default: %(default)s)")
    parser.add_argument("--offline", action="store_true", help="never download; missing data or models are an error")


GENERATION_FLAGS = {}
GENERATION_ACTIONS = {}


def generation_argv(args: argparse.Namespace) -> list[str]:
    """The generation-level flags the user gave, written back as command-line words (compare passes them on)."""
    words = []
    for dest, action in GENERATION_ACTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            words.append(action.option_strings[0])
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                words += [action.option_strings[0], str(item)]
        else:
            text = ",".join(str(item) for item in value) if isinstance(value, (list, tuple)) else str(value)
            words += [action.option_strings[0], text]
    return words


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per sectioned field of GenerationConfig: its name, help and default come from the dataclass.

    Every flag defaults to None (given or not is what matters: an unset one takes the
    dataset's preset, and a candidate-level run refuses any that was given).
    """
    from dataclasses import MISSING, fields

    groups = {key: parser.add_argument_group(f"generation level: {title}") for key, title in SECTIONS.items()}
    for item in fields(GenerationConfig):
        meta = item.metadata
        if not meta.get("section"):
            continue
        options = dict(meta["options"])
        names = [meta["flag"] or "--" + item.name.replace("_", "-"), *options.pop("aliases", ())]
        default = item.default if item.default is not MISSING else None
        help_text = meta["help"]
        if "(default:" not in help_text and default is not None and options.get("action") not in ("store_true", "store_false"):
            help_text += f" (default: {default})"
        if options.get("action") not in ("store_true", "store_false"):
            options.setdefault("metavar", names[0].lstrip("-").upper().replace("-", "_"))
        action = groups[meta["section"]].add_argument(*names, dest=item.name, default=None, help=help_text, **options)
        GENERATION_FLAGS[item.name] = names[0]
        GENERATION_ACTIONS[item.name] = action


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="auto-research",
        description="RL post-training of language models, centred on RLOO (Ahmadian et al., 2024).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = commands.add_parser("post-train", help="train a policy with one algorithm and report before/after")
    train.add_argument("--algorithm", default="rloo", help=f"one of {', '.join(ALGORITHMS)} (default: %(default)s)")
    _add_run_flags(train, f"{', '.join(DATASETS)}, or a .jsonl file")
    train.add_argument("--seeds", default=None, help="several runs, e.g. 42,43,44: a run directory each and a mean ± std summary (candidate level)")
    _add_generation_flags(train)

    compare = commands.add_parser("compare", help="run several algorithms on identical data and settings")
    compare.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default: all)")
    _add_run_flags(compare, f"{', '.join(DATASETS)}, or a .jsonl file (generation level: each run in its own "
                            "process, with its time and memory)", several_group_sizes=True)
    compare.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")
    _add_generation_flags(compare)

    sft = commands.add_parser("sft", help="supervised fine-tuning of a causal LM on a dataset's demonstrations")
    sft.add_argument("--model", default=None, help="folder or hub id (default: a fresh embedded tiny model)")
    sft.add_argument("--dataset", default="arithmetic-generate",
                     help=f"{', '.join(GENERATION_DATASETS)} or a .jsonl file (default: %(default)s)")
    sft.add_argument("--prompt-field", default=None, help="prompt field of a .jsonl dataset (default: prompt)")
    sft.add_argument("--answer-field", default=None, help="field of a .jsonl dataset trained on as the completion (default: answer)")
    sft.add_argument("--steps", type=int, default=1000, help="optimizer steps (default: %(default)s)")
    sft.add_argument("--batch-size", type=int, default=64, help="demonstrations per step (default: %(default)s)")
    sft.add_argument("--learning-rate", type=float, default=2e-3, help="AdamW step size (default: %(default)s)")
    sft.add_argument("--seed", type=int, default=0, help="random seed: initialisation and batch order (default: %(default)s)")
    sft.add_argument("--dataset-dir", type=Path, default=None, help="folder holding gsm8k/ (default: $AUTO_RESEARCH_DATA, else data)")
    sft.add_argument("--output-dir", type=Path, required=True, help="where the fine-tuned model is saved")
    sft.add_argument("--overwrite", action="store_true", help="replace a model already saved in --output-dir")
    sft.add_argument("--device", default="auto", help="auto (default: CUDA when present), cpu, cuda, cuda:N or mps")
    sft.add_argument("--threads", type=int, default=None, help="CPU threads torch may use (default: one per core)")
    sft.add_argument("--no-chat-template", dest="chat_template", action="store_false", help="send prompts as plain text")
    sft.add_argument("--offline", action="store_true", help="never download; a hub id is an error")

    reward = commands.add_parser("reward-model", help="train a reward model (one scalar head) on preference pairs, "
                                 "Bradley–Terry")
    reward.add_argument("--model", default=None, help="causal LM folder or hub id to put the head on (default: a fresh "
                        "embedded tiny model)")
    reward.add_argument("--dataset", required=True, help="preference pairs: .jsonl, .json, .parquet, .csv, a "
                        "save_to_disk folder, or a hub name (online)")
    reward.add_argument("--prompt-field", default="prompt", help="(default: %(default)s; 'none': the prompt is inside "
                        "chosen and rejected)")
    reward.add_argument("--chosen-field", default="chosen", help="(default: %(default)s)")
    reward.add_argument("--rejected-field", default="rejected", help="(default: %(default)s)")
    reward.add_argument("--margin-field", default=None, help="a per-pair margin m in −log σ(r_w − r_l − m) (default: none)")
    reward.add_argument("--center-rewards-coefficient", type=float, default=0.0,
                        help="weight of (r_w + r_l)², keeping rewards near 0 (default: %(default)s)")
    reward.add_argument("--steps", type=int, default=400, help="optimizer steps (default: %(default)s)")
    reward.add_argument("--batch-size", type=int, default=32, help="pairs per step (default: %(default)s)")
    reward.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW step size (default: %(default)s)")
    reward.add_argument("--max-length", type=int, default=None, help="truncate prompt + response to N tokens")
    reward.add_argument("--evaluation-examples", type=int, default=None,
                        help="held-out pairs (default: min(500, pairs // 10), at least 1)")
    reward.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    reward.add_argument("--output-dir", type=Path, required=True, help="where the reward model is saved")
    reward.add_argument("--overwrite", action="store_true", help="replace a model already saved in --output-dir")
    reward.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N or mps")
    reward.add_argument("--offline", action="store_true", help="never download")
    reward.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")

    rlhf = commands.add_parser("rlhf", help="the whole RLHF pipeline on preference-generate: sample and label pairs, "
                               "train the reward model, RL against it, judge by win rate")
    rlhf.add_argument("--model", default=None, help="starting policy and reward-model backbone (default: the embedded "
                      "tiny model, warm-started on arithmetic)")
    rlhf.add_argument("--gold", choices=["length", "arithmetic"], default="length",
                      help="the hidden gold scorer: length (preference-generate: 4-character answers) or arithmetic "
                      "(preference-arithmetic: partial credit for the sum, which fools a tiny proxy; over-optimisation "
                      "shows) (default: %(default)s)")
    rlhf.add_argument("--algorithms", default="rloo", help="comma-separated (default: %(default)s)")
    rlhf.add_argument("--betas", default="0.05", help="comma-separated β values: a sweep (default: %(default)s)")
    rlhf.add_argument("--seeds", default="42", help="comma-separated (default: %(default)s)")
    rlhf.add_argument("--group-size", type=int, default=4, help="K (default: %(default)s)")
    rlhf.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the dataset's, 300)")
    rlhf.add_argument("--pairs", type=int, default=3000, help="preference pairs to label (default: %(default)s)")
    rlhf.add_argument("--reward-model-steps", type=int, default=400, help="(default: %(default)s)")
    rlhf.add_argument("--eval-every", type=int, default=None, help="evaluations for the KL curves (default: 50)")
    rlhf.add_argument("--output-dir", type=Path, default=Path("runs/rlhf"), help="(default: %(default)s)")
    rlhf.add_argument("--overwrite", action="store_true", help="start afresh over an earlier pipeline in --output-dir")
    rlhf.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")

    data = commands.add_parser("data", help="download a dataset into --dataset-dir")
    data.add_argument("name", help="gsm8k")
    data.add_argument("--dataset-dir", type=Path, default=None, help="(default: $AUTO_RESEARCH_DATA, else data)")
    data.add_argument("--base-url", default=None, help="mirror of the official files (default: OpenAI's repository)")
    return parser


def _version() -> str:
    from auto_research import __version__

    return __version__


def _config(args: argparse.Namespace, algorithm: str):
    from auto_research.post_training.config import check_candidate_dataset
    from auto_research.post_training.datasets import default_dataset_dir

    check_candidate_dataset(args.dataset)
    given = [flag for dest, flag in GENERATION_FLAGS.items() if getattr(args, dest, None) is not None]
    if given:
        raise UserError(f"{given[0]} applies to the generation level only (arithmetic-generate, gsm8k-generate, .jsonl); "
                        f"{args.dataset} is a candidate-level dataset")
    return CandidateConfig(
        algorithm=algorithm,
        dataset=args.dataset,
        maximum_examples=_or(args.maximum_examples, CANDIDATE_DEFAULTS["maximum_examples"]),
        steps=_or(args.steps, CANDIDATE_DEFAULTS["steps"]),
        group_size=args.group_size,
        learning_rate=_or(args.learning_rate, CANDIDATE_DEFAULTS["learning_rate"]),
        beta=_or(args.beta, CANDIDATE_DEFAULTS["beta"]),
        seed=args.seed,
        dataset_dir=args.dataset_dir or default_dataset_dir(),
        output_dir=args.output_dir,
        offline=args.offline,
    ).validate()


def _or(value, default):
    return default if value is None else value


def _generation_config(args: argparse.Namespace):
    from auto_research.post_training.datasets import default_dataset_dir

    if args.seeds:
        raise UserError("--seeds runs several seeds at the candidate level only; at the generation level run one --seed per command")
    settings = {dest: getattr(args, dest) for dest in GENERATION_FLAGS if getattr(args, dest) is not None}
    for name in ("steps", "learning_rate", "beta", "maximum_examples"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    return GenerationConfig(
        algorithm=args.algorithm,
        dataset=args.dataset,
        group_size=args.group_size,
        seed=args.seed,
        dataset_dir=args.dataset_dir or default_dataset_dir(),
        output_dir=args.output_dir,
        offline=args.offline,
        **settings,
    )


def _post_train(args: argparse.Namespace) -> int:
    from auto_research.post_training import report, runs

    if is_generation_dataset(args.dataset):
        from auto_research.post_training.lm.distributed import environment_rank

        result = runs.post_train_generation(_generation_config(args), log=lambda text: print(text, file=sys.stderr))
        if environment_rank() != 0:  # under torchrun, rank 0 reports
            return 0
    else:
        seeds = _seeds(args.seeds) if args.seeds else None
        result = runs.post_train(_config(args, args.algorithm), seeds)
    for metrics in result["runs"]:
        training = metrics["training"]
        print(
            f"{metrics['algorithm']} on {metrics['dataset']}: seed {metrics['seed']}, {training['steps']} steps, "
            f"K={training['group_size']}, {training['train_examples']} train / "
            f"{training['validation_examples']} validation problems"
        )
        if metrics.get("model"):
            print(f"model: {metrics['model']}")
        print(report.console_table(metrics))
        print()
    if result["summary"] is not None:
        print(report.summary_table({args.algorithm: result["summary"]}))
        print()
    for path in result["paths"]:
        print(f"wrote {path}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from auto_research.post_training import runs

    algorithms = [name.strip() for name in args.algorithms.split(",") if name.strip()]
    if not algorithms:
        raise UserError("--algorithms is empty; give a comma-separated list such as rloo,grpo")
    if len(set(algorithms)) != len(algorithms):
        raise UserError(f"--algorithms lists an algorithm twice: {args.algorithms}")
    seeds = _seeds(args.seeds) if args.seeds else [args.seed]
    group_sizes = _group_sizes(args.group_size)
    if is_generation_dataset(args.dataset):
        def make_config(algorithm, group_size, seed, output_dir):
            run = argparse.Namespace(**{**vars(args), "algorithm": algorithm, "group_size": group_size, "seed": seed,
                                        "output_dir": output_dir, "seeds": None})
            return _generation_config(run)

        # The run-wide flags go to every run as given; algorithm, K and seed are set per run.
        passthrough = generation_argv(args) + [word for name in ("steps", "learning_rate", "beta", "maximum_examples")
                                               if getattr(args, name) is not None
                                               for word in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
        result = runs.compare_generation(make_config, args.output_dir, algorithms, seeds, group_sizes, passthrough,
                                         log=lambda text: print(text, file=sys.stderr, flush=True))
        print(result["table"])
        print()
        for path in result["paths"]:
            print(f"wrote {path}")
        return 0
    if len(group_sizes) > 1:
        raise UserError("several --group-size values are for the generation level; the candidate level takes one")
    args.group_size = group_sizes[0]
    for name in algorithms:
        _config(args, name)
    result = runs.compare(_config(args, algorithms[0]), algorithms, seeds)
    print(result["table"])
    print()
    for path in result["paths"][-3:]:
        print(f"wrote {path}")
    print(f"and {len(result['paths']) - 3} files in per-run directories under {args.output_dir}")
    return 0


def _group_sizes(text) -> list[int]:
    try:
        sizes = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise UserError(f"--group-size takes an integer, or several such as 2,4; got {text!r}") from None
    if len(set(sizes)) != len(sizes):
        raise UserError(f"--group-size lists a value twice: {text}")
    return sizes


def _data(args: argparse.Namespace) -> int:
    from auto_research.post_training.datasets import default_dataset_dir, ensure_gsm8k, gsm8k_dir

    if args.name != "gsm8k":
        raise UserError(f"unknown dataset {args.name!r} for 'data'; choose one of: gsm8k")
    dataset_dir = args.dataset_dir or default_dataset_dir()
    directory = gsm8k_dir(dataset_dir)
    already = all((directory / name).is_file() for name in ("train.jsonl", "test.jsonl"))
    ensure_gsm8k(dataset_dir, offline=False, base_url=args.base_url)
    print(f"GSM8K {'already present' if already else 'downloaded'} in {directory}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from auto_research.post_training import runs
    from auto_research.post_training.config import check_positive_finite
    from auto_research.post_training.datasets import default_dataset_dir

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    check_positive_finite("--learning-rate", args.learning_rate)
    result = runs.supervised(args.model, args.dataset, args.output_dir, args.steps, args.batch_size, args.learning_rate,
                             args.seed, args.dataset_dir or default_dataset_dir(), args.offline, args.chat_template,
                             args.device, overwrite=args.overwrite, threads=args.threads,
                             prompt_field=args.prompt_field, answer_field=args.answer_field)
    for row in result["history"]:
        print(f"step {row['step']:>6}  loss {row['loss']:.4f}  held-out accuracy {row['held_out_accuracy']:.3f}")
    print(f"wrote {result['output_dir']}")
    return 0


def _reward_model(args: argparse.Namespace) -> int:
    from auto_research.post_training import runs

    metrics = runs.reward_model(args)
    print(f"reward model on {metrics['train_pairs']} pairs ({metrics['evaluation_pairs']} held out): held-out pairwise "
          f"accuracy {metrics['pairwise_accuracy']:.3f}, mean reward gap {metrics['reward_gap']:.3f}")
    print(f"wrote {args.output_dir} (use it as --reward-model {args.output_dir}), metrics.json and calibration.png")
    return 0


def _rlhf(args: argparse.Namespace) -> int:
    from auto_research.post_training import runs

    result = runs.rlhf(args, log=lambda text: print(text, file=sys.stderr, flush=True))
    print(result["table"])
    for path in result["paths"]:
        print(f"wrote {path}")
    return 0


COMMANDS = {"post-train": _post_train, "compare": _compare, "sft": _sft, "reward-model": _reward_model, "rlhf": _rlhf,
            "data": _data}


def main(argv: list[str] | None = None) -> int:
    status = _main(argv)
    if os.environ.get("WORLD_SIZE", "1") not in ("", "0", "1") and argv is None:
        # A torchrun rank ends here without Python's finalization: there, a gloo run-loop thread that
        # is still releasing the last collective's buffers needs the GIL, cannot have it, and aborts the
        # process ("terminate called without an active exception", exit -6) after all its work was done.
        # Everything is written and closed by now; only the standard streams need flushing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return COMMANDS[args.command](args)
    except UserError as error:
        # Under torchrun, the rank that failed says why; the others stop with the same status, silently.
        if not getattr(error, "quiet", False):
            print(f"auto-research: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("auto-research: interrupted", file=sys.stderr)
        return 130
    except TrainingInterrupted as interrupted:
        print(f"auto-research: {interrupted}", file=sys.stderr)
        return interrupted.exit_status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
