"""Weight sync to a rollout server in another process, three ways side by side: its shared-memory buffer (same host
only), a torch.distributed group of two (gloo: the path between hosts) and HTTP parts.

    python benchmarks/collective_sync.py                           # SmolLM2-135M-Instruct, fp32
    python benchmarks/collective_sync.py --model embedded --rounds 3

A builtin rollout server (``rollout-serve --engine builtin``) serves the model. Each round takes each path in turn
(``--rollout-sync``): a client claims the lease and pushes ``--pushes`` times, each after a change to every weight
(as an optimizer step makes), so the three paths see the same machine load. The first two pushes of a client are not
timed: the group forms at the first, and the server's two sets of receive buffers (``pushes.Link``) are allocated at
the first two. The others are what a run pays at every step (walking the weights, sending, the server's checks and
reload); their median is the round's figure. Medians over rounds with ranges, and ratios to shared memory.
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
    parser.add_argument("--pushes", type=int, default=5, help="pushes a client makes each round, the first two untimed")
    options = parser.parse_args()
    if options.pushes < 3:
        parser.error("--pushes must be at least 3 (the first two are not timed)")

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
                                           options.model, World(), run, engine="builtin", sync=sync)  # push 1
                    timed = []
                    for push in range(2, options.pushes + 1):
                        with torch.no_grad():
                            for parameter in model.parameters():
                                parameter.mul_(1.0001)
                        started = time.perf_counter()
                        client.load_weights(model)
                        if push > 2:
                            timed.append(time.perf_counter() - started)
                    times.append(statistics.median(timed))
                    client.close()
            print(f"round {round_ + 1}: " + ", ".join(f"{sync} {times[-1]:.3f} s" for sync, times in paths.items()),
                  flush=True)
    finally:
        process.terminate()
        process.wait()
    base = statistics.median(paths["shared-memory"])
    print(f"\n{options.model}, {sum(t.numel() for t in model.parameters()) / 1e6:.1f} M weights, fp32; "
          f"{options.rounds} rounds of {options.pushes - 2} timed pushes a path")
    for sync, times in paths.items():
        median = statistics.median(times)
        paired = statistics.median(mine / theirs for mine, theirs in zip(times, paths["shared-memory"]))
        print(f"{sync:14s} median {median:6.3f} s (min {min(times):.3f}, max {max(times):.3f})  ×shared memory: "
              f"medians {median / base:5.2f}, per round {paired:5.2f}")


if __name__ == "__main__":
    main()
