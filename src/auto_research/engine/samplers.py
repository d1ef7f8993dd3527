"""The rollout engines a run can sample with, by name: one record each, so that no phase of a run compares
``--sampler`` strings. Light: an engine is imported only when its record builds one.

The choices are listed once, here: ``ENGINES`` (--sampler, rollout-serve --engine) and ``ROLLOUT_MODES``
(--rollout-mode); the settings' checks and help texts are made from them. A record is one engine in one mode
(its key ``sampler_key``: ``vllm``, ``vllm-server`` …); a new engine is its ``ENGINES`` line, its records here,
and its module in engine/rollout/.

    record = sampler_record(config.rollout)  # builtin, vllm (colocated), vllm-server, builtin-server, ...
    record.check_settings()                  # before torch: the engine is installed
    sampler = record.build(needs)            # the Sampler (engine/rollout/__init__.py)

A record says what the trainer needs to know of its engine: whether it draws with the trainer's own weights
and kernels (then there is no sampler/trainer mismatch to measure or correct), whether it can run apart from
the trainer while it trains (``--max-staleness`` ≥ 1), and whether it holds weights pushed to it after every
optimizer step (``weight_sync_seconds``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from auto_research.engine.launch import parse_cores
from auto_research.errors import UserError


@dataclass(frozen=True)
class SamplerNeeds:
    """What building an engine may use (each factory takes what it needs of it), not the run's settings."""

    rollout: Any
    """The run's ``RolloutSection``: its engine, server, memory, cores, sync, verbosity."""
    policy: Any
    tokenizer: Any
    settings: Any
    """SamplingSettings."""
    chunk_prompts: int | None
    context: Callable
    """Around sampling from the training model (autocast, FSDP's whole parameters)."""
    model_name: str
    world: Any
    compute_dtype: Any
    device: str
    train_prompts: list[str]
    seed: int
    run_dir: Path
    threads: int | None
    engine_tokens: int
    """The most tokens an engine adds to a prompt, which its context must hold (``GenerationConfig.engine_tokens``)."""
    log: Callable = print


ENGINES = {
    "builtin": "the training model's own decoding loop",
    "vllm": "a vLLM engine, weights pushed after every optimizer step; see --rollout-mode",
}
"""--sampler's choices: the rollout engines (``rollout-serve --engine`` serves those with a server record)."""
ROLLOUT_MODES = {
    "colocate": "in each training process",
    "server": "an engine of its own, started by auto-research rollout-serve; see --rollout-server",
    "process": "--sampler builtin: that server started by the run itself, on --rollout-cores",
}
"""--rollout-mode's choices: where the engine runs."""


def sampler_key(engine: str, mode: str) -> str:
    """The registry's key for an engine in a rollout mode: the engine's name when colocated, else engine-mode."""
    return engine if mode == "colocate" else f"{engine}-{mode}"


@dataclass(frozen=True)
class SamplerRecord:
    engine: str
    """A key of ``ENGINES`` (--sampler)."""
    mode: str
    """A key of ``ROLLOUT_MODES`` (--rollout-mode)."""
    build: Callable[[SamplerNeeds], Any]
    check_settings: Callable[[], None] = lambda: None
    """Before torch: the engine can be imported (one line saying how to install it otherwise)."""
    check_model: Callable[[Any, str, str], None] | None = None
    """(model config, device, model name): a model the engine cannot serve is refused in one line."""
    is_the_trainer: bool = False
    """Draws with the trainer's own weights and kernels: its log-probs are π's, nothing to measure or correct."""
    runs_apart: bool = False
    """Can sample while the trainer trains, with weights of its own (``--max-staleness`` ≥ 1)."""
    pushes_weights: bool = False
    """Holds a copy of the weights, pushed after every optimizer step (timed as ``weight_sync_seconds``)."""
    started_by_the_user: bool = False
    """A server the user started (and restarts after it fails); every other engine is the run's own, started anew
    by ``--resume``."""

    @property
    def name(self) -> str:
        return sampler_key(self.engine, self.mode)


def _builtin(needs: SamplerNeeds):
    from auto_research.engine.rollout.builtin import BuiltinSampler  # noqa: PLC0415

    return BuiltinSampler(needs.policy, needs.tokenizer, needs.settings, needs.chunk_prompts, needs.context)


def _vllm(needs: SamplerNeeds):
    from auto_research.engine.rollout.vllm import VLLMSampler  # noqa: PLC0415 - optional, heavy

    tokenizer = needs.tokenizer
    longest = max(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in needs.train_prompts)
    memory, of_what = vllm_memory(needs.rollout.rollout_memory, needs.device)
    needs.log(f"starting a colocated vLLM engine ({memory:g} of the {of_what})")
    return VLLMSampler(needs.policy, tokenizer, needs.settings, memory, needs.compute_dtype,
                       longest + needs.engine_tokens, needs.seed, verbose=needs.rollout.verbose)


VLLM_MEMORY_GPU = 0.3
"""vLLM's share of a GPU's memory by default, for weights, activations and KV cache: the trainer needs the rest."""
VLLM_MEMORY_CPU = 0.05
"""vLLM's share of host memory for its KV cache by default, on the CPU."""


