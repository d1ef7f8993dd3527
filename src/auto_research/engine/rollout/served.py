"""Who a rollout server is, as both ends check it: its model's shape and tokenizer (``fingerprint``: a trainer whose
``--model`` differs is refused), its vocabulary alone (``vocabulary``: a served teacher's must be the policy's), and
what the server knows of its model (``Served``), against which pushes and requests are checked."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def fingerprint(config, tokenizer) -> str:
    """What must agree between trainer and server: the architecture's shape and the tokenizer's vocabulary."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    shape = {key: getattr(config, key, None) for key in keys}
    vocabulary = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps([shape, vocabulary], sort_keys=True, default=str).encode()).hexdigest()[:16]


def vocabulary(tokenizer) -> str:
    """The tokenizer's vocabulary alone, hashed: a served teacher's must be the policy's."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Served:
    """What the server knows of its model: the trainer's pushes and requests are checked against it."""

    name: str
    fingerprint: str
    spec: dict
    """``{checkpoint name: (shape, dtype name)}`` of every weight the engine loads."""
    vocab_size: int
    dtype: str
    device: str = "cpu"
    """The engine's device: a push over a group is received there (NCCL on a GPU, ``pushes.backends``)."""
    vocabulary: str = ""
    """``vocabulary(tokenizer)``: what a served teacher's client checks."""
