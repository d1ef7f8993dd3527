"""The rollout section of a generation-level run: which engine samples, where it runs, how stale its batches may
be and how its draws are corrected. Before torch: nothing here imports an engine."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from auto_research.algorithms.registry import ROLLOUT_CORRECTIONS
from auto_research.config.fields import check_choice, check_positive_finite, setting
from auto_research.config.loss import by_algorithm
from auto_research.engine.launch import environment_world_size, parse_cores
from auto_research.engine.partial_bounds import MAX_IN_FLIGHT_POOL
from auto_research.engine.samplers import ENGINES, ROLLOUT_MODES, VLLM_MEMORY_CPU, VLLM_MEMORY_GPU, sampler_record
from auto_research.errors import UserError

SYNC_PATHS = ("auto", "shared-memory", "collective", "http")
"""--rollout-sync's choices (``engine/rollout/links.py``: ``LINKS``, and auto)."""


@dataclass(frozen=True)
class RolloutSection:
    """The rollout side: its engine (--sampler) and where it runs (--rollout-mode), how stale a batch may be, the
    correction of the sampler's distribution to the trainer's and its bounds, and how much the engine says."""

    sampler: str = setting("builtin", " or ".join(f"{name} ({text})" for name, text in ENGINES.items()), "sampling")
    rollout_mode: str = setting("colocate", "where the rollout engine runs: " + ", ".join(
                                    f"{name} ({text})" for name, text in ROLLOUT_MODES.items()), "sampling",
                                flag="--rollout-mode", aliases=("--vllm-mode",))
    rollout_server: str | None = setting(None, "HOST:PORT of the rollout server (--rollout-mode server); several "
                                               "servers as HOST:PORT,HOST:PORT or a file of addresses, one a line: "
                                               "the step's groups are spread over them, a server that fails leaves "
                                               "the pool (docs/scaling-out.md)", "sampling",
                                         flag="--rollout-server", aliases=("--vllm-server",))
    rollout_memory: float | None = setting(None, "on a GPU, the share of its memory vLLM may take for weights, "
                                                 f"activations and KV cache (default {VLLM_MEMORY_GPU}; the trainer needs "
                                                 "the rest); on the CPU, the share of host memory for its KV cache "
                                                 f"(default {VLLM_MEMORY_CPU})",
                                           "sampling", flag="--rollout-memory", aliases=("--vllm-memory",), type=float)
    rollout_sync: str = setting("auto", "how the policy's weights reach a rollout server (--rollout-mode server or "
                                        "process): auto (the server's shared-memory buffer on this host, a "
                                        "torch.distributed group with a server on another host (NCCL between GPUs, "
                                        "else gloo), else HTTP), "
                                        "shared-memory, collective or http", "sampling")
    rollout_cores: str | None = setting(None, "CPUs of the rollout process (--rollout-mode process), e.g. 1 or 2-3; "
                                              "the trainer keeps the others", "sampling",
                                        default_text="the last core")
    rollout_correction: str | None = setting(None, "correct for the sampler's distribution differing from the "
                                                   f"trainer's: {', '.join(ROLLOUT_CORRECTIONS)} (default: the "
                                                   "algorithm's, "
                                                   f"{by_algorithm('rollout_correction', ROLLOUT_CORRECTIONS)}; "
                                                   "the identity with --sampler builtin)", "sampling")
    rollout_correction_cap: float = setting(2.0, "C of the truncated importance weight min(w, C); sequence-mask "
                                                 "drops completions whose weight is above C or below 1/C",
                                            "sampling", type=float)
    max_rollout_mismatch: float = setting(1.0, "stop the run, before it trains on a batch, when the sampler's "
                                               "log-probs are further than this from the trainer's, in nats a token "
                                               "on average (rollout_logprob_diff_mean; another engine or stale "
                                               "weights only): healthy runs measured 1e-5 to 0.15, a sampler with "
                                               "broken weights 4.3 (docs/vllm.md)", "sampling", type=float)
    max_staleness: int = setting(0, "K: train on batches drawn by weights up to K steps older than the policy being "
                                    "updated, the rollout side sampling in a thread of its own while the trainer "
                                    "trains (step s is drawn by weights version max(0, s − 1 − K)); 0 = sample, then "
                                    "train (docs/async.md)", "sampling", type=int)
    in_flight_updates: bool = setting(False, "with --max-staleness K >= 1, the builtin sampler (in this process, a "
                                              "rollout process or rollout servers) or vLLM rollout servers decode "
                                              "a continuous batch and take new weights between two decode steps: a "
                                              "group not finished when its step is due goes on under the next "
                                              "weights (partial rollouts), each token keeps the version that drew "
                                              "it and is corrected against it; a token older than K versions sends "
                                              "its group back to be drawn again (docs/async.md)", "sampling",
                                      action="store_true")
    in_flight_pool: float = setting(1.0, "with --in-flight-updates, decode F times the step's groups at once (1 to 4; "
                                         "1: the batch's rows): each step takes the groups that finish first, so "
                                         "the rows a long completion holds are not the batch's, at the cost of a "
                                         "batch that leans to shorter completions and more groups drawn again for "
                                         "growing older than K (docs/async.md)", "sampling", type=float)
    recompute_kv_on_update: bool = setting(False, "with --in-flight-updates, recompute the KV cache of the rows in "
                                                  "flight under the new weights at each update (default: keep it, "
                                                  "as the peers do)", "sampling", action="store_true")
    verbose: bool = setting(False, "show everything the engines print: vLLM's INFO lines and the known-harmless "
                                   "warnings hidden otherwise (docs/vllm.md); and the whole traceback of an error "
                                   "raised in your code (a reward, a judge)", "run", action="store_true")

    def check(self) -> None:
        check_choice("--sampler", self.sampler, ENGINES)  # engine/samplers.py lists them, a registered one too
        check_choice("--rollout-mode", self.rollout_mode, ROLLOUT_MODES)
        check_choice("--rollout-correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_positive_finite("--rollout-correction-cap", self.rollout_correction_cap)
        check_positive_finite("--max-rollout-mismatch", self.max_rollout_mismatch)
        if self.rollout_correction_cap < 1:
            raise UserError(f"--rollout-correction-cap must be >= 1 (a weight truncated below 1 down-weights every "
                            f"sample), got {self.rollout_correction_cap}")
        self._check_engine()
        if self.max_staleness < 0:
            raise UserError(f"--max-staleness must be >= 0 (0: sample, then train), got {self.max_staleness}")

    def _check_engine(self) -> None:
        """Where the rollout engine runs (--rollout-mode, --rollout-server, --rollout-memory, --rollout-cores)."""
        if self.rollout_memory is not None:
            if not (math.isfinite(self.rollout_memory) and 0 < self.rollout_memory <= 1):
                raise UserError(f"--rollout-memory must be in (0, 1], got {self.rollout_memory}")
            if self.rollout_mode == "server":
                raise UserError("--rollout-memory is the colocated engine's; give it to auto-research rollout-serve")
            if self.sampler != "vllm":
                raise UserError("--rollout-memory is vLLM's (--sampler vllm)")
        if self.rollout_mode == "server":
            if self.rollout_server is None:
                raise UserError(f"--rollout-mode server needs --rollout-server HOST:PORT (start a server with "
                                f"auto-research rollout-serve --engine {self.sampler} --model M --port 8000)")
            from auto_research.http import split_addresses  # noqa: PLC0415

            split_addresses(self.rollout_server)
        elif self.rollout_server is not None:
            raise UserError("--rollout-server is for --rollout-mode server")
        check_choice("--rollout-sync", self.rollout_sync, SYNC_PATHS)
        if self.rollout_sync != "auto" and self.rollout_mode == "colocate":
            raise UserError(f"--rollout-sync {self.rollout_sync} is for a rollout server (--rollout-mode server or "
                            "process)")
        if self.rollout_mode == "process":
            if self.sampler != "builtin":
                raise UserError("--rollout-mode process starts the builtin sampler's server; for vLLM start "
                                "auto-research rollout-serve and use --rollout-mode server")
            parse_cores(self.rollout_cores, set(os.sched_getaffinity(0)))
        elif self.rollout_cores is not None:
            raise UserError("--rollout-cores is for --rollout-mode process")

    def _check_in_flight(self, algorithm) -> None:
        """--in-flight-updates and --recompute-kv-on-update against K, the engine and the algorithm."""
        if self.recompute_kv_on_update and not self.in_flight_updates:
            raise UserError("--recompute-kv-on-update is for --in-flight-updates")
        if not (math.isfinite(self.in_flight_pool) and 1 <= self.in_flight_pool <= MAX_IN_FLIGHT_POOL):
            raise UserError(f"--in-flight-pool must be a number from 1 to {MAX_IN_FLIGHT_POOL} (times the step's "
                            f"groups), got {self.in_flight_pool}")
        if self.in_flight_pool != 1 and not self.in_flight_updates:
            raise UserError("--in-flight-pool is for --in-flight-updates")
        if not self.in_flight_updates:
            return
        if not self.max_staleness:
            raise UserError("--in-flight-updates needs --max-staleness K >= 1 (weights change while the rollout side "
                            "draws; K bounds how old a trained token may be)")
        if self.rollout_mode == "colocate" and sampler_record(self).pool is None:
            raise UserError(f"--in-flight-updates with --sampler {self.sampler} needs --rollout-mode server (auto-research "
                            f"rollout-serve --engine {self.sampler}): its colocated engine is not wired to partial "
                            "rollouts (docs/async.md)")
        if environment_world_size() > 1 and self.rollout_mode != "server":
            raise UserError("--in-flight-updates under torchrun needs rollout servers (--rollout-mode server): in "
                            "the trainers' own processes each rank's continuous batch would finish its groups in its "
                            "own order, so the run's rows would depend on how many processes ran it")
        if algorithm.needs_greedy:
            raise UserError(f"--in-flight-updates with {algorithm.name} is not built (its greedy baseline would be "
                            "drawn by weights other than its samples')")

    def check_staleness(self, steps: int | None, algorithm, fsdp: bool) -> None:
        """--max-staleness K against the engine, the run's steps, its algorithm (``algorithm``: the record) and
        FSDP."""
        from auto_research.engine.samplers import SAMPLERS, sampler_name  # noqa: PLC0415

        K = self.max_staleness
        self._check_in_flight(algorithm)
        if not K:
            return
        if not sampler_record(self).runs_apart:
            apart = [name for name, record in SAMPLERS.items() if record.runs_apart]
            raise UserError(f"--max-staleness {K}: the {sampler_name(self)} sampler cannot run apart from the "
                            f"trainer; samplers that can: {', '.join(apart)} (or --max-staleness 0)")
        if steps is not None and K >= steps:
            raise UserError(f"--max-staleness {K} must be below --steps {steps} (step s trains on a batch drawn "
                            f"by the weights of step s − 1 − K)")
        if sampler_record(self).pushes_weights and algorithm.needs_greedy:
            raise UserError(f"--max-staleness {K} with {algorithm.name} and a rollout server is not built (its greedy "
                            "baseline would sample from the weights being trained)")
        if fsdp:
            raise UserError(f"--max-staleness {K} with --fsdp is not built (the rollout side's copy of the weights "
                            "would gather every shard); use DDP (without --fsdp) or --max-staleness 0")
