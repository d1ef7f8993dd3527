"""Rollouts in flight: steps per minute at --max-staleness 0, 1 and 2, side by side in one invocation, with the
trainer and the rollout side on disjoint cores.

    python benchmarks/async.py                          # the embedded model on arithmetic-generate (warm-started once)
    python benchmarks/async.py --model tiny --steps 12  # a random 2-layer model: seconds, for a smoke run
    python benchmarks/async.py --model wide             # a random 4-layer model of width 512
    python benchmarks/async.py --rollout-side server    # the rollout side in a process: rollout-serve --engine builtin
    python benchmarks/async.py --rollout-side server --engine vllm --model smollm2-135m-instruct --max-new-tokens 16

The trainer (this process's main thread) is pinned to --trainer-cores and the rollout side's thread to
--sampler-cores (``os.sched_setaffinity`` per thread, Linux); at K = 0 there is no rollout thread, so
sampling runs on the trainer's cores, as a synchronous run does. With --rollout-side server the rollout side is
a process of its own (``auto-research rollout-serve``, pinned to --sampler-cores with taskset, serving every run
in turn), at K = 0 too: the trainer then waits for it while it samples. Each K runs --rounds times, alternating
K = 0, 1, 2, so that a machine whose load changes treats them alike; the first --warmup steps of each run are
not timed. From the K = 0 runs' own phases: t_sample (drawing + sampling + scoring a batch) and t_train (the
rest of a step); overlap can at best turn t_sample + t_train into max(t_sample, t_train), so the goal for K = 1
is a speedup ≥ 0.9 × (t_sample + t_train) / max(t_sample, t_train). Idle fractions: the trainer's time waiting
for a batch, and the rollout side's waiting for weights, over the timed wall time. Each thread's CPU seconds and
seconds spent runnable but waiting for a CPU (Linux's schedstat) say how much of a slowdown is other work on
the machine: the rest of a thread's wall time is asleep (waiting for a batch, for weights, or for Python's
global interpreter lock).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def cores(text: str) -> set[int]:
    return {int(part) for part in text.split(",") if part.strip()}


SHAPES = {"tiny": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
                       num_key_value_heads=3),
          # Wide enough that torch's kernels (which release the GIL), not Python, take most of a step.
          "wide": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=8)}


def random_model(folder: Path, shape: str) -> str:
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, max_position_embeddings=64, **SHAPES[shape])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def scheduled(thread_id: int | None) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a thread so far (Linux's schedstat); a thread
    waiting for the GIL or for a batch is asleep, in neither."""
    if thread_id is None:
        return 0.0, 0.0
    on_cpu, waiting, _ = Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def process_scheduled(pid: int | None) -> tuple[float, float]:
    """(CPU seconds, 0.0) of a process so far, its finished threads included (the rollout server answers each
    request in a thread of its own, gone by the time it is read; their run-queue time goes with them)."""
    if pid is None:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 0.0


