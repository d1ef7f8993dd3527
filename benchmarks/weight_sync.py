"""Weight sync after an optimizer step, three ways side by side: a colocated vLLM engine, a vLLM server on this host
fed over HTTP, and the same server fed through its shared-memory buffer.

    python benchmarks/weight_sync.py --model smollm2-135m-instruct     # SmolLM2-135M-Instruct, fp32
    python benchmarks/weight_sync.py --model embedded --rounds 9

One process holds the policy and a colocated engine and starts ``auto-research vllm-serve`` for the same model;
each round syncs colocated, then over HTTP, then through shared memory (the same trainer's client, its shared
map set aside for the HTTP push), so the three see the same machine load. Each time is the trainer's
``weight_sync_seconds``: walking the weights, the copy, the server's checks and vLLM's in-place reload, until the
trainer knows the weights are in. After the last round the server draws the same seeded samples after an HTTP push
and after a shared push of the same weights (checked, printed). Medians with min–max ranges, and ratios to
colocated: of the medians, of the minimums, and the median of each round's own ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from servers import start_server


def load(name: str):
    import torch

    if name == "embedded":
        from auto_research.engine.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=0)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer, None
    from auto_research.engine.models import load_policy
    from auto_research.engine.packaged import materialise

    folder = materialise(name)
    model, tokenizer = load_policy(folder, "cpu", torch.float32, True)
    return model, tokenizer, folder


def summary(times: list[float], base: list[float] | None = None) -> str:
    """Median and range; against colocated: the ratio of medians, of minimums, and the median of the rounds' own
    ratios (each round's three syncs ran back to back, under the same load)."""
    median = statistics.median(times)
    line = f"median {median:6.3f} s  (min {min(times):6.3f}, max {max(times):6.3f})"
    if base:
        paired = statistics.median(mine / theirs for mine, theirs in zip(times, base))
        line += (f"  ×colocated: medians {median / statistics.median(base):4.2f}, "
                 f"minimums {min(times) / min(base):4.2f}, per round {paired:4.2f}")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct or embedded")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from auto_research.engine.distributed import World
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.engine.rollout.client import ServerSampler
    from auto_research.engine.rollout.vllm import VLLMSampler

    torch.set_num_threads(args.threads)
    model, tokenizer, folder = load(args.model)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    settings = SamplingSettings(max_new_tokens=8)
    print(f"{args.model}: {size:.0f} MiB of fp32 weights, {args.rounds} rounds, {args.threads} threads, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    process, address = start_server(folder, args.threads, 0.02)
    try:
        from auto_research.engine.models import context_length

        longest = min(context_length(model) or 512, 512)
        colocated = VLLMSampler(model, tokenizer, settings, 0.02, torch.float32, longest)
        with tempfile.TemporaryDirectory() as run:
            client = ServerSampler(model, tokenizer, settings, address, args.model, World(), run)
            writer = client.shared
            if writer is None:
                raise SystemExit("the server's shared buffer is not seen from here: no fast path to measure")
            times = {"colocated": [], "server, HTTP": [], "server, shared memory": []}
            for _ in range(args.rounds):
                colocated.load_weights(model)
                times["colocated"].append(colocated.weight_sync_seconds)
                client.shared = None
                client.load_weights(model)
                times["server, HTTP"].append(client.weight_sync_seconds)
                client.shared = writer
                client.load_weights(model)
                times["server, shared memory"].append(client.weight_sync_seconds)
                print("  round: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
            prompts, seeds = ["12+30=", "7+5="], [5, 6]
            client.shared = None
            client.load_weights(model)
            by_http = client.sample(prompts, 4, seeds)
            client.shared = writer
            client.load_weights(model)
            by_shared = client.sample(prompts, 4, seeds)
            same = torch.equal(by_http.sequences, by_shared.sequences) and torch.equal(
                by_http.sampler_logprobs, by_shared.sampler_logprobs)
            client.close()
        print(f"\n{args.model} weight sync ({time.strftime('%Y-%m-%d %H:%M')}):")
        for name, values in times.items():
            print(f"  {name:22s} {summary(values, None if name == 'colocated' else times['colocated'])}")
        print(f"  same draws after an HTTP push and a shared push of the same weights: {same}")
    finally:
        process.terminate()
        process.wait(timeout=60)
    leftover = list(Path("/dev/shm").glob(f"auto-research-weights-{process.pid}-*"))
    print(f"  the server's shared buffers left after it stopped: {len(leftover)}")


if __name__ == "__main__":
    main()
