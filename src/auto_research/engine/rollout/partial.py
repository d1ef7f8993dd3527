"""The builtin engine's continuous batch, for in-flight weight updates and partial rollouts (--in-flight-updates;
``train/partial_flight.py`` drives it, docs/async.md).

A *lane* is one prompt's group: K rows prefilled once. Every row still decoding is in one forward a tick, their KV
cache in one batch, left-padded; a row that ends leaves it (as ``builtin.sample`` compacts), and a lane leaves the
pool when its K rows have ended, new lanes admitted into the rows it freed. New weights are taken between two ticks
(``swap``), the KV cache kept or, with ``recompute_kv``, recomputed. Each drawn token records the version whose
logits drew it and its log-prob under them; a row's draws depend only on its seed and those weights, never on which
lanes shared its ticks.
"""

from __future__ import annotations

from collections import deque

import torch

from transformers.cache_utils import DynamicLayer

from auto_research.engine.rollout import completion_mask, eos_ids, left_padded
from auto_research.engine.rollout.builtin import (_prefill, _uniforms, cache_argument, cache_of, droppable,
                                                  encode_prompts, next_token)
from auto_research.engine.rollout.partial_files import Finished, pool_from_files, pool_to_files
from auto_research.errors import UserError


class Pool:
    """Lanes in flight, decoded by the caller's model with whatever weights it holds, whose version the caller names."""

    def __init__(self, model, tokenizer, group_size: int, max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, eos: list[int], pad: int, version: int = 0):
        self.model, self.tokenizer, self.K, self.max_new = model, tokenizer, group_size, max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.device = next(model.parameters()).device
        self.eos, self.pad = torch.tensor(eos, device=self.device), pad
        self.argument = cache_argument(model)
        self.lanes: list[dict] = []
        """In row order: each lane's key, order and prompt ids (its K rows are consecutive)."""
        self.rows: dict[str, torch.Tensor] = {}
        """What each lane's rows drew, (R = lanes · K, …): t (tokens drawn), ended, tokens, logprobs, entropies,
        versions, uniforms."""
        self.batch: dict[str, torch.Tensor] = {}
        """The rows still decoding, in the forward's order (B ≤ R, …), as the KV cache (``cache``) holds them: row
        (their index in ``rows``), attention, position, logits (pending), logits_version."""
        self.cache = None
        self.admitted = 0
        self.version = version
        """The version of the weights the model holds (``swap`` names the next)."""

    @property
    def size(self) -> int:
        """The rows of the lanes in flight (those ended included: a lane's K rows are freed together)."""
        return len(self.lanes) * self.K

    # --- admitting and dropping lanes -------------------------------------------------------------------------

    def admit(self, key, prompt_ids: list[int], seed: int) -> None:
        """A prompt's K rows, prefilled under the current weights; its uniforms from its seed alone."""
        self.admit_many([(key, prompt_ids, seed)])

    @torch.no_grad()
    def admit_many(self, groups: list[tuple[object, list[int], int]]) -> None:
        """Several prompts' groups (key, prompt ids, seed), prefilled in one left-padded forward, as ``sample``'s."""
        if not groups:
            return
        ids, attention = encode_prompts(self.tokenizer, [list(prompt) for _, prompt, _ in groups], self.device)
        logits, cache, position = _prefill(self.model, ids, attention, self.K)
        if not droppable(cache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise UserError("--in-flight-updates needs a model whose KV cache is a plain dynamic cache per layer "
                             "(no sliding window: the continuous batch pads and trims every layer's positions alike)")
        count, width, device = len(groups) * self.K, self.max_new, self.device
        rows = {"t": torch.zeros(count, dtype=torch.long, device=device),
                "ended": torch.zeros(count, dtype=torch.bool, device=device),
                "tokens": torch.full((count, width), self.pad, dtype=torch.long, device=device),
                "logprobs": torch.zeros(count, width, device=device),
                "entropies": torch.zeros(count, width, device=device),
                "versions": torch.full((count, width), -1, dtype=torch.long, device=device),
                "uniforms": _uniforms([seed for _, _, seed in groups], len(groups), count, self.K, width, device)}
        batch = {"row": torch.arange(self.size, self.size + count, device=device),
                 "attention": attention.repeat_interleave(self.K, dim=0), "position": position, "logits": logits,
                 "logits_version": torch.full((count,), self.version, dtype=torch.long, device=device)}
        self._append(cache, rows, batch)
        for key, prompt, _ in groups:
            self.lanes.append({"key": key, "order": self.admitted, "prompt_ids": list(prompt)})
            self.admitted += 1

    def _append(self, cache, rows: dict, batch: dict) -> None:
        if self.cache is None:  # (no row decoding: no lane either)
            self.cache, self.rows, self.batch = cache, rows, batch
            return
        width = max(self.batch["attention"].shape[1], batch["attention"].shape[1])
        for layer, new in zip(self.cache.layers, cache.layers):
            layer.keys = torch.cat([_left_pad(layer.keys, width), _left_pad(new.keys, width)])
            layer.values = torch.cat([_left_pad(layer.values, width), _left_pad(new.values, width)])
        self.batch["attention"] = torch.cat([_left_pad(self.batch["attention"], width),
                                             _left_pad(batch["attention"], width)])
        for name, value in batch.items():
            if name != "attention":
                self.batch[name] = torch.cat([self.batch[name], value])
        self.rows = {name: torch.cat([self.rows[name], rows[name]]) for name in self.rows}

    def _keep(self, lanes: list[int]) -> None:
        """Only these lanes (their positions in ``self.lanes``) stay, with their rows."""
        if not lanes:
            self.lanes, self.cache, self.rows, self.batch = [], None, {}, {}
            return
        rows = torch.tensor([lane * self.K + r for lane in lanes for r in range(self.K)], dtype=torch.long,
                            device=self.device)
        renumbered = torch.full((self.size,), -1, dtype=torch.long, device=self.device)
        renumbered[rows] = torch.arange(len(rows), device=self.device)
        self.lanes = [self.lanes[lane] for lane in lanes]
        self.rows = {name: value[rows] for name, value in self.rows.items()}
        self.batch["row"] = renumbered[self.batch["row"]]
        self._decoding(self.batch["row"] >= 0)

    def _decoding(self, keep: torch.Tensor) -> None:
        """Only the batch's rows where ``keep`` holds go on decoding; columns that are padding in all of them go."""
        if bool(keep.all()):
            return
        positions = keep.nonzero().squeeze(1)
        self.cache.batch_select_indices(positions)
        self.batch = {name: value[positions] for name, value in self.batch.items()}
        used = self.batch["attention"].any(0).nonzero()
        first = int(used[0]) if used.numel() else 0
        if first:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.batch["attention"] = self.batch["attention"][:, first:]

    def drop(self, keep) -> list:
        """Take out every lane whose key ``keep`` refuses, unfinished; their keys, in row order."""
        kept = [i for i, lane in enumerate(self.lanes) if keep(lane["key"])]
        dropped = [lane["key"] for lane in self.lanes if not keep(lane["key"])]
        if dropped:
            self._keep(kept)
        return dropped

    def oldest_versions(self) -> list[tuple[object, int]]:
        """Each lane's key and the oldest version among its drawn tokens and its rows' pending logits."""
        if not self.lanes:
            return []
        never = 1 << 62
        oldest = self.rows["versions"].masked_fill(self.rows["versions"] < 0, never).amin(1)
        pending = torch.full_like(oldest, never)
        pending[self.batch["row"]] = self.batch["logits_version"]
        oldest = torch.minimum(oldest, pending).view(len(self.lanes), self.K).amin(1)
        return [(lane["key"], int(value)) for lane, value in zip(self.lanes, oldest.tolist())]

    # --- decoding --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def tick(self) -> list[Finished]:
        """One token for every row decoding (from its pending logits), the rows and lanes that ended out, then one
        forward over the rows left; the lanes that ended, in admission order."""
        if not self.lanes:
            return []
        rows, batch = self.rows, self.batch
        index = batch["row"]
        t = rows["t"][index]
        uniforms = rows["uniforms"][index, t]
        token, logprob, entropy = next_token(batch["logits"], uniforms, self.temperature, self.top_k, self.top_p)
        rows["tokens"][index, t], rows["logprobs"][index, t] = token, logprob
        rows["entropies"][index, t], rows["versions"][index, t] = entropy, batch["logits_version"]
        rows["t"][index] = t + 1
        ended = torch.isin(token, self.eos) | (t + 1 >= self.max_new)
        rows["ended"][index] = ended
        self._decoding(~ended)
        token = token[~ended]
        done = rows["ended"].view(len(self.lanes), self.K).all(1).tolist()
        finished = [self._finished(i) for i, over in enumerate(done) if over]
        if finished:
            self._keep([i for i, over in enumerate(done) if not over])
            if not self.lanes:
                return finished
        self._forward(token)
        return finished

    def _forward(self, token: torch.Tensor) -> None:
        batch = self.batch
        attention = torch.cat([batch["attention"], batch["attention"].new_ones(len(token), 1)], dim=1)
        output = self.model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=batch["position"],
                            use_cache=True, **{self.argument: self.cache})
        self.cache, batch["logits"] = cache_of(output), output.logits[:, -1].float()
        batch["logits_version"] = torch.full_like(batch["logits_version"], self.version)
        batch["attention"], batch["position"] = attention, batch["position"] + 1

    def _finished(self, lane: int) -> Finished:
        part = slice(lane * self.K, (lane + 1) * self.K)
        width = max(int(self.rows["t"][part].max()), 1)
        info = self.lanes[lane]
        return Finished(info["key"], info["order"], info["prompt_ids"], self.rows["tokens"][part, :width].clone(),
                        self.rows["logprobs"][part, :width].clone(), self.rows["entropies"][part, :width].clone(),
                        self.rows["versions"][part, :width].clone())

    to_files = pool_to_files
    from_files = pool_from_files
    """A checkpoint's files of the pool and the groups done, and back (``partial_files.py``)."""

    def close(self) -> None:
        """Every lane given up, with its rows and KV cache (the rounds are done with)."""
        self._keep([])

    @torch.no_grad()
    def swap(self, version: int, recompute_kv: bool) -> None:
        """New weights are in the model. Kept, the KV cache and the logits pending (the old weights') draw the next
        token; with ``recompute_kv`` each decoding row's prompt and tokens are prefilled again under the new ones."""
        self.version = version
        if not self.lanes or not recompute_kv:
            return
        histories = [self.lanes[row // self.K]["prompt_ids"] + self.rows["tokens"][row, : int(self.rows["t"][row])]
                     .tolist() for row in self.batch["row"].tolist()]
        ids, attention = left_padded(histories, self.pad, self.device)
        logits, cache, position = _prefill(self.model, ids, attention, 1)
        self.cache = cache
        self.batch.update(attention=attention, position=position, logits=logits,
                          logits_version=torch.full_like(self.batch["logits_version"], version))


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros on the left of the sequence dimension (the last for a mask, the second to last for keys/values)."""
    dim = -1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    pad = (missing, 0) if dim == -1 else (0, 0, missing, 0)
    return torch.nn.functional.pad(tensor, pad)


def lanes_to_rows(finished: list[Finished], pad: int, eos: list[int]):
    """Finished lanes as a rollout's tensors: left-padded prompts, right-padded completions, the completion mask,
    μ's log-probs and entropies (0 where masked), each token's version (−1 where masked)."""
    width = max(lane.tokens.shape[1] for lane in finished)
    K = finished[0].tokens.shape[0]
    device = finished[0].tokens.device
    prompt, prompt_mask = left_padded([lane.prompt_ids for lane in finished for _ in range(K)], pad, device)
    tokens = torch.full((len(finished) * K, width), pad, dtype=torch.long, device=device)
    logprobs, entropies = torch.zeros(tokens.shape, device=device), torch.zeros(tokens.shape, device=device)
    versions = torch.full(tokens.shape, -1, dtype=torch.long, device=device)
    for index, lane in enumerate(finished):
        rows, length = slice(index * K, (index + 1) * K), lane.tokens.shape[1]
        tokens[rows, :length], logprobs[rows, :length] = lane.tokens, lane.logprobs
        versions[rows, :length] = lane.versions
        if lane.entropies is not None:
            entropies[rows, :length] = lane.entropies
    mask = completion_mask(tokens, eos)
    known = all(lane.entropies is not None for lane in finished)  # vLLM gives none
    return (prompt, prompt_mask, tokens, mask, logprobs * mask, entropies * mask if known else None,
            torch.where(mask.bool(), versions, torch.full_like(versions, -1)))


SUPPLY_ROUNDS = 3
"""A round admits fewer than 3·P groups (P to fill the rows free at its start, fewer than P as groups finish before
its last tick, at most P after it): a queue of 3·P prompts never runs dry mid-round."""


def supply_target(per_step: int, pool_groups: int | None = None) -> int:
    """The groups the queue holds before a round (``SUPPLY_ROUNDS``): a pool of ``pool_groups`` > P groups may take
    that many more at the round's start."""
    return SUPPLY_ROUNDS * per_step + max(0, (pool_groups or per_step) - per_step)


class Rounds:
    """Partial rollouts over a pool of lanes (``Pool`` or ``vllm_partial.VLLMPool``), a round at a time, in the
    trainer's process or a rollout server: the queue of groups to draw (a stale group goes back to its front), and
    the groups done but not yet handed over. ``run`` makes one step's batch."""

    def __init__(self, pool):
        self.pool = pool
        self.pending: deque = deque()
        """(key, prompt ids, seed) of each group to draw, in order; a key is (prompt index, seed)."""
        self.finished: list[Finished] = []
        self.requeued = 0
        """Groups put back in the queue so far (their tokens had grown too old)."""

    def supply(self, groups) -> None:
        self.pending.extend((key, list(ids), seed) for key, ids, seed in groups)

    def keys(self) -> list:
        """Every group the rounds hold: queued, decoding or done."""
        return ([key for key, _, _ in self.pending] + [lane["key"] for lane in self.pool.lanes]
                + [lane.key for lane in self.finished])

    def run(self, version: int, per_step: int, oldest_allowed: int, recompute_kv: bool,
            pool_groups: int | None = None, settle: bool = False) -> list[Finished]:
        """One step's batch: ``version``'s weights taken, every group holding a token older than ``oldest_allowed``
        put back at the front of the queue, then decode steps with up to ``pool_groups`` groups (at least
        ``per_step``) until ``per_step`` are done; those, in the order they finished. ``settle``: a checkpoint reads
        this round, and a pool that cannot save its groups decoding (vLLM's) requeues them now, as a restore would."""
        pool_groups = max(per_step, pool_groups or per_step)
        if self.pool.version != version:
            self.pool.swap(version, recompute_kv)
        stale = {id(lane) for lane in self.finished if int(lane.versions[lane.versions >= 0].min()) < oldest_allowed}
        dropped = {key for key, oldest in self.pool.oldest_versions() if oldest < oldest_allowed}
        again = [(lane.key, list(lane.prompt_ids), lane.key[1]) for lane in self.finished if id(lane) in stale] + [
            (lane["key"], list(lane["prompt_ids"]), lane["key"][1]) for lane in self.pool.lanes
            if lane["key"] in dropped]
        self.finished = [lane for lane in self.finished if id(lane) not in stale]  # (a key's seed is its own)
        self.pool.drop(lambda key: key not in dropped)
        self.requeued += len(again)
        self.pending.extendleft(reversed(again))  # drawn again first, in the order they were first admitted
        self._fill(pool_groups)
        while len(self.finished) < per_step:
            self.finished += self.pool.tick()
            self._fill(pool_groups)
        taken, self.finished = self.finished[:per_step], self.finished[per_step:]
        if settle and not getattr(self.pool, "saves_lanes", True):
            self.pending.extendleft(reversed(self.pool.settle()))
        return taken

    def _fill(self, groups: int) -> None:
        """Admit groups into the free rows (``groups`` · K of them)."""
        K, admitted = self.pool.K, []
        while self.pool.size + K * (len(admitted) + 1) <= groups * K:
            if not self.pending:
                self.pending.extendleft(reversed(admitted))  # nothing is lost: the caller's error, with the queue
                raise RuntimeError(f"the queue of prompts ran dry mid-round (it is kept at {SUPPLY_ROUNDS} steps' "
                                   "worth, and the pool's extra groups, before each round)")
            admitted.append(self.pending.popleft())
        self.pool.admit_many(admitted)

    def to_files(self) -> tuple[dict, dict]:
        """The rounds' state as tensors (copies) and plain values; a pool's ``"unfinished"`` go first in the queue."""
        tensors, plain = self.pool.to_files(self.finished)
        unfinished = plain.pop("unfinished", [])
        plain.update(pending=unfinished + [[list(key), list(ids), seed] for key, ids, seed in self.pending],
                     requeued=self.requeued)
        return tensors, plain

    def restore(self, tensors: dict, plain: dict) -> None:
        """``to_files``' values back; ``ValueError`` naming what does not fit, before anything is changed."""
        for index, lane in enumerate(plain["finished"]):
            shape = tensors[f"finished/{index}/tokens"].shape
            entropies = tensors.get(f"finished/{index}/entropies")  # (none from vLLM)
            if len(shape) != 2 or shape[0] != self.pool.K or any(
                    tensors[f"finished/{index}/{name}"].shape != shape for name in ("logprobs", "versions")) or (
                    entropies is not None and entropies.shape != shape):
                raise ValueError(f"finished group {index} is not {self.pool.K} rows of tokens, log-probs, versions "
                                 "(and entropies)")
        for item in plain["pending"]:
            key, ids, seed = item
            if not (isinstance(key, list) and len(key) == 2 and isinstance(ids, list) and key[1] == seed
                    and all(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
                            for value in key)):
                raise ValueError(f"a queued group is not [[prompt index, seed], prompt ids, seed]: {str(item)[:80]}")
        self.finished = self.pool.from_files(tensors, plain)
        self.pending = deque((tuple(key), list(ids), seed) for key, ids, seed in plain["pending"])
        self.requeued = plain["requeued"]

    def close(self) -> None:
        """The groups in flight given up (vLLM's requests aborted); nothing else is done with these rounds."""
        self.pool.close()


def builtin_pool(model, tokenizer, group_size: int, settings) -> Pool:
    """The builtin engine's continuous batch over ``model``, padded as the trainer's rollout side pads."""
    return Pool(model, tokenizer, group_size, settings.max_new_tokens, settings.temperature, settings.top_k,
                settings.top_p, eos_ids(tokenizer, model), tokenizer.pad_token_id or 0)
