"""The ``auto-research`` command line: parse, validate, call, print.

No training logic lives here, and nothing heavy is imported at module level so
that ``auto-research --help`` stays fast and candidate-level runs never import
torch or transformers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from auto_research.errors import UserError

ALGORITHMS = ("rloo", "ppo-rlhf", "grpo", "remax", "reinforce", "vanilla-pg", "raft")
DATASETS = ("arithmetic-smoke", "gsm8k-candidate")


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


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="arithmetic-smoke", help=f"one of {', '.join(DATASETS)} (default: %(default)s)")
    parser.add_argument("--maximum-examples", type=int, default=512, help="N train problems; validation uses max(32, N//4) (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=100, help="policy updates (default: %(default)s)")
    parser.add_argument("--group-size", type=int, default=4, help="K samples per prompt (default: %(default)s)")
    parser.add_argument("--learning-rate", type=float, default=0.08, help="step size (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=0.02, help="β, weight of the KL penalty (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: %(default)s)")
    parser.add_argument("--dataset-dir", type=Path, default=None, help="folder holding gsm8k/{train,test}.jsonl (default: $AUTO_RESEARCH_DATA, else data)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/post-training"), help="where run directories go (default: %(default)s)")
    parser.add_argument("--offline", action="store_true", help="never download; missing data is an error")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="auto-research",
        description="RL post-training of language models, centred on RLOO (Ahmadian et al., 2024).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = commands.add_parser("post-train", help="train a policy with one algorithm and report before/after")
    train.add_argument("--algorithm", default="rloo", help=f"one of {', '.join(ALGORITHMS)} (default: %(default)s)")
    _add_run_flags(train)
    train.add_argument("--seeds", default=None, help="several runs, e.g. 42,43,44: a run directory each and a mean ± std summary")

    compare = commands.add_parser("compare", help="run several algorithms on identical data and settings")
    compare.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated (default: all)")
    _add_run_flags(compare)
    compare.add_argument("--seeds", default=None, help="comma-separated seeds (default: --seed)")

    data = commands.add_parser("data", help="download a dataset into --dataset-dir")
    data.add_argument("name", help="gsm8k")
    data.add_argument("--dataset-dir", type=Path, default=None, help="(default: $AUTO_RESEARCH_DATA, else data)")
    data.add_argument("--base-url", default=None, help="mirror of the official files (default: OpenAI's repository)")
    return parser


def _version() -> str:
    from auto_research import __version__

    return __version__


def _config(args: argparse.Namespace, algorithm: str):
    from auto_research.post_training.config import CandidateConfig
    from auto_research.post_training.datasets import default_dataset_dir

    return CandidateConfig(
        algorithm=algorithm,
        dataset=args.dataset,
        maximum_examples=args.maximum_examples,
        steps=args.steps,
        group_size=args.group_size,
        learning_rate=args.learning_rate,
        beta=args.beta,
        seed=args.seed,
        dataset_dir=args.dataset_dir or default_dataset_dir(),
        output_dir=args.output_dir,
        offline=args.offline,
    ).validate()


def _post_train(args: argparse.Namespace) -> int:
    from auto_research.post_training import report, runs

    seeds = _seeds(args.seeds) if args.seeds else None
    config = _config(args, args.algorithm)
    result = runs.post_train(config, seeds)
    for metrics in result["runs"]:
        training = metrics["training"]
        print(
            f"{metrics['algorithm']} on {metrics['dataset']}: seed {metrics['seed']}, {training['steps']} steps, "
            f"K={training['group_size']}, {training['train_examples']} train / "
            f"{training['validation_examples']} validation problems"
        )
        print(report.console_table(metrics))
        print()
    if result["summary"] is not None:
        print(report.summary_table({config.algorithm: result["summary"]}))
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
    for name in algorithms:
        _config(args, name)
    result = runs.compare(_config(args, algorithms[0]), algorithms, seeds)
    print(result["table"])
    print()
    for path in result["paths"][-3:]:
        print(f"wrote {path}")
    print(f"and {len(result['paths']) - 3} files in per-run directories under {args.output_dir}")
    return 0


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


COMMANDS = {"post-train": _post_train, "compare": _compare, "data": _data}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return COMMANDS[args.command](args)
    except UserError as error:
        print(f"auto-research: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("auto-research: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