def one_run(options, K: int, model: str | None, output: Path, server=None) -> dict:
    """One run at --max-staleness K: its timed steps' wall time, rows, and each thread's CPU and run-queue time.
    The run is configured K + 1 steps longer than it is stepped, so that its rollout thread is still alive (waiting
    for weights) when it is measured."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.in_flight import start_rollouts
    from auto_research.train.trainer import Trainer

    os.sched_setaffinity(0, options.trainer_cores)  # the main thread: the trainer
    config = GenerationConfig(dataset="arithmetic-generate", model=model, steps=options.steps + K + 1, max_staleness=K,
                              seed=options.seed, threads=1, device="cpu", output_dir=output, progress=False,
                              prompts_per_step=options.prompts_per_step, group_size=options.group_size,
                              max_new_tokens=options.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                              eval_every=0, evaluation_examples=8, offline=True,
                              **({"sampler": options.engine, "vllm_mode": "server", "vllm_server": server[1]}
                                 if server else {}))
    trainer = Trainer.build(config, log=lambda text: None)
    if K:
        start_rollouts(trainer.components, trainer.state, cpus=options.sampler_cores)
    rows, started = [], None
    threads = [threading.get_native_id(), trainer.components.rollouts.thread.native_id if K else None]

    def measure():
        return [scheduled(threads[0]), process_scheduled(server[0].pid) if server else scheduled(threads[1])]

    try:
        for step in range(1, options.steps + 1):
            if step == options.warmup + 1:
                started, before = time.perf_counter(), measure()
            rows.append(trainer.step(step))
        wall = time.perf_counter() - started
        after = measure()
    finally:
        trainer.close()
    (cpu, queued), (sampler_cpu, sampler_queued) = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(before, after)]
    return {"wall": wall, "rows": rows[options.warmup:], "trainer_cpu": cpu, "trainer_queued": queued,
            "sampler_cpu": sampler_cpu, "sampler_queued": sampler_queued}


def summary(runs: list[dict]) -> dict:
    wall = sum(run["wall"] for run in runs)
    rows = [row for run in runs for row in run["rows"]]
    steps = len(rows)
    sample = statistics.fmean(row["time_sample"] + row["time_score"] for row in rows)
    waiting = sum(row["time_waiting_for_rollouts"] for row in rows)
    return {"steps_per_minute": 60 * steps / wall, "t_sample": sample,
            "t_train": statistics.fmean(row["step_seconds"] - row["time_waiting_for_rollouts"] for row in rows),
            "trainer_idle": waiting / wall, "sampler_idle": sum(row["time_sampler_idle"] for row in rows) / wall,
            "staleness_max": max(row["staleness_max"] for row in rows), "steps": steps,
            **{key: sum(run[key] for run in runs) / steps
               for key in ("trainer_cpu", "trainer_queued", "sampler_cpu", "sampler_queued")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder, tiny or wide (random, built here: 2 layers of "
                        "96, 4 of 512), or the embedded model warm-started on arithmetic-generate (default)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--staleness", default="0,1,2")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--trainer-cores", type=cores, default={0})
    parser.add_argument("--sampler-cores", type=cores, default={1})
    parser.add_argument("--rollout-side", choices=("thread", "server"), default="thread",
                        help="the rollout side in a thread of the trainer's process, or in a rollout server's process")
    parser.add_argument("--engine", choices=("builtin", "vllm"), default="builtin", help="the server's engine")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    options = parser.parse_args()
    if options.rollout_side == "thread" and options.engine != "builtin":
        parser.error("--engine vllm needs --rollout-side server")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    levels = [int(value) for value in options.staleness.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        model = random_model(Path(folder) / options.model, options.model) if options.model in SHAPES else options.model
        results = {K: [] for K in levels}
        server = None
        if options.rollout_side == "server":
            from servers import start_server

            server = start_server(model, threads=len(options.sampler_cores), engine=options.engine,
                                  memory=0.05 if options.engine == "vllm" else None, cores=options.sampler_cores)
        try:
            for round_ in range(options.rounds):
                for K in levels:
                    results[K].append(one_run(options, K, model, Path(folder) / f"run-{K}-{round_}", server))
        finally:
            if server:
                server[0].kill()
                server[0].wait()
    figures = {K: summary(runs) for K, runs in results.items()}
    base = figures[levels[0]]
    bound = (base["t_sample"] + base["t_train"]) / max(base["t_sample"], base["t_train"])
    side = (f"a {options.engine} rollout server's process" if options.rollout_side == "server" else
            "a thread of the trainer's process")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores ({platform.processor() or 'cpu'}); trainer on cores "
          f"{sorted(options.trainer_cores)}, rollout side ({side}) on {sorted(options.sampler_cores)}; model "
          f"{options.model or 'embedded (warm-started)'}; {options.prompts_per_step} prompts × {options.group_size}, "
          f"≤ {options.max_new_tokens} tokens; {options.rounds} rounds × {options.steps - options.warmup} timed steps")
    print(f"K=0 phases: t_sample {base['t_sample']:.3f} s, t_train {base['t_train']:.3f} s; overlap bound "
          f"{bound:.2f}×, goal 0.9 × bound = {0.9 * bound:.2f}×")
    print("| K | steps/min | speedup vs K=0 | trainer idle | rollout side idle | staleness max | per step: trainer CPU "
          "s (waiting for a CPU s) | rollout side CPU s (waiting for a CPU s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for K, figure in figures.items():
        print(f"| {K} | {figure['steps_per_minute']:.1f} | {figure['steps_per_minute'] / base['steps_per_minute']:.2f}× "
              f"| {figure['trainer_idle']:.1%} | {figure['sampler_idle']:.1%} | {figure['staleness_max']} "
              f"| {figure['trainer_cpu']:.3f} ({figure['trainer_queued']:.3f}) "
              f"| {figure['sampler_cpu']:.3f} ({figure['sampler_queued']:.3f}) |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end (other work on the machine delays both threads: the "
          "columns in brackets)")
    if options.json:
        options.json.write_text(json.dumps({"bound": bound, "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
