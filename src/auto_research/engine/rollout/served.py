"""Who a rollout server is, as both ends check it: its model's shape and tokenizer (``fingerprint``), its vocabulary
alone (``vocabulary``), and what it knows of its model (``Served``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from auto_research.errors import UserError
from auto_research.http import API_KEY_VARIABLE, RequestFailed, request


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


def health(base: str, headers: dict, where: str, start: str) -> dict:
    """The ``/health`` of the server at ``base``, else ``UserError`` in one line that starts with ``where`` (the flag
    and address), naming ``start`` (the command that starts one) where no server answers."""
    try:
        return json.loads(request(base + "/health", None, "application/json", 10.0, 1, 0.5, headers))
    except RequestFailed as error:
        if error.status == 401:
            raise UserError(f"{where} " + ("refused this API key" if headers else "wants an API key")
                            + f": set {API_KEY_VARIABLE} to the key the server was started with") from None
        raise UserError(f"{where}: no rollout server answers there ({error}); start one with {start}") from None
    except ValueError:
        raise UserError(f"{where}: what answers there is not a rollout server") from None
