"""The embedded tiny model: a small Qwen2 built from a config, a byte-level
tokenizer built in code, and a supervised warm start on the task's
demonstrations. Nothing is downloaded.

The warm-started model is saved as an ordinary Hugging Face checkpoint in the
cache (``$AUTO_RESEARCH_CACHE``, else ``~/.cache/auto-research``) and reused
by later runs; the folder name carries the recipe version so that a changed
recipe never reuses a stale model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from auto_research.files import atomic_write_json, make_tree_shareable

RECIPE_VERSION = 3
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
BYTE_OFFSET = len(SPECIALS)
"""Byte b of the UTF-8 text is token id BYTE_OFFSET + b."""

# Architecture: 0.37M parameters; 3 layers are enough to learn column addition
# from enough examples, and small enough that a CPU trains it in about a minute.
TINY_ARCHITECTURE = dict(hidden_size=96, intermediate_size=288, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=64)

# Warm start: every demonstration seen about 270 times; held-out accuracy has
# plateaued well before the end (benchmarks/arithmetic_generate.py shows the control).
WARM_START = dict(steps=1500, batch_size=64, learning_rate=2e-3, warmup_steps=20, seed=2)


def cache_dir() -> Path:
    return Path(os.environ.get("AUTO_RESEARCH_CACHE") or Path.home() / ".cache" / "auto-research")


def _byte_symbols() -> list[str]:
    """One printable symbol per byte value, the byte-level convention of GPT-2 and Hugging Face
    tokenizers: printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def build_tokenizer():
    """A byte-level tokenizer: every UTF-8 byte is one token, so any text encodes and decodes
    losslessly, and ``save_pretrained`` + ``AutoTokenizer`` give back the same ids.

    It is a BPE model with no merges over the 256 byte symbols (ids 4 … 259), after four special
    tokens; a plain Hugging Face tokenizer, so nothing of ours is needed to load it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(SPECIALS + _byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_model(tokenizer, seed: int = 0, **overrides):
    """A randomly initialised tiny Qwen2 causal LM for ``tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    architecture = {**TINY_ARCHITECTURE, **overrides}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **architecture,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def warm_started_path(task_name: str) -> Path:
    return cache_dir() / f"{task_name}-qwen2-tiny-v{RECIPE_VERSION}"


def ensure_warm_started(task, progress: bool = True, log=print) -> Path:
    """Path of the warm-started tiny model for ``task``, training it first if the cache lacks it."""
    target = warm_started_path(task.base or task.name)
    if (target / "warm-start.json").is_file():
        return target
    import torch

    from auto_research.post_training.lm.evaluation import greedy_accuracy
    from auto_research.post_training.lm.models import quiet_transformers
    from auto_research.post_training.lm.sft import supervised_fine_tune

    quiet_transformers()

    log(f"building the embedded tiny model and warm-starting it on {len(task.demonstrations)} demonstrations "
        f"(once; cached in {target})")
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=WARM_START["seed"])
    pairs = [(example.prompt, example.solution) for example in task.demonstrations]
    with torch.random.fork_rng():
        history = supervised_fine_tune(
            model, tokenizer, pairs,
            steps=WARM_START["steps"], batch_size=WARM_START["batch_size"],
            learning_rate=WARM_START["learning_rate"], warmup_steps=WARM_START["warmup_steps"],
            seed=WARM_START["seed"], progress=progress,
            evaluate=lambda: {"held_out_accuracy": greedy_accuracy(model, tokenizer, task)},
            eval_every=WARM_START["steps"] // 4,
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        atomic_write_json(staging / "warm-start.json", {
            "task": task.name, "recipe_version": RECIPE_VERSION, "architecture": TINY_ARCHITECTURE,
            "warm_start": WARM_START, "demonstrations": len(pairs), "history": history,
            "seconds": time.perf_counter() - started,
        })
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
    return target


def warm_start_record(path: Path) -> dict | None:
    record = path / "warm-start.json"
    return json.loads(record.read_text()) if record.is_file() else None
