"""LoRA adapter-only weight sync against merged pushes, side by side: a LoRA policy (every linear layer, rank
--rank) and a rollout server in a process of its own: the builtin engine, which merges the adapter itself, or vLLM
started with --enable-lora, which applies it unmerged (``--engine vllm``).

    python benchmarks/adapter_sync.py                              # SmolLM2-135M-Instruct, r = 16, builtin
    python benchmarks/adapter_sync.py --engine vllm                # the same against a vLLM server
    python benchmarks/adapter_sync.py --model embedded --rounds 5  # the embedded model: seconds

Each round, under the same load: the merged weights over HTTP (what a LoRA run pushed before, and still pushes to
an engine that takes no adapters: vLLM's without --enable-lora), the merged weights through the server's
shared-memory buffer (same host only), then the base weights once more (untimed: the server's base for the adapter)
and the adapter alone over HTTP. Each time is the trainer's, until the server says the weights are in: walking
the weights (merging the adapter, for the merged pushes), serialising, sending, the server's checks and its copy or
merge. Bytes are the tensors' own. After the last round the server draws the same seeded samples after the
adapter push and after a merged push of the same weights (compared, printed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from servers import start_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct or embedded")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--engine", default="builtin", choices=("builtin", "vllm"))
    options = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model

    from auto_research.engine.distributed import World
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.rollout.remote import adapter_factors, pushed_weights
    from weight_sync import load

    base, tokenizer, folder = load(options.model)
    policy = get_peft_model(base, LoraConfig(r=options.rank, lora_alpha=2 * options.rank, target_modules="all-linear",
                                             lora_dropout=0.0))
    lora = ("--enable-lora", "--max-lora-rank", str(options.rank)) if options.engine == "vllm" else ()
    process, address = start_server(str(folder) if folder else None, engine=options.engine, extra=lora,
                                    memory=0.05 if options.engine == "vllm" else None)
    try:
        with tempfile.TemporaryDirectory() as run:
            client = ServerSampler(policy, tokenizer, SamplingSettings(max_new_tokens=8), address, options.model,
                                   World(), run, engine=options.engine)
            assert client.adapters, "the server takes no adapters"
            shared, client.shared = client.shared, None
            times = {"merged, HTTP": [], "merged, shared memory": [], "adapter, HTTP": []}
            sizes = {}
            generator = torch.Generator().manual_seed(0)
            for round_ in range(options.rounds):
                with torch.no_grad():  # an optimizer step: the adapter moves
                    for name, parameter in policy.named_parameters():
                        if ".lora_" in name:
                            parameter.add_(1e-3 * torch.randn(parameter.shape, generator=generator))
                for label, share in (("merged, HTTP", None), ("merged, shared memory", shared)):
                    if label.endswith("shared memory") and shared is None:
                        continue
                    client.shared = share
                    started = time.perf_counter()
                    sizes[label] = client._push_weights(policy, merged=True)
                    times[label].append(time.perf_counter() - started)
                client.shared = None
                client._push_weights(policy, merged=False)  # the server's base, untimed
                started = time.perf_counter()
                factors = adapter_factors(policy)
                client._push_adapter(factors)
                times["adapter, HTTP"].append(time.perf_counter() - started)
                sizes["adapter, HTTP"] = sum(t.numel() * t.element_size() for t in factors.values())
                print(f"round {round_ + 1}: " + ", ".join(f"{label} {values[-1]:.3f} s"
                                                          for label, values in times.items() if values), flush=True)
            # The same seeded draws from the server's merge of the last adapter and from the merged weights.
            prompts, seeds = ["What is 12+30?", "Name a colour."], [1, 2]
            by_adapter = client.sample(prompts, 2, seeds)
            client._push_weights(policy, merged=True)
            by_merge = client.sample(prompts, 2, seeds)
            same = by_adapter.token_lists() == by_merge.token_lists()
            gap = (by_adapter.sampler_logprobs - by_merge.sampler_logprobs).abs().max().item()
            client.shared = shared
            client.close()
    finally:
        process.terminate()
        process.wait()
    merged = dict(pushed_weights(policy, torch.float32))
    print(f"draws after the adapter push and after a merged push: token ids {'the same' if same else 'DIFFERENT'}, "
          f"log-probs at most {gap:.1e} apart")
    print(f"\n{options.model}, LoRA r = {options.rank} on every linear layer, a {options.engine} server; "
          f"{options.rounds} rounds")
    reference = statistics.median(times["merged, HTTP"])
    for label, values in times.items():
        if not values:
            continue
        median = statistics.median(values)
        print(f"{label:24s} {sizes[label] / 2**20:9.2f} MiB ({sizes[label] / sizes['merged, HTTP']:6.2%} of merged)  "
              f"median {median:6.3f} s (min {min(values):.3f}, max {max(values):.3f})  ×merged HTTP "
              f"{median / reference:5.3f}")
    print(f"merged weights: {sum(t.numel() for t in merged.values()) / 1e6:.1f} M values")


if __name__ == "__main__":
    main()
