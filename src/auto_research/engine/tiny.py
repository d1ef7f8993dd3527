"""The embedded tiny model: a small Qwen2 built from a config, and a byte-level tokenizer built in code.
Nothing is downloaded. Its warm start on a task's demonstrations is a recipe (recipes/warm_start.py).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
BYTE_OFFSET = len(SPECIALS)
"""Byte b of the UTF-8 text is token id BYTE_OFFSET + b."""

# 0.37M parameters: 3 layers learn column addition, and a CPU trains them in about a minute. 96 over 3 heads is 32
# per head, a size vLLM's attention serves on the CPU and on GPUs (recipe v4; v3's 4 heads of 24 vLLM-CPU refuses).
TINY_ARCHITECTURE = dict(hidden_size=96, intermediate_size=288, num_hidden_layers=3, num_attention_heads=3,
                         num_key_value_heads=3, max_position_embeddings=64)


def _byte_symbols() -> list[str]:
    """One printable symbol per byte value, the byte-level convention of GPT-2 and Hugging Face
    tokenizers: printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]


def build_tokenizer():
    """A byte-level tokenizer: every UTF-8 byte is one token (ids 4 … 259, after four special ones), so any text
    round-trips; a BPE model with no merges, a plain Hugging Face tokenizer that loads without our code."""
    vocabulary = {token: index for index, token in enumerate(SPECIALS + _byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_model(tokenizer, seed: int = 0, **overrides):
    """A randomly initialised tiny Qwen2 causal LM for ``tokenizer``."""
    architecture = {**TINY_ARCHITECTURE, **overrides}
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **architecture)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)
