"""Partial rollouts on vLLM (--in-flight-updates over ``rollout-serve --engine vllm``; docs/async.md): the rounds
of ``partial.Rounds``, on vLLM's own continuous batch.

vLLM's engine is stepped by hand (``LLMEngine.add_request`` and ``step``: one decode step for every request in
flight), so nothing runs between two steps, and a weight push that lands between two rounds reaches the requests
in flight between two of their decode steps: their KV cache is kept, as ``pause_generation(mode="keep")`` keeps
it in vLLM's asynchronous engine (the installed vLLM 0.32 has it; our server runs the synchronous one). Each of a
group's K rows is a request of its own, seeded as vLLM seeds the K children of one request (seed + k), and asks
for its tokens one step at a time, so each token is recorded with the version of the weights whose forward drew
it. New prompts carry the weights' version as their prefix-cache salt: a group admitted after a push never reuses
a prompt's KV computed by older weights. With ``--recompute-kv-on-update`` every request in flight is preempted at
the round that takes new weights (``reset_prefix_cache(reset_running_requests=True)``): vLLM then recomputes its
KV cache under them.

A checkpoint cannot hold vLLM's KV cache or its samplers' state: ``to_files`` saves the groups done, and puts
the groups still decoding back at the front of the queue, to be drawn again from their first token after
``--resume`` (the resumed run is valid, but not the uninterrupted run's rows, as the builtin engine's is).
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from auto_research.engine.rollout.partial import Finished


class VLLMRounds:
    """``partial.Rounds``' contract (``supply``, ``run``, ``pending``, ``requeued``, ``to_files``, ``restore``) over a
    ``VLLMSampler``'s engine."""

    def __init__(self, sampler, group_size: int, settings):
        self.sampler, self.K, self.settings = sampler, group_size, settings
        self.engine = sampler.llm.llm_engine
        self.pending: deque = deque()
        self.finished: list[Finished] = []
        self.requeued = 0
        self.version = 0
        self.lanes: dict = {}
        """Groups decoding, by key, in admission order: order, prompt ids, and each row's tokens, log-probs,
        versions and whether it ended."""
        self.requests: dict[str, tuple] = {}
        """vLLM's request id → (group key, row)."""
        self.order = 0
        self.ids = itertools.count()

    def supply(self, groups) -> None:
        self.pending.extend((key, list(ids), seed) for key, ids, seed in groups)

    def run(self, version: int, per_step: int, oldest_allowed: int, recompute_kv: bool) -> list[Finished]:
        """One step's batch, as ``partial.Rounds.run``: the weights in the engine now are ``version``'s."""
        if version != self.version and recompute_kv and self.lanes:
            # Every request in flight preempted: vLLM prefills its prompt and tokens so far again, under the new
            # weights, before its next token.
            self.engine.reset_prefix_cache(reset_running_requests=True)
        self.version = version
        stale = [lane for lane in self.finished if int(lane.versions[lane.versions >= 0].min()) < oldest_allowed]
        self.finished = [lane for lane in self.finished if all(lane is not other for other in stale)]
        dropped = [key for key, lane in self.lanes.items() if self._oldest(lane) < oldest_allowed]
        again = [(lane.key, list(lane.prompt_ids), lane.key[1]) for lane in stale]
        again += [(key, list(self.lanes[key]["prompt_ids"]), key[1]) for key in dropped]
        self._abort(dropped)
        self.requeued += len(again)
        self.pending.extendleft(reversed(again))
        self._fill(per_step)
        while len(self.finished) < per_step:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("vLLM has no request left to decode, and the round is not done")
            self._step()
            self._fill(per_step)
        taken, self.finished = self.finished[:per_step], self.finished[per_step:]
        return taken

    def _oldest(self, lane: dict) -> int:
        drawn = [v for row in lane["rows"] for v in row["versions"]]
        return min(drawn) if drawn else lane["admitted"]

    def _abort(self, keys: list) -> None:
        ids = [rid for rid, (key, _) in self.requests.items() if key in keys]
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            del self.requests[rid]
        for key in keys:
            del self.lanes[key]

    def _fill(self, per_step: int) -> None:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415 - optional, heavy
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        while len(self.lanes) < per_step:
            if not self.pending:
                raise RuntimeError("the queue of prompts ran dry mid-round (it is kept at three steps' worth)")
            key, ids, seed = self.pending.popleft()
            self.lanes[key] = {"order": self.order, "prompt_ids": ids, "admitted": self.version,
                               "rows": [{"tokens": [], "logprobs": [], "versions": [], "ended": False}
                                        for _ in range(self.K)]}
            self.order += 1
            for row in range(self.K):
                params = self.sampler.sampling_params(1, seed, self.settings)
                params.seed += row  # vLLM's seed for the row-th child of a request of K
                params.output_kind = RequestOutputKind.DELTA  # each step's new token alone
                rid = f"partial-{next(self.ids)}"
                self.requests[rid] = (key, row)
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(ids), cache_salt=f"v{self.version}"),
                                        params)

    def _step(self) -> None:
        """One decode step of every request in flight; the groups whose K rows all ended leave, in admission
        order."""
        for output in self.engine.step():
            if output.request_id not in self.requests:
                continue
            key, row = self.requests[output.request_id]
            state = self.lanes[key]["rows"][row]
            sample = output.outputs[0]
            for token, step in zip(sample.token_ids, sample.logprobs or ()):
                state["tokens"].append(int(token))
                state["logprobs"].append(float(step[token].logprob))
                state["versions"].append(self.version)
            if output.finished:
                state["ended"] = True
                del self.requests[output.request_id]
        done = [key for key, lane in self.lanes.items() if all(row["ended"] for row in lane["rows"])]
        for key in done:
            self.finished.append(self._finished(key, self.lanes.pop(key)))

    def _finished(self, key, lane: dict) -> Finished:
        width = max(1, max(len(row["tokens"]) for row in lane["rows"]))
        tokens = torch.full((self.K, width), self.sampler.pad, dtype=torch.long)
        logprobs = torch.zeros(self.K, width)
        versions = torch.full((self.K, width), -1, dtype=torch.long)
        for index, row in enumerate(lane["rows"]):
            length = len(row["tokens"])
            tokens[index, :length] = torch.tensor(row["tokens"], dtype=torch.long)
            logprobs[index, :length] = torch.tensor(row["logprobs"])
            versions[index, :length] = torch.tensor(row["versions"], dtype=torch.long)
        return Finished(key, lane["order"], list(lane["prompt_ids"]), tokens, logprobs, None, versions)

    # --- checkpoints --------------------------------------------------------------------------------------------

    def to_files(self) -> tuple[dict, dict]:
        """The groups done (tensors) and the queue, the groups decoding put back at its front (see the module)."""
        tensors = {}
        for index, lane in enumerate(self.finished):
            for name in ("tokens", "logprobs", "versions"):
                tensors[f"finished/{index}/{name}"] = getattr(lane, name).clone()
        decoding = [[list(key), list(lane["prompt_ids"]), key[1]] for key, lane in self.lanes.items()]
        plain = {"finished": [{"key": list(lane.key), "order": lane.order, "prompt_ids": lane.prompt_ids}
                              for lane in self.finished],
                 "pending": decoding + [[list(key), list(ids), seed] for key, ids, seed in self.pending],
                 "requeued": self.requeued, "version": self.version, "order": self.order}
        return tensors, plain

    def restore(self, tensors: dict, plain: dict) -> None:
        self._abort(list(self.lanes))
        self.finished = [Finished(tuple(lane["key"]), lane["order"], lane["prompt_ids"],
                                  tensors[f"finished/{index}/tokens"], tensors[f"finished/{index}/logprobs"], None,
                                  tensors[f"finished/{index}/versions"])
                         for index, lane in enumerate(plain["finished"])]
        self.pending = deque((tuple(key), list(ids), seed) for key, ids, seed in plain["pending"])
        self.requeued, self.version, self.order = plain["requeued"], plain["version"], plain["order"]
