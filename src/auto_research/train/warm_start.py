"""The embedded tiny model's warm start: supervised fine-tuning on a task's demonstrations.

arithmetic-generate's warm-started model ships in the package (``train/shipped/``) so that every machine starts from
the same weights: the recipe's outcome depends on the CPU's rounding (docs/benchmarks.md, "The same starting point
everywhere"; ``benchmarks/warm_start.py --ship`` rebuilds it). Other tasks are warm-started once into the cache, in a
folder named by the recipe version so that a changed recipe never reuses a stale model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from auto_research.engine.machine import machine_record
from auto_research.engine.models import quiet_transformers
from auto_research.engine.packaged import cache_dir, materialise
from auto_research.engine.tiny import TINY_ARCHITECTURE, build_model, build_tokenizer
from auto_research.files import atomic_write_json, make_tree_shareable
from auto_research.train.evaluation import greedy_accuracy
from auto_research.train.sft import supervised_fine_tune

RECIPE_VERSION = 5

# Warm start (recipe v5): the first 300 of the task's 350 demonstrations, each seen about 190 times. On 300 the
# held-out accuracy levels off near 0.7 (0.65, 0.71, 0.71 at steps 600, 750, 900), where SFT continued adds
# little and RL on fresh prompts adds much: the first run shows what RL does. (v4 used all 350 for 1500 steps
# and started RL at 0.886, leaving it +7 points to show; on 260 or fewer, SFT generalises to under 0.1.)
# benchmarks/arithmetic_generate.py measures both against each other.
WARM_START = dict(demonstrations=300, steps=900, batch_size=64, learning_rate=2e-3, warmup_steps=20, seed=2)


def demonstrations(task) -> list:
    """The demonstrations the warm start trains on (and SFT continued, the control, too)."""
    return task.demonstrations[: WARM_START["demonstrations"]]


SHIPPED = Path(__file__).resolve().parent / "shipped"
"""The warm-started models the package ships, one folder each, named as the cache's are."""


def folder_name(task_name: str) -> str:
    return f"{task_name}-qwen2-tiny-v{RECIPE_VERSION}"


def shipped_path(task_name: str) -> Path | None:
    folder = SHIPPED / folder_name(task_name)
    return folder if (folder / "warm-start.json").is_file() else None


def warm_started_path(task_name: str) -> Path:
    return shipped_path(task_name) or cache_dir() / folder_name(task_name)


def ensure_warm_started(task, progress: bool = True, log=print) -> Path:
    """The warm-started tiny model for ``task``: the packaged one, else the cache's (trained first if missing)."""
    target = warm_started_path(task.base or task.name)
    if (target / "warm-start.json").is_file():
        return target
    build_warm_start(task, target, progress, log)
    return target


def build_warm_start(task, target: Path, progress: bool = True, log=print) -> dict:
    """Warm-start the tiny model on ``task`` into ``target`` (atomically: another process's is kept); its record."""
    quiet_transformers()

    pairs = [(example.prompt, example.solution) for example in demonstrations(task)]
    log(f"building the embedded tiny model and warm-starting it on {len(pairs)} demonstrations "
        f"(once; cached in {target})")
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=WARM_START["seed"])
    with torch.random.fork_rng():
        history = supervised_fine_tune(
            model, tokenizer, pairs, steps=WARM_START["steps"], batch_size=WARM_START["batch_size"],
            learning_rate=WARM_START["learning_rate"], warmup_steps=WARM_START["warmup_steps"],
            seed=WARM_START["seed"], progress=progress, eval_every=WARM_START["steps"] // 4,
            evaluate=lambda: {"held_out_accuracy": greedy_accuracy(model, tokenizer, task)})
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {"task": task.name, "recipe_version": RECIPE_VERSION, "architecture": TINY_ARCHITECTURE,
                  "warm_start": WARM_START, "demonstrations": len(pairs), "history": history,
                  "seconds": time.perf_counter() - started, "made_on": machine_record("float32")}
        atomic_write_json(staging / "warm-start.json", record)
        if target.exists():  # another process finished first: keep theirs
            shutil.rmtree(staging)
        else:
            make_tree_shareable(staging)
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"warm start done in {time.perf_counter() - started:.0f} s: held-out greedy accuracy "
        f"{history[-1]['held_out_accuracy']:.3f}")
    return record


def warm_start_record(path: Path) -> dict | None:
    record = path / "warm-start.json"
    return json.loads(record.read_text()) if record.is_file() else None


def model_for(model: str | None, offline: bool, progress: bool, task, world, log=print) -> str:
    """The run's model as a folder or hub id: ``--model`` (materialised), else the tiny model warm-started on the
    task. Rank 0 makes it (showing ``progress``); the others wait."""
    def resolve(progress: bool) -> str:
        if model is None:
            return str(ensure_warm_started(task, progress=progress, log=log))
        return materialise(model, offline, log)

    name = resolve(progress) if world.main else None
    world.barrier()
    return name if world.main else resolve(False)
