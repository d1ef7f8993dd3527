"""Partial rollouts on vLLM (--in-flight-updates over ``rollout-serve --engine vllm``; docs/async.md): a pool of
lanes for ``partial.Rounds`` on vLLM's own continuous batch, stepped by hand (``add_request``, ``step``).

The engine schedules synchronously (``vllm.py``): when ``step`` returns nothing runs, so a push between two rounds
reaches the requests in flight between two of their decode steps, their KV cache kept. Each of a group's K rows is a
request of its own, seeded as vLLM seeds a request's K children (seed + k), so each token is recorded with the
version whose forward drew it. Prompts carry the pool's salt and the weights' version as their prefix-cache salt: no
group reuses KV computed by other weights or another run. ``--recompute-kv-on-update`` preempts every request in
flight at the round that takes new weights, and vLLM recomputes their KV cache.

A checkpoint cannot hold vLLM's KV cache or samplers: ``to_files`` saves the groups done and hands those decoding
back to the front of the queue. So that a resumed run's rows are the uninterrupted run's, the uninterrupted run does
the same at each round a checkpoint reads (``saves_lanes`` false: ``Rounds.run``'s ``settle``).
"""

from __future__ import annotations

import itertools
import secrets

import torch

from auto_research.engine.rollout.partial_files import Finished


class VLLMPool:
    """The pool ``partial.Rounds`` drives (see its docstring) over a ``VLLMSampler``'s engine."""

    saves_lanes = False
    """A checkpoint cannot hold the groups decoding (see the module)."""

    def __init__(self, sampler, group_size: int, settings):
        self.sampler, self.K, self.settings = sampler, group_size, settings
        self.engine = sampler.llm.llm_engine
        self.version = 0
        self.lanes: list[dict] = []
        """Groups decoding, in admission order: key, order, prompt ids, the version they were admitted under, and
        each row's tokens, log-probs, versions and whether it ended."""
        self.requests: dict[str, tuple[dict, int]] = {}
        """vLLM's request id → (lane, row), for the requests still running."""
        self.order = 0
        self.salt = secrets.token_hex(8)
        """This pool's own: its request ids and prefix-cache salts are no other pool's."""
        self.ids = itertools.count()

    @property
    def size(self) -> int:
        return len(self.lanes) * self.K

    def admit_many(self, groups: list[tuple[object, list[int], int]]) -> None:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415 - optional, heavy
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        for key, ids, seed in groups:
            lane = {"key": key, "order": self.order, "prompt_ids": list(ids), "admitted": self.version,
                    "rows": [{"tokens": [], "logprobs": [], "versions": [], "ended": False} for _ in range(self.K)]}
            self.order += 1
            self.lanes.append(lane)
            for row in range(self.K):
                params = self.sampler.sampling_params(1, seed, self.settings)
                params.seed += row  # vLLM's seed for the row-th child of a request of K
                params.output_kind = RequestOutputKind.DELTA  # each step's new token alone
                rid = f"partial-{self.salt}-{next(self.ids)}"
                self.requests[rid] = (lane, row)
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids),
                                                          cache_salt=f"{self.salt}-{self.version}"), params)

    def tick(self) -> list[Finished]:
        """One decode step of every request in flight; the groups whose K rows all ended, in admission order."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("vLLM has no request of this pool left to decode, and the round is not done")
        for output in self.engine.step():
            if output.request_id not in self.requests:
                continue
            lane, row = self.requests[output.request_id]
            state, sample = lane["rows"][row], output.outputs[0]
            for token, step in zip(sample.token_ids, sample.logprobs or ()):
                state["tokens"].append(int(token))
                state["logprobs"].append(float(step[token].logprob))
                state["versions"].append(self.version)
            if output.finished:
                state["ended"] = True
                del self.requests[output.request_id]
        done = [lane for lane in self.lanes if all(row["ended"] for row in lane["rows"])]
        self.lanes = [lane for lane in self.lanes if not all(row["ended"] for row in lane["rows"])]
        return [self._finished(lane) for lane in done]

    def swap(self, version: int, recompute_kv: bool) -> None:
        """New weights are in the engine (pushed between two rounds)."""
        if recompute_kv and self.lanes:
            # Every request in flight preempted: vLLM prefills its prompt and tokens so far again, under the new
            # weights, before its next token.
            self.engine.reset_prefix_cache(reset_running_requests=True)
        self.version = version

    def oldest_versions(self) -> list[tuple[object, int]]:
        return [(lane["key"], min([v for row in lane["rows"] for v in row["versions"]] or [lane["admitted"]]))
                for lane in self.lanes]

    def drop(self, keep) -> list:
        """The lanes whose key ``keep`` refuses, their requests aborted; their keys, in admission order."""
        dropped = [lane for lane in self.lanes if not keep(lane["key"])]
        self._abort(dropped)
        return [lane["key"] for lane in dropped]

    def close(self) -> None:
        self._abort(list(self.lanes))

    def settle(self) -> list:
        """Every group decoding given up, as a restore leaves the pool (see the module): their requests aborted and
        the prefix cache emptied; their (key, prompt ids, seed), in admission order."""
        groups = [(lane["key"], list(lane["prompt_ids"]), lane["key"][1]) for lane in self.lanes]
        self.close()
        self.engine.reset_prefix_cache()
        return groups

    def _abort(self, lanes: list[dict]) -> None:
        gone = {id(lane) for lane in lanes}
        ids = [rid for rid, (lane, _) in self.requests.items() if id(lane) in gone]
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            del self.requests[rid]
        self.lanes = [lane for lane in self.lanes if id(lane) not in gone]

    def _finished(self, lane: dict) -> Finished:
        width = max(1, max(len(row["tokens"]) for row in lane["rows"]))
        tokens = torch.full((self.K, width), self.sampler.pad, dtype=torch.long)
        logprobs = torch.zeros(self.K, width)
        versions = torch.full((self.K, width), -1, dtype=torch.long)
        for index, row in enumerate(lane["rows"]):
            length = len(row["tokens"])
            tokens[index, :length] = torch.tensor(row["tokens"], dtype=torch.long)
            logprobs[index, :length] = torch.tensor(row["logprobs"])
            versions[index, :length] = torch.tensor(row["versions"], dtype=torch.long)
        return Finished(lane["key"], lane["order"], list(lane["prompt_ids"]), tokens, logprobs, None, versions)

    # --- checkpoints --------------------------------------------------------------------------------------------

    def to_files(self, finished: list[Finished]) -> tuple[dict, dict]:
        """The groups done (tensors), and the groups decoding as ``"unfinished"`` (see the module)."""
        tensors = {f"finished/{index}/{name}": getattr(lane, name).clone() for index, lane in enumerate(finished)
                   for name in ("tokens", "logprobs", "versions")}
        plain = {"finished": [{"key": list(lane.key), "order": lane.order, "prompt_ids": lane.prompt_ids}
                              for lane in finished],
                 "unfinished": [[list(lane["key"]), list(lane["prompt_ids"]), lane["key"][1]] for lane in self.lanes],
                 "version": self.version, "order": self.order}
        return tensors, plain

    def from_files(self, tensors: dict, plain: dict) -> list[Finished]:
        self.settle()
        self.version, self.order = plain["version"], plain["order"]
        return [Finished(tuple(lane["key"]), lane["order"], lane["prompt_ids"], tensors[f"finished/{index}/tokens"],
                         tensors[f"finished/{index}/logprobs"], None, tensors[f"finished/{index}/versions"])
                for index, lane in enumerate(plain["finished"])]
