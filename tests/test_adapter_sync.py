"""LoRA adapter-only sync (``POST /weights/adapter``): a LoRA run pushes its base weights to a builtin server once,
then only its adapter, which the server merges as PEFT does; the draws are those of merged pushes, for a fraction of
the bytes. The server refuses a malformed adapter and keeps its weights."""

from __future__ import annotations

import json

import pytest
import torch

from auto_research.engine.rollout import SamplingSettings, prompt_seed
from auto_research.engine.tiny import build_model, build_tokenizer
from tests.conftest import largest_difference, rms_difference
from tests.test_builtin_server import PROMPTS, start_builtin_server, stop

SETTINGS = SamplingSettings(max_new_tokens=6, temperature=1.1)


def lora_policy(seed: int = 1):
    """The embedded architecture with rank-4 adapters on every linear layer, B made non-zero (PEFT starts it at 0,
    where an adapter changes nothing)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model(build_tokenizer(), seed=seed),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    nudge(model, 0.05)
    return model


def nudge(model, amount: float) -> None:
    """What an optimizer step does to a LoRA policy: its adapters move, its base weights do not."""
    generator = torch.Generator().manual_seed(int(amount * 1000))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                parameter.add_(amount * torch.randn(parameter.shape, generator=generator))


@pytest.fixture
def two_servers(monkeypatch):
    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    started = [start_builtin_server() for _ in range(2)]
    yield [(engine, f"127.0.0.1:{server.server_address[1]}") for server, engine in started]
    for server, _ in started:
        stop(server)


def _client(model, address, tmp_path, adapters: bool = True):
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.client import ServerSampler

    client = ServerSampler(model, build_tokenizer(), SETTINGS, address, "embedded", World(), tmp_path,
                           engine="builtin", chunk_prompts=2)
    if not adapters:  # as a server that merges no adapters: merged weights every time
        client.adapters = False
        client.load_weights(model)
    return client


def _merged(model) -> dict:
    from auto_research.engine.rollout.remote import pushed_weights

    return dict(pushed_weights(model, torch.float32))


def test_adapter_pushes_give_the_draws_and_weights_of_merged_pushes_for_a_fraction_of_the_bytes(two_servers,
                                                                                              tmp_path):
    (adapter_engine, adapter_address), (merged_engine, merged_address) = two_servers
    policy = lora_policy()
    by_adapter = _client(policy, adapter_address, tmp_path / "a")
    by_merge = _client(policy, merged_address, tmp_path / "m", adapters=False)
    assert by_adapter.adapters and by_adapter.base_pushed
    for step in (1, 2, 3):
        nudge(policy, 0.01 * step)
        by_adapter.load_weights(policy)
        by_merge.load_weights(policy)
        for name, tensor in _merged(policy).items():  # PEFT's merge, done by the server: the same floats
            assert torch.allclose(adapter_engine.parameters[name], tensor, atol=1e-6, rtol=0), name
            assert torch.equal(merged_engine.parameters[name], tensor), name
        seeds = [prompt_seed(3, step, index) for index in range(len(PROMPTS))]
        ours, theirs = by_adapter.sample(PROMPTS, 3, seeds), by_merge.sample(PROMPTS, 3, seeds)
        assert ours.token_lists() == theirs.token_lists()
        assert torch.allclose(ours.sampler_logprobs, theirs.sampler_logprobs, atol=1e-5, rtol=0)
    factors = sum(parameter.numel() * 4 for name, parameter in policy.named_parameters() if ".lora_" in name)
    adapted = sum(1 for name, _ in policy.named_parameters() if ".lora_A." in name)
    assert by_adapter.pushed_bytes == factors + 8 * adapted  # A and B in float32, one float64 scaling each
    assert by_merge.pushed_bytes == sum(t.numel() * 4 for t in _merged(policy).values())
    assert by_adapter.pushed_bytes < by_merge.pushed_bytes / 2
    by_adapter.close()
    by_merge.close()


def test_a_full_push_after_adapters_sets_the_base_they_merge_onto(two_servers, tmp_path):
    """A resumed run (a new client) pushes the base weights again: the adapter that follows merges onto them, not
    onto the weights the last adapter left."""
    (engine, address), _ = two_servers
    policy = lora_policy()
    first = _client(policy, address, tmp_path)
    nudge(policy, 0.02)
    first.load_weights(policy)
    first.close()
    other = lora_policy(seed=2)  # other base weights
    second = _client(other, address, tmp_path)
    for name, tensor in _merged(other).items():
        assert torch.allclose(engine.parameters[name], tensor, atol=1e-6, rtol=0), name
    second.close()


def _post(address, lease, body: bytes) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    sent = urllib.request.Request(f"http://{address}/weights/adapter", data=body,
                                  headers={"Content-Type": "application/octet-stream", "X-Lease": lease})
    try:
        with urllib.request.urlopen(sent, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


def test_a_malformed_adapter_is_refused_and_the_weights_stay(two_servers, tmp_path):
    from safetensors.torch import save

    from auto_research.engine.rollout.remote import adapter_factors

    (engine, address), _ = two_servers
    policy = lora_policy()
    client = _client(policy, address, tmp_path)
    before = {name: tensor.clone() for name, tensor in engine.parameters.items()}
    good = adapter_factors(policy)
    weight = "model.layers.0.self_attn.q_proj.weight"
    A, B = good[f"{weight}::A"], good[f"{weight}::B"]
    cases = {
        "no such weight": ({**good, "model.nowhere.weight::A": A.clone()},
                           "adapter tensor 'model.nowhere.weight::A': the served model has no weight "
                           "'model.nowhere.weight'"),
        "wrong shape": ({**good, f"{weight}::B": B[:, :2].contiguous()},
                        f"adapter of '{weight}': A [4, 96], B [96, 2], scaling of 1 values do not fit its shape "
                        "[96, 96] (A (r, 96), B (96, r), 0 < r ≤ 1024, one scaling)"),
        "NaN": ({**good, f"{weight}::A": torch.full_like(A, float("nan"))},
                f"adapter of '{weight}': A has NaN or infinite values"),
        "half": ({key: value for key, value in good.items() if key != f"{weight}::scaling"},
                 f"adapter of '{weight}' lacks its scaling"),
        "bfloat16": ({**good, f"{weight}::A": A.to(torch.bfloat16)},
                     f"adapter of '{weight}': A is bfloat16 for a float32 weight; adapters are pushed as float32 "
                     "factors (a float64 scaling) onto float32 weights"),
    }
    for name, (factors, message) in cases.items():
        assert _post(address, client.lease, save(factors)) == (400, message), name
    assert _post(address, client.lease, b"not safetensors")[0] == 400
    assert _post(address, "not-the-lease", save(good))[0] == 409
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in before.items())
    client.close()


def test_an_engine_without_adapters_gets_merged_weights(tmp_path, monkeypatch):
    """A server whose engine merges no adapters (vLLM's) says so in /health: the client pushes merged weights."""
    from auto_research.engine.rollout.builtin import BuiltinEngine

    monkeypatch.delenv("AUTO_RESEARCH_API_KEY", raising=False)
    monkeypatch.delattr(BuiltinEngine, "load_adapter")
    server, engine = start_builtin_server()
    try:
        policy = lora_policy()
        client = _client(policy, f"127.0.0.1:{server.server_address[1]}", tmp_path)
        assert not client.adapters
        nudge(policy, 0.03)
        client.load_weights(policy)
        assert client.pushed_bytes == sum(t.numel() * 4 for t in _merged(policy).values())
        assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in _merged(policy).items())
        client.close()
    finally:
        stop(server)


