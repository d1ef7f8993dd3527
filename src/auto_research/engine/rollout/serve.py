"""``auto-research rollout-serve``: one engine (vLLM, or the builtin sampler) loaded and served over HTTP until
interrupted (``server.py`` is the server and its protocol)."""

from __future__ import annotations

import os
import signal

import torch

from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.guard import weight_spec
from auto_research.engine.rollout.remote import pushed_weights
from auto_research.engine.rollout.server import Limits, Served, fingerprint, make_server, vocabulary
from auto_research.http import API_KEY_VARIABLE, is_loopback, server_key
from auto_research.engine.samplers import vllm_memory


def serve(config, log=print) -> None:
    """``auto-research rollout-serve``: load the model, start the engine (vLLM or the builtin sampler), answer
    until interrupted."""
    api_key = server_key(config.api_key_file)
    if api_key is None and not is_loopback(config.host):
        log(f"warning: serving on {config.host}, beyond this machine, without an API key: anyone who reaches the "
            f"port can sample from the model and, while no trainer holds the lease, replace its weights; set "
            f"{API_KEY_VARIABLE} here and for the trainer")
    sampler, served = start_engine(config, log)
    limits = Limits(api_key, config.lease_seconds, config.read_timeout, config.max_group_size,
                    max_request_tokens=config.max_request_tokens, max_server_tokens=config.max_server_tokens)
    server = make_server(sampler, served, config.host, config.port, limits, log)
    log(f"serving {served.name} on http://{config.host}:{server.server_address[1]} "
        f"({'API key required, ' if api_key else ''}a trainer's lease lapses {config.lease_seconds:g} s after its "
        "last renewal; Ctrl-C stops)")
    signal.signal(signal.SIGTERM, _interrupt)  # a plain kill stops it as Ctrl-C does: its shared buffer goes
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.intake.close()
        server.server_close()


def start_engine(config, log) -> tuple[object, Served]:
    """``config``'s model in its engine (vLLM or the builtin sampler), and what the server knows of it."""
    from auto_research.engine.models import context_length, load_policy, resolve_device, resolve_dtype

    device = resolve_device(config.device)
    if config.engine == "vllm":
        from auto_research.engine.rollout.vllm import check_parallel

        check_parallel(device, config.tensor_parallel_size, config.data_parallel_size)
    if config.model is None:
        from auto_research.engine.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model, name = build_model(tokenizer, seed=0), "embedded"
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        model, tokenizer = load_policy(config.model, device, torch.float32, config.offline, log=log)
        name = config.model
    longest = config.max_model_len or min(context_length(model) or 4096, 4096)
    if config.engine == "builtin":
        from auto_research.engine.rollout.builtin import BuiltinEngine

        # fp32, the trainer's own kernels: its draws are the builtin sampler's in the trainer's process.
        dtype = torch.float32
        log(f"starting the builtin sampler for {name} on {device} (max_model_len {longest})")
        sampler = BuiltinEngine(model.to(device), tokenizer)
        sampler.max_model_len = min(sampler.max_model_len, longest)
    else:
        from auto_research.engine.rollout.vllm import VLLMSampler, check_servable

        check_servable(model.config, device, name, "rollout-serve",
                       "serve it from a GPU, with --engine builtin, or train with --sampler builtin")
        memory, of_what = vllm_memory(config.rollout_memory, device)
        dtype = resolve_dtype(config.dtype, device)
        split = ""
        if config.tensor_parallel_size > 1:
            split += f", tensor parallel {config.tensor_parallel_size}"
            split += f" over CPUs {os.environ['VLLM_CPU_OMP_THREADS_BIND']}" if device == "cpu" else ""
        if config.enable_lora:
            split += f", LoRA adapters up to rank {config.max_lora_rank}"
        log(f"starting a vLLM engine for {name} ({memory:g} of the {of_what}, max_model_len {longest}{split})")
        sampler = VLLMSampler(model, tokenizer, SamplingSettings(max_new_tokens=16), memory, dtype, longest,
                              config.seed, parallel=(config.tensor_parallel_size, config.data_parallel_size),
                              lora_rank=config.max_lora_rank if config.enable_lora else None)
    return sampler, Served(name, fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, dtype)),
                           int(model.config.vocab_size), str(dtype).removeprefix("torch."), str(device),
                           vocabulary(tokenizer))


def _interrupt(*_) -> None:
    raise KeyboardInterrupt

