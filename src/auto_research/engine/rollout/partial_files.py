"""A group of partial rollouts done (``Finished``), and a builtin ``partial.Pool`` to and from a checkpoint's files,
checked against the pool before they go back in: a state that does not fit is refused at its restore, not later."""

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
    """The pool and the groups done, as tensors (copies) and plain values: a resumed run decodes on from the very
    same KV cache."""
    tensors = {f"rows/{name}": value.detach().clone() for name, value in pool.rows.items()}
    tensors.update({f"batch/{name}": value.detach().clone() for name, value in pool.batch.items()})
    for index, layer in enumerate(pool.cache.layers if pool.cache is not None else ()):
        tensors[f"cache/{index}/keys"], tensors[f"cache/{index}/values"] = layer.keys.clone(), layer.values.clone()
    tensors.update({f"finished/{index}/{name}": getattr(lane, name).clone() for index, lane in enumerate(finished)
                    for name in FINISHED_FIELDS})
    plain = {"lanes": [{**lane, "key": list(lane["key"])} for lane in pool.lanes], "admitted": pool.admitted,
             "version": pool.version, "layers": len(pool.cache.layers) if pool.cache is not None else 0,
             "finished": [{"key": list(lane.key), "order": lane.order, "prompt_ids": lane.prompt_ids}
                          for lane in finished]}
    return tensors, plain


ROW_FIELDS = {"t": (1, torch.long), "ended": (1, torch.bool), "tokens": (2, torch.long), "logprobs": (2, "float"),
              "entropies": (2, "float"), "versions": (2, torch.long), "uniforms": (2, "float")}
"""What a pool's rows drew (``Pool.rows``): the dimensions of each (None: any) and its dtype (or any float)."""
BATCH_FIELDS = {"row": (1, torch.long), "attention": (2, "integer"), "position": (None, torch.long),
                "logits": (2, "float"), "logits_version": (1, torch.long)}
"""The rows decoding (``Pool.batch``), likewise (an attention mask of any integer dtype)."""
FINISHED_FIELDS = ("tokens", "logprobs", "entropies", "versions")
"""The tensors of a group done (``Finished``), as a state saves them."""


def _with_batch(tensors: dict, count: int) -> dict:
    """A state saved before rows left the batch as they ended (every row in it, with ``rows/attention`` and the
    rest): its batch is every row; ``pool_from_files`` then takes the ended ones out."""
    if "rows/attention" not in tensors or any(key.startswith("batch/") for key in tensors):
        return tensors
    tensors = dict(tensors)  # (the caller's own is left as it was)
    missing = [name for name in BATCH_FIELDS if name != "row" and f"rows/{name}" not in tensors]
    if missing:
        raise ValueError(f"the pool's rows hold no {', '.join(missing)}")
    moved = {f"batch/{name}": tensors.pop(f"rows/{name}") for name in BATCH_FIELDS if name != "row"}
    return {**tensors, **moved, "batch/row": torch.arange(count)}


def _check_fields(tensors: dict, prefix: str, fields: dict, count: int) -> None:
    found = {key[len(prefix):] for key in tensors if key.startswith(prefix)}
    if found != set(fields):
        raise ValueError(f"the pool's {prefix[:-1]} holds {sorted(found)}, not {sorted(fields)}")
    for name, (dims, dtype) in fields.items():
        value = tensors[prefix + name]
        if value.dim() == 0 or value.shape[0] != count or dims not in (None, value.dim()):
            raise ValueError(f"{prefix}{name} has shape {list(value.shape)} for {count} rows")
        if not _has_dtype(value, dtype):
            raise ValueError(f"{prefix}{name} holds {value.dtype}")


def _has_dtype(value: torch.Tensor, dtype) -> bool:
    """``dtype``: a torch dtype, "float" (any floating one) or "integer" (any integer one, not bool)."""
    if dtype == "float":
        return value.is_floating_point()
    if dtype == "integer":
        return not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return value.dtype == dtype


