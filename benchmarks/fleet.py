"""Several rollout servers behind one trainer, by simulation: steps per minute with 1, 2, 4 and 8 servers at
--max-staleness 0, 1 and 2, against the bound min(N × one server's rate, the trainer's rate), side by side in
one invocation; and a run that loses one of its servers mid-run.

    python benchmarks/fleet.py                                  # N = 1, 2, 4, 8; K = 0, 1, 2
    python benchmarks/fleet.py --servers 1,2 --staleness 1 --steps 6   # a smoke run (seconds)

Each server is the real rollout server (``engine/rollout/server.py``: leases, weights pushed over HTTP, one request
at a time) in a process of its own, in front of an engine that sleeps instead of computing: a request of several groups
takes its longest completion's length × --token-seconds (a batch decodes its rows together), and lengths have a
long tail (--tail-share of completions --tail-factor × the median; drawn from each completion's seed, so every
run draws the same lengths). Sleeping takes no CPU, so 8 servers and the real trainer (the embedded architecture,
random weights, RLOO) share 2 cores; their HTTP, JSON and pushes still take some of it.

At K ≥ 1 (one process) a fleet draws across batches (``engine/rollout/fleet_stream.py``): each server moves on to
the next version's units once none of its own is left. Each such run is repeated with whole batches (one version on
every server, a push to all between two batches: the path K = 0 and torchrun take), side by side.

The two rates come from the N = 1, K = 0 run's own phases: one server's rate is 60 / its mean time to draw a batch
(``time_waiting_for_rollouts``: the trainer waits for the whole draw at K = 0), the trainer's is 60 / the rest of
its step (train, push the weights). At K ≥ 1 the trainer's rate is measured by a run of its own against servers
that answer at once: its rollout side (sending, parsing, scoring, the reference's log-probs) then works in this
process while it trains. The bound at K ≥ 1 is min(N × one server's rate, the trainer's rate at K); at K = 0,
which draws and then trains, it is 60 / (the draw's time / N + the trainer's). Idle fractions: the trainer's time
waiting for a batch or inside its push over the timed wall time, and each server's time without a request in its
engine. The first --warmup steps of each run are not timed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class SleepingEngine:
    """A rollout server's engine (``generate``, ``load_named``, ``max_model_len``) that sleeps for the time a real
    one would decode: the request's longest completion × ``token_seconds``."""

    def __init__(self, vocab_size: int, first_token: int, token_seconds: float, median: int, tail_share: float,
                 tail_factor: int):
        self.vocab_size, self.first_token, self.token_seconds = vocab_size, first_token, token_seconds
        self.median, self.tail_share, self.tail_factor = median, tail_share, tail_factor
        self.max_model_len = 4096
        self.busy = 0.0

    def generate(self, prompt_ids, group_size, seeds, settings):
        completions, logprobs = [], []
        for seed in seeds:
            for sample in range(group_size):
                draw = random.Random(seed * 1009 + sample)
                length = self.median * (self.tail_factor if draw.random() < self.tail_share else 1)
                length = min(length, settings.max_new_tokens)
                completions.append([draw.randrange(self.first_token, self.vocab_size) for _ in range(length)])
                logprobs.append([-math.log(self.vocab_size)] * length)  # the random model's ~uniform distribution
        seconds = max(len(row) for row in completions) * self.token_seconds
        time.sleep(seconds)
        self.busy += seconds
        return completions, logprobs

    def load_named(self, weights) -> None:
        for _ in weights:
            pass


def serve_simulated(options: dict, spec: tuple, answer) -> None:
    """A simulated server in a process of its own (as real servers are: their HTTP and JSON work takes no turn of
    the trainer's interpreter lock); says its port, then reports its engine's busy seconds when asked."""
    import threading as threads

    from auto_research.engine.rollout.server import Limits, Served, make_server

    engine = SleepingEngine(spec[3], 4, options["token_seconds"], options["median"], options["tail_share"],
                            options["tail_factor"])
    server = make_server(engine, Served(*spec), "127.0.0.1", 0, Limits(shared_folder=None))
    threads.Thread(target=server.serve_forever, daemon=True).start()
    answer.send(server.server_address[1])
    while answer.recv() == "busy":
        answer.send(engine.busy)


class Simulated:
    """One simulated server process: its address, its engine's busy seconds so far, ``stop`` (SIGKILL)."""

    def __init__(self, options, spec: tuple):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=serve_simulated, args=(vars(options), spec, theirs), daemon=True)
        self.process.start()
        self.address = f"127.0.0.1:{self.pipe.recv()}"

    @property
    def busy(self) -> float:
        self.pipe.send("busy")
        return self.pipe.recv()

    def stop(self) -> None:
        self.process.kill()
        self.process.join()


