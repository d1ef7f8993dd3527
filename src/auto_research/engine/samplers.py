"""The rollout engines a run can sample with, by name: one record each (one engine in one mode, its key
``sampler_key``: ``vllm``, ``vllm-server`` …), so that no phase of a run compares ``--sampler`` strings. Light: an
engine is imported only when its record builds one.

The choices are listed once, here: ``ENGINES`` and ``ROLLOUT_MODES``; the settings' checks and help texts are made
from them. A new engine is its records, ``register``-ed from a function named in ``AUTO_RESEARCH_ENGINES``
(docs/architecture.md, "Adding an engine").

    record = sampler_record(config.rollout)  # builtin, vllm (colocated), vllm-server, builtin-server, ...
    record.check_settings()                  # before torch: the engine is installed
    sampler = record.build(needs)            # the Sampler (engine/rollout/__init__.py)
"""

from __future__ import annotations

import importlib
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
    pushes_weights: bool = False
    """Holds a copy of the weights, pushed after every optimizer step (timed as ``weight_sync_seconds``)."""
    started_by_the_user: bool = False
    """A server the user started (and restarts after it fails); every other engine is the run's own, started anew
    by ``--resume``."""
    over_model: Callable | None = None
    """(model, tokenizer, settings, chunk_prompts, context) → the engine drawing from that model in this process: a
    side in flight (--max-staleness ≥ 1) draws with it from its own copy of the policy (``train/schedule.py``)."""
    pool: Callable | None = None
    """(model, tokenizer, group_size, settings) → its continuous batch over that model (a ``rollout/partial.Pool``),
    for --in-flight-updates in this process; in a server, the served engine's ``rounds`` (``partial_serve.py``)."""
    serve: Callable | None = None
    """A server record's: (rollout-serve's settings, device, log) → the served engine, its model, tokenizer, name and
    dtype (``rollout/serve.py``)."""

    @property
    def name(self) -> str:
        return sampler_key(self.engine, self.mode)

    @property
    def runs_apart(self) -> bool:
        """Can sample while the trainer trains, with weights of its own (``--max-staleness`` ≥ 1): a server, or a
        colocated engine that draws from a copy of the policy."""
        return self.mode != "colocate" or self.over_model is not None


def on_the_policy(over_model: Callable) -> Callable[[SamplerNeeds], Any]:
    """A colocated record's ``build`` from its ``over_model``: the engine drawing from the trainer's own policy."""
    return lambda needs: over_model(needs.policy, needs.tokenizer, needs.settings, needs.chunk_prompts, needs.context)


def _lazy(module: str, name: str) -> Callable:
    """``module.name``, imported only when called: this module stays light until an engine is used."""
    return lambda *args, **kwargs: getattr(importlib.import_module(module), name)(*args, **kwargs)


_builtin_over = _lazy("auto_research.engine.rollout.builtin", "BuiltinSampler")
_builtin_pool = _lazy("auto_research.engine.rollout.partial", "builtin_pool")


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


def server_record(engine: str, serve: Callable, chunked: bool = False) -> SamplerRecord:
    """``engine`` in its own process, started by ``auto-research rollout-serve --engine ENGINE`` (``serve``); the
    run's client pushes it the weights after every step. ``chunked``: it draws each chunk of prompts as the trainer's
    own sampler would (the builtin engine: the same shapes on any world size)."""
    return SamplerRecord(engine, "server", _server(engine, chunked), pushes_weights=True, started_by_the_user=True,
                         serve=serve)


def _server(engine: str, chunked: bool):
    def build(needs: SamplerNeeds):
        from auto_research.engine.rollout.client import ServerSampler  # noqa: PLC0415
        from auto_research.http import split_addresses  # noqa: PLC0415

        addresses = split_addresses(needs.rollout.rollout_server)
        chunk = needs.chunk_prompts if chunked else None

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