def check_pool_files(pool, tensors: dict, plain: dict) -> None:
    """``ValueError`` naming the first thing in a saved pool that does not fit ``pool``: its rows, the batch of those
    decoding, their KV cache and their lanes agree in number, width and layers."""
    count, layers = len(plain["lanes"]) * pool.K, plain["layers"]
    if not count:
        if any(key.startswith(("rows/", "batch/")) for key in tensors) or layers:
            raise ValueError("a pool without lanes holds rows or a cache")
        return
    _check_fields(tensors, "rows/", ROW_FIELDS, count)
    rows = {name: tensors["rows/" + name] for name in ROW_FIELDS}
    for name in ("tokens", "logprobs", "entropies", "versions", "uniforms"):
        if rows[name].shape[1] != pool.max_new:
            raise ValueError(f"rows/{name} has {rows[name].shape[1]} columns, not the {pool.max_new} new tokens")
    if rows["t"].min() < 0 or rows["t"].max() > pool.max_new or bool((rows["t"][~rows["ended"]] >= pool.max_new).any()):
        raise ValueError(f"rows/t counts tokens outside 0..{pool.max_new} (and below it for a row not ended)")
    decoding = tensors.get("batch/row")
    if decoding is None or decoding.dim() != 1 or decoding.is_floating_point():
        raise ValueError("the pool's batch/row is not a list of rows")
    _check_fields(tensors, "batch/", BATCH_FIELDS, len(decoding))
    if len(set(decoding.tolist())) < len(decoding) or not set(decoding.tolist()) <= set(range(count)) \
            or set((~rows["ended"]).nonzero().squeeze(1).tolist()) - set(decoding.tolist()):
        raise ValueError("batch/row does not name each row still decoding once")
    vocabulary = pool.model.get_output_embeddings().weight.shape[0]
    if tensors["batch/logits"].shape[1] != vocabulary or not 0 <= int(rows["tokens"].min()) \
            <= int(rows["tokens"].max()) < vocabulary:
        raise ValueError(f"batch/logits or rows/tokens do not fit a vocabulary of {vocabulary}")
    expected = pool.model.config.num_hidden_layers
    if layers != expected:
        raise ValueError(f"the cache has {layers} layers, the model {expected}")
    width, config, batch = tensors["batch/attention"].shape[1], pool.model.config, len(decoding)
    heads, size = getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim(config)
    for index in range(layers):
        keys, values = tensors.get(f"cache/{index}/keys"), tensors.get(f"cache/{index}/values")
        if keys is None or values is None or keys.shape != values.shape or keys.dim() != 4 \
                or keys.shape[0] != batch or keys.shape[2] != width:
            raise ValueError(f"cache layer {index} does not hold {batch} rows of {width} positions")
        if (keys.shape[1], keys.shape[3]) != (heads, size) or not keys.is_floating_point() \
                or keys.dtype != values.dtype:  # (the model's attention would fail on it at the next round)
            raise ValueError(f"cache layer {index} is not {heads} heads of {size} values in one float dtype")


def pool_from_files(pool, tensors: dict, plain: dict) -> list[Finished]:
    """``pool_to_files``' values back into ``pool``, once they fit it; the groups done, returned."""
    from transformers.cache_utils import DynamicCache

    tensors = _with_batch(tensors, len(plain["lanes"]) * pool.K)
    check_pool_files(pool, tensors, plain)

    pool.lanes = [{**lane, "key": tuple(lane["key"])} for lane in plain["lanes"]]
    pool.admitted, pool.version = plain["admitted"], plain["version"]
    # Copies: the pool writes into its rows as it decodes, and the caller may keep the state (a server does).
    pool.rows = {key[len("rows/"):]: value.to(pool.device, copy=True) for key, value in tensors.items()
                 if key.startswith("rows/")}
    pool.batch = {key[len("batch/"):]: value.to(pool.device, copy=True) for key, value in tensors.items()
                  if key.startswith("batch/")}
    pool.cache = None
    if plain["layers"]:
        pool.cache = DynamicCache()
        for index in range(plain["layers"]):
            pool.cache.update(tensors[f"cache/{index}/keys"].to(pool.device, copy=True),
                              tensors[f"cache/{index}/values"].to(pool.device, copy=True), index)
        pool._decoding(~pool.rows["ended"][pool.batch["row"]])  # (an older state's ended rows)
    return [Finished(tuple(lane["key"]), lane["order"], lane["prompt_ids"],
                     *(tensors[f"finished/{index}/{name}"].to(pool.device) for name in FINISHED_FIELDS))
            for index, lane in enumerate(plain["finished"])]