def start_servers(n: int, model, tokenizer, options) -> list[Simulated]:
    import torch

    from auto_research.engine.rollout.guard import weight_spec
    from auto_research.engine.rollout.remote import pushed_weights
    from auto_research.engine.rollout.server import fingerprint

    spec = ("simulated", fingerprint(model.config, tokenizer), weight_spec(pushed_weights(model, torch.float32)),
            model.config.vocab_size, "float32")
    return [Simulated(options, spec) for _ in range(n)]


def one_run(options, n: int, K: int, model_dir: str, model, tokenizer, output: Path, lose_at: int | None = None,
            whole_batches: bool = False) -> dict:
    """One run over ``n`` simulated servers at --max-staleness K: its timed steps' wall time and rows, each
    server's busy time; ``lose_at``: the step after which the last server stops; ``whole_batches``: a fleet draws
    each batch with one version on every server (the path before ``fleet_stream.py``; K = 0 and torchrun's)."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train import schedule
    from auto_research.train.trainer import Trainer

    servers = start_servers(n, model, tokenizer, options)
    addresses = ",".join(server.address for server in servers)
    config = GenerationConfig(dataset="arithmetic-generate", model=model_dir, steps=options.steps + K + 1,
                              max_staleness=K, seed=options.seed, threads=1, device="cpu", output_dir=output,
                              progress=False, prompts_per_step=options.prompts_per_step, group_size=options.group_size,
                              generation_batch_size=options.unit_prompts * options.group_size,
                              max_new_tokens=options.median * options.tail_factor, temperature=1.0, top_p=1.0,
                              top_k=0, eval_every=0, evaluation_examples=4, offline=True, sampler="builtin",
                              rollout_mode="server", rollout_server=addresses, max_rollout_mismatch=1e9)
    lines: list[str] = []
    streams = schedule.streams  # the table picks the side when the run opens
    if whole_batches:
        schedule.streams = lambda run, drawing: False
    try:
        trainer = Trainer.build(config, log=lines.append)
    finally:
        schedule.streams = streams
    rows, times, started, busy = [], [], None, None
    try:
        for step in range(1, options.steps + 1):
            if step == options.warmup + 1:
                started, busy = time.perf_counter(), [server.busy for server in servers]
            begun = time.perf_counter()
            rows.append(trainer.step(step))
            times.append(time.perf_counter() - begun)
            if lose_at == step:
                servers[-1].stop()
        wall = time.perf_counter() - started
        busy = [server.busy - before for server, before in zip(servers[:-1] if lose_at else servers, busy)]
    finally:
        trainer.close()
        for server in servers[:-1] if lose_at else servers:
            server.stop()
    return {"wall": wall, "rows": rows[options.warmup:], "times": times, "busy": busy,
            "left": [line for line in lines if "left the pool" in line]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="1,2,4,8", help="numbers of servers N")
    parser.add_argument("--staleness", default="0,1,2", help="--max-staleness values K")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--unit-prompts", type=int, default=2, help="prompts per request (a unit of groups)")
    parser.add_argument("--token-seconds", type=float, default=0.004, help="a simulated decode step's time")
    parser.add_argument("--median", type=int, default=8, help="a completion's usual length in tokens")
    parser.add_argument("--tail-share", type=float, default=0.1)
    parser.add_argument("--tail-factor", type=int, default=8)
    parser.add_argument("--lose-at", type=int, default=5, help="the fault run (N = 4, K = 1): the step after "
                                                               "which one server stops (0: no fault run)")
    parser.add_argument("--seed", type=int, default=42)
    options = parser.parse_args()
    counts = [int(part) for part in options.servers.split(",")]
    stalenesses = [int(part) for part in options.staleness.split(",")]
    if options.steps <= options.warmup:
        parser.error("--steps must exceed --warmup")

    os.environ.pop("AUTO_RESEARCH_API_KEY", None)
    import torch

    from auto_research.engine.tiny import build_model, build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, max_position_embeddings=256)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(Path(folder) / "model")
        tokenizer.save_pretrained(Path(folder) / "model")
        model_dir = str(Path(folder) / "model")
        results = {}
        plan = [(n, K) for n in counts for K in stalenesses]
        if (1, 0) not in plan:
            plan.insert(0, (1, 0))  # the rates come from it
        for n, K in plan:
            print(f"N = {n}, K = {K} ...", flush=True)
            results[n, K] = one_run(options, n, K, model_dir, model, tokenizer, Path(folder) / f"n{n}-k{K}")
            if n > 1 and K:
                print(f"N = {n}, K = {K}, whole batches ...", flush=True)
                results[n, K, "whole"] = one_run(options, n, K, model_dir, model, tokenizer,
                                                 Path(folder) / f"n{n}-k{K}-whole", whole_batches=True)
        instant = argparse.Namespace(**{**vars(options), "token_seconds": 0.0})
        for K in [K for K in stalenesses if K]:  # the trainer's own rate at K, its rollout side's CPU work included
            print(f"the trainer alone (servers that answer at once), K = {K} ...", flush=True)
            results["trainer", K] = one_run(instant, 1, K, model_dir, model, tokenizer, Path(folder) / f"t-k{K}")
        fault = None
        if options.lose_at:
            print("N = 4, K = 1, one server SIGKILLed mid-run ...", flush=True)
            fault = one_run(options, 4, 1, model_dir, model, tokenizer, Path(folder) / "fault", options.lose_at)
    report(options, results, counts, stalenesses, fault)


def report(options, results: dict, counts: list[int], stalenesses: list[int], fault: dict | None) -> None:
    base = results[1, 0]
    draw = statistics.mean(row["time_waiting_for_rollouts"] for row in base["rows"])
    train = base["wall"] / len(base["rows"]) - draw
    server_rate, trainer_rate = 60 / draw, 60 / train
    trainer_rates = {K: 60 * len(results["trainer", K]["rows"]) / results["trainer", K]["wall"]
                     for K in stalenesses if K}
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; one trainer, simulated "
          f"servers ({options.token_seconds * 1000:g} ms a token, median {options.median} tokens, "
          f"{options.tail_share:.0%} of completions {options.tail_factor}× that); {options.prompts_per_step} prompts × "
          f"{options.group_size} a step, {options.unit_prompts} prompts a request")
    print(f"one server's rate {server_rate:.1f} steps/min (a batch drawn in {draw:.2f} s); the trainer's "
          f"{trainer_rate:.1f} steps/min at K = 0 ({train:.2f} s a step without drawing), "
          + ", ".join(f"{rate:.1f} at K = {K}" for K, rate in trainer_rates.items())
          + " (against servers that answer at once: its rollout side's own work, in this process, included)\n")
    print("| N | K | steps/min | bound | ratio | trainer waiting (batch or push) | servers idle (mean, max) | "
          "whole batches: steps/min, ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n in counts:
        for K in stalenesses:
            # K = 0 draws, then trains: the bound is serial. K ≥ 1 overlaps them: the slower side sets the pace.
            bound = 60 / (draw / n + train) if K == 0 else min(n * server_rate, trainer_rates[K])
            rate, waiting, idle = _figures(results[n, K])
            whole = results.get((n, K, "whole"))
            versus = f"{_figures(whole)[0]:.1f}, {_figures(whole)[0] / bound:.2f}" if whole else "—"
            print(f"| {n} | {K} | {rate:.1f} | {bound:.1f} | {rate / bound:.2f} | {waiting:.0%} | "
                  f"{statistics.mean(idle):.0%}, {max(idle):.0%} | {versus} |")
    if fault is not None:
        times = fault["times"][options.warmup:]
        after = times[options.lose_at - options.warmup:]
        usual = statistics.median(times[:options.lose_at - options.warmup] or times)
        print(f"\none of 4 servers SIGKILLed after step {options.lose_at} (K = 1): "
              f"{'; '.join(fault['left']) or 'no server left the pool'}")
        if after:
            print(f"the slowest step after the loss took {max(after):.2f} s against a median of {usual:.2f} s before "
                  f"it ({max(after) - usual:+.2f} s); one request redrawn takes at most "
                  f"{options.median * options.tail_factor * options.token_seconds:.2f} s, plus the failed request's "
                  "one retry (0.5 s)")

def _figures(run: dict) -> tuple[float, float, list[float]]:
    """A run's steps/min, the trainer's waiting fraction (for its batch, or inside its push: with whole batches
    version v goes to the servers once the batches drawn by v − 1 are drawn, train/in_flight.py; across batches
    a push is a copy of the weights) and each server's idle fraction."""
    rate = 60 * len(run["rows"]) / run["wall"]
    waiting = sum(row["time_waiting_for_rollouts"] + row.get("weight_sync_seconds", 0.0)
                  for row in run["rows"]) / run["wall"]
    return rate, waiting, [1 - busy / run["wall"] for busy in run["busy"]]


if __name__ == "__main__":
    main()
