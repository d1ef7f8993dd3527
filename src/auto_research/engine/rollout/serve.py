"""``auto-research rollout-serve``: one engine (vLLM, the builtin sampler, or one registered: its server record's
``serve``) loaded and served over HTTP until interrupted (``server.py`` is the server and its protocol)."""

from __future__ import annotations

import signal

import torch

from auto_research.engine.rollout.guard import weight_spec
from auto_research.engine.rollout.remote import pushed_weights
from auto_research.engine.rollout.server import Limits, Served, fingerprint, make_server, vocabulary
from auto_research.http import API_KEY_VARIABLE, is_loopback, server_key


def serve(config, start, log=print) -> None:
    """Load the model, start the engine (``start``: its record's ``serve``), answer until interrupted."""
    api_key = server_key(config.api_key_file)
    if api_key is None and not is_loopback(config.host):
        log(f"warning: serving on {config.host}, beyond this machine, without an API key: anyone who reaches the "
            f"port can sample from the model and, while no trainer holds the lease, replace its weights; set "
            f"{API_KEY_VARIABLE} here and for the trainer")
    sampler, served = start_engine(config, start, log)
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


def start_engine(config, start, log) -> tuple[object, Served]:
    """``config``'s model in its engine (``start``), and what the server knows of it."""
    from auto_research.engine.models import resolve_device

    device = resolve_device(config.device)
    sampler, model, tokenizer, name, dtype = start(config, device, log)
    return sampler, Served(name, fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, dtype)),
                           int(model.config.vocab_size), str(dtype).removeprefix("torch."), str(device),
                           vocabulary(tokenizer))


def served_model(config, device: str, log) -> tuple:
    """``config``'s model (the embedded one without --model) in float32, its tokenizer, its name and the longest
    prompt + completion served."""
    from auto_research.engine.models import context_length, load_policy

    if config.model is None:
        from auto_research.engine.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model, name = build_model(tokenizer, seed=0), "embedded"
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        model, tokenizer = load_policy(config.model, device, torch.float32, config.offline, log=log)
        name = config.model
    return model, tokenizer, name, config.max_model_len or min(context_length(model) or 4096, 4096)


def serve_builtin(config, device: str, log, engine=None) -> tuple:
    """The builtin sampler (``engine``: a ``BuiltinEngine`` class, by default that one) over ``config``'s model, in
    fp32 with the trainer's own kernels: its draws are the builtin sampler's in the trainer's process."""
    from auto_research.engine.rollout.builtin import BuiltinEngine

    model, tokenizer, name, longest = served_model(config, device, log)
    log(f"starting the builtin sampler for {name} on {device} (max_model_len {longest})")
    sampler = (engine or BuiltinEngine)(model.to(device), tokenizer)
    sampler.max_model_len = min(sampler.max_model_len, longest)
    return sampler, model, tokenizer, name, torch.float32


def _interrupt(*_) -> None:
    raise KeyboardInterrupt