def vllm_memory(given: float | None, device: str) -> tuple[float, str]:
    """--rollout-memory, else vLLM's share by default on ``device``; and what it is a share of (for the log)."""
    if device == "cpu":
        return given or VLLM_MEMORY_CPU, "host memory for its KV cache"
    return given or VLLM_MEMORY_GPU, "device memory"


def _server(engine: str):
    def build(needs: SamplerNeeds):
        from auto_research.engine.rollout.client import ServerSampler  # noqa: PLC0415
        from auto_research.http import split_addresses  # noqa: PLC0415

        addresses = split_addresses(needs.rollout.rollout_server)
        # The builtin engine draws each chunk as the trainer's own sampler would: the same shapes on any world size.
        chunk = needs.chunk_prompts if engine == "builtin" else None

        def connect(address: str, model):
            # In a fleet a failing server costs one retry, not three: the others draw its groups meanwhile.
            return ServerSampler(model, needs.tokenizer, needs.settings, address, needs.model_name, needs.world,
                                 needs.run_dir, engine=engine, chunk_prompts=chunk,
                                 retries=3 if len(addresses) == 1 else 1, sync=needs.rollout.rollout_sync)

        if len(addresses) == 1:
            sampler = connect(addresses[0], needs.policy)
            needs.log(f"sampling with the {engine} rollout server at {addresses[0]} (the policy's weights pushed to "
                      f"it through {sampler.transfer} in {sampler.weight_sync_seconds:.2f} s)")
            return sampler
        from auto_research.engine.rollout.fleet import Fleet  # noqa: PLC0415

        sampler = Fleet(connect, addresses, needs.policy, needs.world, needs.log, chunk)
        needs.log(f"sampling with {len(addresses)} {engine} rollout servers (the policy's weights pushed to each: "
                  f"{sampler.transfer}; {sampler.weight_sync_seconds:.2f} s)")
        return sampler
    return build


def _builtin_process(needs: SamplerNeeds):
    from auto_research.engine.rollout.process import RolloutProcess  # noqa: PLC0415

    cores = parse_cores(needs.rollout.rollout_cores, set(os.sched_getaffinity(0)))
    sampler = RolloutProcess(needs, cores)
    needs.log(f"sampling with a builtin rollout process on CPU(s) {sorted(cores)}, the trainer on "
              f"{sorted(sampler.trainer_cores)} (the policy's weights pushed to it through {sampler.transfer})")
    return sampler


def _require_vllm() -> None:
    from auto_research.engine.sources import require_vllm  # noqa: PLC0415

    require_vllm()


def _check_servable(model_config, device: str, model_name: str) -> None:
    from auto_research.engine.rollout.vllm import check_servable  # noqa: PLC0415 - imports no vLLM

    check_servable(model_config, device, model_name)


SAMPLERS: dict[str, SamplerRecord] = {}


def register(record: SamplerRecord) -> SamplerRecord:
    if record.engine not in ENGINES or record.mode not in ROLLOUT_MODES:
        raise ValueError(f"sampler {record.name!r}: its engine is one of {', '.join(ENGINES)}, its mode one of "
                         f"{', '.join(ROLLOUT_MODES)}")
    if record.name in SAMPLERS:
        raise ValueError(f"sampler {record.name!r} is registered twice")
    SAMPLERS[record.name] = record
    return record


def served_engines() -> tuple[str, ...]:
    """The engines ``rollout-serve --engine`` serves: those with a record in server mode."""
    return tuple(record.engine for record in SAMPLERS.values() if record.mode == "server")


register(SamplerRecord("builtin", "colocate", _builtin, is_the_trainer=True, runs_apart=True))
register(SamplerRecord("vllm", "colocate", _vllm, _require_vllm, _check_servable, pushes_weights=True))
# A server may live in an environment of its own: the trainer needs no vLLM.
register(SamplerRecord("vllm", "server", _server("vllm"), runs_apart=True, pushes_weights=True,
                       started_by_the_user=True))
# The builtin sampler in a process of its own (auto-research rollout-serve --engine builtin): its draws are the
# in-process sampler's, from weights pushed to it, without sharing the trainer's interpreter lock.
register(SamplerRecord("builtin", "server", _server("builtin"), runs_apart=True, pushes_weights=True,
                       started_by_the_user=True))
# The same server, started and stopped by the run itself on cores of its own (--rollout-mode process).
register(SamplerRecord("builtin", "process", _builtin_process, runs_apart=True, pushes_weights=True))


def sampler_name(rollout) -> str:
    """The registry's key for a run's --sampler and --rollout-mode (``rollout``: its rollout section)."""
    return sampler_key(rollout.sampler, rollout.rollout_mode)


def sampler_record(rollout) -> SamplerRecord:
    name = sampler_name(rollout)
    if name not in SAMPLERS:
        raise UserError(f"--sampler {rollout.sampler} --rollout-mode {rollout.rollout_mode}: no such rollout engine "
                        f"(there are {', '.join(SAMPLERS)})")
    return SAMPLERS[name]