def test_a_lora_run_in_a_rollout_process_pushes_its_adapter_and_trains_as_the_colocated_run(tmp_path):
    """--lora-r 4 with --rollout-mode process (the builtin server the run starts): after the first push, each
    step's push is the adapter's bytes alone, and the run's rewards and final adapter are the colocated run's."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    env = {key: value for key, value in os.environ.items() if key != "AUTO_RESEARCH_API_KEY"}
    env["OMP_NUM_THREADS"] = "1"
    common = ["post-train", "--dataset", "arithmetic-generate", "--steps", "3", "--prompts-per-step", "4",
              "--lora-r", "4", "--offline", "--no-progress", "--eval-every", "0", "--evaluation-examples", "4",
              "--threads", "1", "--learning-rate", "1e-3"]
    rows, adapters = {}, {}
    for name, extra in (("colocated", []), ("process", ["--rollout-mode", "process"])):
        done = subprocess.run([sys.executable, "-m", "auto_research", *common, *extra, "--output-dir",
                               str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        run = next((tmp_path / name).iterdir())
        rows[name] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        adapters[name] = load_file(str(run / "checkpoints" / "step-000003" / "adapter_model.safetensors"))
    assert [row["reward_mean"] for row in rows["process"]] == [row["reward_mean"] for row in rows["colocated"]]
    # μ from another process's kernels (the importance weights' sums in another order), which Adam lifts to up to
    # lr in the odd element; a fault (other samples, a stale adapter) moves most elements by ~lr a step: RMS <= the
    # largest lr stepped with / 10 (conftest.rms_difference).
    difference = rms_difference(adapters["process"], adapters["colocated"])
    bound = max(row["learning_rate"] for row in rows["colocated"]) / 10
    print(f"adapter's RMS difference from colocated {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(adapters['process'], adapters['colocated']):.2e}")
    assert difference <= bound, (difference, bound)
    pushed = [row["weight_sync_bytes"] for row in rows["process"]]
    factors = sum(tensor.numel() * 4 for tensor in adapters["process"].values())
    lora_layers = sum(1 for name in adapters["process"] if ".lora_A." in name)
    assert pushed == [factors + 8 * lora_layers] * 3, pushed  # A and B (float32) and a float64 scaling per layer


def test_an_adapter_whose_product_overflows_is_refused_and_the_weights_stay(two_servers, tmp_path):
    """Finite factors whose product B·A·scaling is not (A = B = 1e20; a scaling of 1e300), or is far beyond any
    weight's range, are refused with a 400 before the engine merges them: the served weights stay finite and as
    they were, and the server still draws."""
    from safetensors.torch import save

    from auto_research.engine.rollout.remote import adapter_factors

    (engine, address), _ = two_servers
    policy = lora_policy()
    client = _client(policy, address, tmp_path)
    before = {name: tensor.clone() for name, tensor in engine.parameters.items()}
    good = adapter_factors(policy)
    weight = "model.layers.0.self_attn.q_proj.weight"
    A, B = good[f"{weight}::A"], good[f"{weight}::B"]
    huge = {f"{weight}::A": torch.full_like(A, 1e20), f"{weight}::B": torch.full_like(B, 1e20)}
    tiny_scaled = {**huge, f"{weight}::scaling": torch.tensor(1e-36, dtype=torch.float64)}  # B·A alone overflows
    big = {f"{weight}::A": torch.full_like(A, 100.0), f"{weight}::B": torch.full_like(B, 100.0)}  # finite: 4e4
    message = (f"adapter of '{weight}': (B @ A) · scaling is not finite, or beyond ±10000 (a LoRA change "
               "to a weight is far smaller)")
    for name, changes in {"A = B = 1e20": huge, "scaling 1e300": {f"{weight}::scaling": torch.tensor(
            1e300, dtype=torch.float64)}, "B·A overflows before a tiny scaling": tiny_scaled,
            "finite but far too large": big}.items():
        assert _post(address, client.lease, save({**good, **changes})) == (400, message), name
    assert all(torch.equal(engine.parameters[name], tensor) for name, tensor in before.items())
    assert all(torch.isfinite(tensor).all() for tensor in engine.parameters.values())
    nudge(policy, 0.01)
    client.load_weights(policy)  # a sane adapter still goes in
    for name, tensor in _merged(policy).items():
        assert torch.allclose(engine.parameters[name], tensor, atol=1e-6, rtol=0), name
    client.close()
