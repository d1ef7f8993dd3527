"""Weight sync to a rollout server in another process, three ways side by side: its shared-memory buffer (same host
only), a torch.distributed group of two (gloo: the path between hosts) and HTTP parts.

    python benchmarks/collective_sync.py                           # SmolLM2-135M-Instruct, fp32
    python benchmarks/collective_sync.py --model embedded --rounds 3

A builtin rollout server (``rollout-serve --engine builtin``) serves the model. Each round takes each path in turn
(``--rollout-sync``): a client claims the lease, makes its first push (untimed: the group forms then), and times one
push after an optimizer step (walking the weights, sending, the server's checks and reload), so the three paths see
the same machine load. Medians with ranges, and ratios to shared memory.
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
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()

    import torch

    from auto_research.engine.distributed import World
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.engine.rollout.client import ServerSampler
    from weight_sync import load

    model, tokenizer, folder = load(options.model)
    process, address = start_server(str(folder) if folder else None, engine="builtin")
    paths = {"shared-memory": [], "collective": [], "http": []}
    try:
        for round_ in range(options.rounds):
            for sync, times in paths.items():
                with tempfile.TemporaryDirectory() as run:
                    client = ServerSampler(model, tokenizer, SamplingSettings(max_new_tokens=8), address,
                                           options.model, World(), run, engine="builtin", sync=sync)
                    with torch.no_grad():
                        for parameter in model.parameters():
                            parameter.mul_(1.0001)
                    started = time.perf_counter()
                    client.load_weights(model)
                    times.append(time.perf_counter() - started)
                    client.close()
            print(f"round {round_ + 1}: " + ", ".join(f"{sync} {times[-1]:.3f} s" for sync, times in paths.items()),
                  flush=True)
    finally:
        process.terminate()
        process.wait()
    base = statistics.median(paths["shared-memory"])
    print(f"\n{options.model}, {sum(t.numel() for t in model.parameters()) / 1e6:.1f} M weights, fp32; "
          f"{options.rounds} rounds")
    for sync, times in paths.items():
        median = statistics.median(times)
        paired = statistics.median(mine / theirs for mine, theirs in zip(times, paths["shared-memory"]))
        print(f"{sync:14s} median {median:6.3f} s (min {min(times):.3f}, max {max(times):.3f})  ×shared memory: "
              f"medians {median / base:5.2f}, per round {paired:5.2f}")


if __name__ == "__main__":
    main()