def _serve_vllm(options, device: str, log):
    """A vLLM engine over rollout-serve's model (``options``: its ``ServeConfig``), its parallelism checked before
    the model loads."""
    from auto_research.engine.models import resolve_dtype  # noqa: PLC0415
    from auto_research.engine.rollout import SamplingSettings  # noqa: PLC0415
    from auto_research.engine.rollout.serve import served_model  # noqa: PLC0415
    from auto_research.engine.rollout.vllm import VLLMSampler, check_parallel, check_servable  # noqa: PLC0415

    check_parallel(device, options.tensor_parallel_size, options.data_parallel_size)
    model, tokenizer, name, longest = served_model(options, device, log)
    check_servable(model.config, device, name, "rollout-serve",
                   "serve it from a GPU, with --engine builtin, or train with --sampler builtin")
    memory, of_what = vllm_memory(options.rollout_memory, device)
    dtype = resolve_dtype(options.dtype, device)
    split = ""
    if options.tensor_parallel_size > 1:
        split += f", tensor parallel {options.tensor_parallel_size}"
        split += f" over CPUs {os.environ['VLLM_CPU_OMP_THREADS_BIND']}" if device == "cpu" else ""
    if options.enable_lora:
        split += f", LoRA adapters up to rank {options.max_lora_rank}"
    log(f"starting a vLLM engine for {name} ({memory:g} of the {of_what}, max_model_len {longest}{split})")
    sampler = VLLMSampler(model, tokenizer, SamplingSettings(max_new_tokens=16), memory, dtype, longest,
                          options.seed, parallel=(options.tensor_parallel_size, options.data_parallel_size),
                          lora_rank=options.max_lora_rank if options.enable_lora else None)
    return sampler, model, tokenizer, name, dtype


SAMPLERS: dict[str, SamplerRecord] = {}


def register(record: SamplerRecord, about: str | None = None) -> SamplerRecord:
    """``record`` under its key; ``about``: a new engine's line in ``ENGINES``. The same record again changes
    nothing (a registering function may be called once per command, ``user_code.call_registrations``)."""
    if (record.engine not in ENGINES and about is None) or record.mode not in ROLLOUT_MODES:
        raise ValueError(f"sampler {record.name!r}: its engine is one of {', '.join(ENGINES)} (or given with its "
                         f"line), its mode one of {', '.join(ROLLOUT_MODES)}")
    if SAMPLERS.setdefault(record.name, record) != record:
        raise ValueError(f"sampler {record.name!r} is registered twice")
    ENGINES.setdefault(record.engine, about)
    return record


def served_engines() -> tuple[str, ...]:
    """The engines ``rollout-serve --engine`` serves: those with a record in server mode that says how."""
    return tuple(record.engine for record in SAMPLERS.values() if record.mode == "server" and record.serve)


register(SamplerRecord("builtin", "colocate", on_the_policy(_builtin_over), is_the_trainer=True,
                       over_model=_builtin_over, pool=_builtin_pool))
register(SamplerRecord("vllm", "colocate", _vllm, _lazy("auto_research.engine.sources", "require_vllm"),
                       _lazy("auto_research.engine.rollout.vllm", "check_servable"), pushes_weights=True))
# A server may live in an environment of its own: the trainer needs no vLLM.
register(server_record("vllm", _serve_vllm))
# The builtin sampler in a process of its own (auto-research rollout-serve --engine builtin): its draws are the
# in-process sampler's, from weights pushed to it, without sharing the trainer's interpreter lock.
register(server_record("builtin", _lazy("auto_research.engine.rollout.serve", "serve_builtin"), chunked=True))
# The same server, started and stopped by the run itself on cores of its own (--rollout-mode process).
register(SamplerRecord("builtin", "process", _builtin_process, pushes_weights=True))


def sampler_name(rollout) -> str:
    """The registry's key for a run's --sampler and --rollout-mode (``rollout``: its rollout section)."""
    return sampler_key(rollout.sampler, rollout.rollout_mode)


def sampler_record(rollout) -> SamplerRecord:
    name = sampler_name(rollout)
    if name not in SAMPLERS:
        raise UserError(f"--sampler {rollout.sampler} --rollout-mode {rollout.rollout_mode}: no such rollout engine "
                        f"(there are {', '.join(SAMPLERS)})")
    return SAMPLERS[name]
