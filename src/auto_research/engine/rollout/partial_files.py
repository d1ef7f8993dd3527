"""A group of partial rollouts done (``Finished``), and a builtin ``partial.Pool`` to and from a checkpoint's files:
the rows in flight with their KV cache and the groups done but not yet handed over (``pool_to_files``), checked
against the pool before they go back in (``check_pool_files``, ``pool_from_files``): a state that does not fit is
refused at its restore, not at the next round."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from auto_research.engine.rollout import head_dim


@dataclass
class Finished:
    """A lane whose K rows have ended: what the trainer needs of it."""

    key: object
    """The caller's handle (a prompt's dataset index and seed, say)."""
    order: int
    """Admission order (lanes finishing on the same tick leave in this order)."""
    prompt_ids: list[int]
    tokens: torch.Tensor
    """(K, C) the drawn ids, padding after each row's end; C = the longest row's length."""
    logprobs: torch.Tensor
    """(K, C) μ's log-prob of each drawn token (0 after the row's end)."""
    entropies: torch.Tensor | None
    """(K, C) the sampler's entropy at each token (None: the engine gives none, as vLLM)."""
    versions: torch.Tensor
    """(K, C) the weights version that drew each token (−1 after the row's end)."""


def pool_to_files(pool, finished: list[Finished]) -> tuple[dict, dict]:
    """The pool and the groups done but not yet handed over, as tensors (copies) and plain values: what a
    checkpoint saves so that a resumed run decodes on from the very same KV cache."""
    tensors = {f"rows/{name}": value.detach().clone() for name, value in pool.rows.items()}
    for index, layer in enumerate(pool.cache.layers if pool.cache is not None else ()):
        tensors[f"cache/{index}/keys"], tensors[f"cache/{index}/values"] = layer.keys.clone(), layer.values.clone()
    for index, lane in enumerate(finished):
        for name in ("tokens", "logprobs", "entropies", "versions"):
            tensors[f"finished/{index}/{name}"] = getattr(lane, name).clone()
    plain = {"lanes": [{**lane, "key": list(lane["key"])} for lane in pool.lanes], "admitted": pool.admitted,
             "version": pool.version, "layers": len(pool.cache.layers) if pool.cache is not None else 0,
             "finished": [{"key": list(lane.key), "order": lane.order, "prompt_ids": lane.prompt_ids}
                          for lane in finished]}
    return tensors, plain


ROW_FIELDS = {"attention": (2, False), "position": (None, False), "logits": (2, True), "logits_version": (1, False),
              "t": (1, False), "ended": (1, False), "tokens": (2, False), "logprobs": (2, True),
              "entropies": (2, True), "versions": (2, False), "uniforms": (2, True)}
"""A pool's per-row state (``Pool.rows``): the dimensions of each (None: any) and whether it holds floats."""


def check_pool_files(pool, tensors: dict, plain: dict) -> None:
    """``ValueError`` naming the first thing in a saved pool (``pool_to_files``) that does not fit ``pool``: its
    rows, their KV cache and the lanes they belong to agree in number, width and layers, so a restored state
    cannot fail at the next round instead of at its restore."""
    rows = {key[len("rows/"):]: value for key, value in tensors.items() if key.startswith("rows/")}
    count, layers = len(plain["lanes"]) * pool.K, plain["layers"]
    if not count:
        if rows or layers:
            raise ValueError("a pool without lanes holds rows or a cache")
        return
    if set(rows) != set(ROW_FIELDS):
        raise ValueError(f"the pool's rows hold {sorted(rows)}, not {sorted(ROW_FIELDS)}")
    for name, (dims, floats) in ROW_FIELDS.items():
        value = rows[name]
        if value.dim() == 0 or value.shape[0] != count or dims not in (None, value.dim()):
            raise ValueError(f"rows/{name} has shape {list(value.shape)} for {count} rows")
        if value.is_floating_point() != floats:
            raise ValueError(f"rows/{name} holds {value.dtype}")
    for name in ("tokens", "logprobs", "entropies", "versions", "uniforms"):
        if rows[name].shape[1] != pool.max_new:
            raise ValueError(f"rows/{name} has {rows[name].shape[1]} columns, not the {pool.max_new} new tokens")
    if rows["t"].min() < 0 or rows["t"].max() > pool.max_new:
        raise ValueError(f"rows/t counts tokens outside 0..{pool.max_new}")
    vocabulary = pool.model.get_output_embeddings().weight.shape[0]
    if rows["logits"].shape[1] != vocabulary or not 0 <= int(rows["tokens"].min()) <= int(rows["tokens"].max()) \
            < vocabulary:
        raise ValueError(f"rows/logits or rows/tokens do not fit a vocabulary of {vocabulary}")
    expected = pool.model.config.num_hidden_layers
    if layers != expected:
        raise ValueError(f"the cache has {layers} layers, the model {expected}")
    width, config = rows["attention"].shape[1], pool.model.config
    heads, size = getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim(config)
    for index in range(layers):
        keys, values = tensors.get(f"cache/{index}/keys"), tensors.get(f"cache/{index}/values")
        if keys is None or values is None or keys.shape != values.shape or keys.dim() != 4 \
                or keys.shape[0] != count or keys.shape[2] > width:  # (a sliding window's layer holds fewer)
            raise ValueError(f"cache layer {index} does not hold {count} rows of at most {width} positions")
        if (keys.shape[1], keys.shape[3]) != (heads, size) or not keys.is_floating_point() \
                or keys.dtype != values.dtype:  # (the model's attention would fail on it at the next round)
            raise ValueError(f"cache layer {index} is not {heads} heads of {size} values in one float dtype")


def pool_from_files(pool, tensors: dict, plain: dict) -> list[Finished]:
    """``pool_to_files``' values back into ``pool`` (made with the run's settings), once they fit it
    (``check_pool_files``); the groups done, returned."""
    from transformers.cache_utils import DynamicCache

    check_pool_files(pool, tensors, plain)

    pool.lanes = [{**lane, "key": tuple(lane["key"])} for lane in plain["lanes"]]
    pool.admitted, pool.version = plain["admitted"], plain["version"]
    pool.rows = {key[len("rows/"):]: value.to(pool.device) for key, value in tensors.items() if key.startswith("rows/")}
    pool.cache = None
    if plain["layers"]:
        pool.cache = DynamicCache()
        for index in range(plain["layers"]):
            pool.cache.update(tensors[f"cache/{index}/keys"].to(pool.device),
                              tensors[f"cache/{index}/values"].to(pool.device), index)
    return [Finished(tuple(lane["key"]), lane["order"], lane["prompt_ids"],
                     *(tensors[f"finished/{index}/{name}"].to(pool.device)
                       for name in ("tokens", "logprobs", "entropies", "versions")))
            for index, lane in enumerate(plain["finished"])]
