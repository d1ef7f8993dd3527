"""The rollout side's settings of a run (``GenerationConfig``): where its engine runs and how stale its batches
may be. Before torch: nothing here imports an engine."""

from __future__ import annotations

import math
import os

from auto_research.algorithms.registry import get_algorithm
from auto_research.engine.launch import parse_cores
from auto_research.engine.temperature import MIN_TEMPERATURE, temperature_problem
from auto_research.errors import UserError


def check_temperature(value: float) -> None:
    """A run's --temperature: a sampling temperature (``temperature_problem``), and not 0: greedy decoding draws
    a prompt's K completions alike, so no group would carry a signal to train on."""
    problem = temperature_problem(value)
    if problem is None and value == 0:
        problem = ("0 is greedy decoding: a prompt's K completions would be identical and no group would carry a "
                   f"signal to train on; sample at a temperature >= {MIN_TEMPERATURE:g}")
    if problem is not None:
        raise UserError(f"--temperature {problem}")


def check_rollout_engine(config) -> None:
    """Where the rollout engine runs (--rollout-mode, --rollout-server, --rollout-memory, --rollout-cores)."""
    if config.vllm_memory is not None:
        if not (math.isfinite(config.vllm_memory) and 0 < config.vllm_memory <= 1):
            raise UserError(f"--rollout-memory must be in (0, 1], got {config.vllm_memory}")
        if config.vllm_mode == "server":
            raise UserError("--rollout-memory is the colocated engine's; give it to auto-research rollout-serve")
        if config.sampler != "vllm":
            raise UserError("--rollout-memory is vLLM's (--sampler vllm)")
    if config.vllm_mode == "server":
        if config.vllm_server is None:
            raise UserError(f"--rollout-mode server needs --rollout-server HOST:PORT (start a server with "
                            f"auto-research rollout-serve --engine {config.sampler} --model M --port 8000)")
        from auto_research.engine.rollout.server import split_address

        split_address(config.vllm_server)
    elif config.vllm_server is not None:
        raise UserError("--rollout-server is for --rollout-mode server")
    if config.vllm_mode == "process":
        if config.sampler != "builtin":
            raise UserError("--rollout-mode process starts the builtin sampler's server; for vLLM start "
                            "auto-research rollout-serve and use --rollout-mode server")
        parse_cores(config.rollout_cores, set(os.sched_getaffinity(0)))
    elif config.rollout_cores is not None:
        raise UserError("--rollout-cores is for --rollout-mode process")

def check_staleness(config) -> None:
    """--max-staleness K against the sampler, the steps, the algorithm and FSDP."""
    from auto_research.engine.samplers import SAMPLERS, sampler_name, sampler_record

    K = config.max_staleness
    if K < 0:
        raise UserError(f"--max-staleness must be >= 0 (0: sample, then train), got {K}")
    if not K:
        return
    if not sampler_record(config).runs_apart:
        apart = [name for name, record in SAMPLERS.items() if record.runs_apart]
        raise UserError(f"--max-staleness {K}: the {sampler_name(config)} sampler cannot run apart from the trainer; "
                        f"samplers that can: {', '.join(apart)} (or --max-staleness 0)")
    if config.steps is not None and K >= config.steps:
        raise UserError(f"--max-staleness {K} must be below --steps {config.steps} (step s trains on a batch drawn "
                        f"by the weights of step s − 1 − K)")
    if sampler_record(config).pushes_weights and get_algorithm(config.algorithm).needs_greedy:
        raise UserError(f"--max-staleness {K} with {config.algorithm} and a rollout server is not built (its greedy "
                        "baseline would sample from the weights being trained)")
    if config.fsdp:
        raise UserError(f"--max-staleness {K} with --fsdp is not built (the rollout side's copy of the weights "
                        "would gather every shard); use DDP (without --fsdp) or --max-staleness 0")
