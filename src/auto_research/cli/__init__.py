"""The ``auto-research`` command line: parse, build a config, call a recipe, print. Nothing heavy is imported at
module level, so ``--help`` stays fast and candidate-level runs never import torch or transformers.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple

from auto_research import __version__
from auto_research.algorithms.registry import REGISTRY
from auto_research.cli import commands
from auto_research.cli.flags import Parser, add_config_flag, add_flags, add_trl_flags, refuse_flag
from auto_research.config.candidate import CandidateConfig
from auto_research.config.fields import DATASETS
from auto_research.config.generation import GenerationConfig
from auto_research.config.options import CompareOptions, PostTrainOptions
from auto_research.errors import TrainingInterrupted, UserError
from auto_research.user_code import call_registrations

ALGORITHMS = tuple(REGISTRY)
LEVELS = {"candidate level": CandidateConfig}


def _run_flags(options, exclude=()):
    """post-train's and compare's flags: a run's settings (less ``exclude``), ``options``, then TRL's names."""
    def add(parser) -> None:
        add_flags(parser, GenerationConfig, exclude=exclude, grouped=True, levels=LEVELS,
                  defaults={"dataset": "arithmetic-smoke"})
        add_flags(parser, options)
        add_trl_flags(parser)

    return add


def _recipe(name: str):
    def add(parser) -> None:
        # Only the command that runs builds its flags, so the others' settings are not even imported.
        from auto_research.config import recipes

        add_flags(parser, getattr(recipes, name))

    return add


def _serve(parser) -> None:
    _recipe("ServeConfig")(parser)
    refuse_flag(parser, "--api-key", "--api-key is refused: the process list shows a flag's value to every user of "
                                     "this machine; put the key in a file only you can read (chmod 600) and give "
                                     "--api-key-file FILE, or set AUTO_RESEARCH_API_KEY")


class Subcommand(NamedTuple):
    help: str
    flags: Callable  # adds the command's flags to its parser
    run: Callable  # the parsed arguments → the exit status (cli/commands.py)


SUBCOMMANDS = {
    "post-train": Subcommand("train a policy with one algorithm and report before/after",
                             _run_flags(PostTrainOptions), commands.post_train),
    "compare": Subcommand("run several algorithms on identical data and settings (generation level: each run in its "
                          "own process, with its time and memory)",
                          _run_flags(CompareOptions, exclude=("algorithm", "group_size")), commands.compare),
    "sft": Subcommand("supervised fine-tuning of a causal LM on a dataset's demonstrations", _recipe("SFTConfig"),
                      commands.sft),
    "reward-model": Subcommand("train a reward model (one scalar head) on preference pairs, Bradley–Terry",
                               _recipe("RewardModelConfig"), commands.reward_model),
    "rlhf": Subcommand("the whole RLHF pipeline on preference-generate: sample and label pairs, train the reward "
                       "model, RL against it, judge by win rate", _recipe("RLHFConfig"), commands.rlhf),
    "data": Subcommand("download a dataset into --dataset-dir", _recipe("DataConfig"), commands.data),
    "rollout-serve": Subcommand("serve one rollout engine (vLLM, or --engine builtin) over HTTP for post-train "
                                "--rollout-mode server", _serve, commands.rollout_serve),
    "vllm-serve": Subcommand("the same as rollout-serve (its first name)", _serve, commands.rollout_serve),
}


def build_parser(command: str | None = None) -> Parser:
    """The parser, with the flags of ``command`` (of every subcommand when None)."""
    parser = Parser(prog="auto-research",
                    description="RL post-training of language models, centred on RLOO (Ahmadian et al., 2024).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, subcommand in SUBCOMMANDS.items():
        subparser = subcommands.add_parser(name, help=subcommand.help)
        if command in (None, name):
            subcommand.flags(subparser)
            if name != "data":
                add_config_flag(subparser)
    return parser


def _main(argv: list[str] | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((word for word in words if word in SUBCOMMANDS), None))
    try:
        call_registrations()  # the user's own engines (AUTO_RESEARCH_ENGINES), before any setting is checked
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return SUBCOMMANDS[args.command].run(args)
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


__all__ = ["ALGORITHMS", "DATASETS", "build_parser", "main"]
