"""Rollouts in flight: steps per minute at --max-staleness 0, 1 and 2, side by side in one invocation, with the
trainer and the rollout side on disjoint cores.

    python benchmarks/async.py                          # the embedded model on arithmetic-generate (warm-started once)
    python benchmarks/async.py --model tiny --steps 12  # a random 2-layer model: seconds, for a smoke run
    python benchmarks/async.py --model wide             # a random 4-layer model of width 512
    python benchmarks/async.py --rollout-side server    # the rollout side in a process: rollout-serve --engine builtin
    python benchmarks/async.py --rollout-side server --engine vllm --model smollm2-135m-instruct --max-new-tokens 16
    python benchmarks/async.py --model tiny --staleness 1,1+,2,2+ --long-tail 0.1:8 --max-new-tokens 48 --steps 14
                                                        # in-flight updates (K+) against whole draws, long tail
    python benchmarks/async.py --model tiny --staleness 1,3+ --long-tail 0.1:8 --max-new-tokens 48 --rollout-side server
                                                        # the same in a rollout server (its model hooked there)
    python benchmarks/async.py --model tiny --staleness 1,4+ --long-tail 0.1:8 --max-new-tokens 48 --decode-latency 10 \
        --rollout-side server --train-latency 375     # a trainer as slow as the rollout side (each update sleeps)


A level written K+ runs with --in-flight-updates (K+r: and --recompute-kv-on-update; K+x1.5: and --in-flight-pool 1.5;
benchmarks/levels.py) (weights taken between two decode steps, partial rollouts; docs/async.md). --long-tail F:X gives
completions a long-tailed length, whatever the weights: a forward hook on the model (trainer, rollout side and reference
alike, so every log-prob agrees) makes a completion end with probability 1/M a token (M = --max-new-tokens / X, the
typical length), and enter a "long" mode with probability F/M a token, in which it draws only from 32 byte tokens no
prompt holds and ends with probability 1/(X·M): about a fraction F of completions run X times the typical length. The
hook is on the sampling model only (the trainer's log-probs come from the output layer's weight, past any hook), so
--max-rollout-mismatch is lifted and the correction is off (--rollout-correction none: on SmolLM2 every sequence's
weight fell below 1e-6 and the step stopped): the figures are throughput, not learning.

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
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from levels import parse as parse_level  # noqa: E402 - benchmarks/ is on the path when a script of it runs


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


LONG_TOKENS = range(4, 36)
"""The byte-level tokenizer's control bytes (0x00 … 0x1f): never in a prompt, the long mode's alphabet."""


def long_tail_hook(fraction: float, factor: float, typical: float, eos: int, latency: float = 0.0):
    """A forward hook (with kwargs) that replaces the logits with the log-probs of the long-tailed law above; the
    mode of the next token is read off the current one alone, so the law is the same in every forward. With
    ``latency``, each decode forward (one new token a row) also sleeps that many seconds, whatever its rows: an
    accelerator's decode step, bound by reading the weights, not by the batch."""
    import torch

    end, enter, end_long = 1.0 / typical, fraction / typical, 1.0 / (factor * typical)

    def hook(module, args, kwargs, output):
        logits = output.logits
        if logits is None or not logits.shape[1]:
            return output
        ids = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0])[:, -logits.shape[1]:]
        vocabulary = logits.shape[-1]
        long = torch.zeros(vocabulary, dtype=torch.bool, device=logits.device)
        long[list(LONG_TOKENS)] = True
        is_eos = torch.zeros_like(long)
        is_eos[eos] = True
        rest = ~long & ~is_eos
        floor = torch.finfo(logits.dtype).min
        log_rest = logits.float().masked_fill(~rest, floor).log_softmax(-1)
        log_long = logits.float().masked_fill(~long, floor).log_softmax(-1)
        normal = torch.where(rest, math.log(1 - end - enter) + log_rest,
                             torch.where(long, math.log(enter) + log_long, torch.full_like(log_rest, math.log(end))))
        in_long = torch.where(long, math.log(1 - end_long) + log_long,
                              torch.where(is_eos, torch.full_like(log_long, math.log(end_long)),
                                          torch.full_like(log_long, floor)))
        mode = torch.isin(ids, torch.tensor(list(LONG_TOKENS), device=ids.device)).unsqueeze(-1)
        output.logits = torch.where(mode, in_long, normal).to(logits.dtype)
        if latency and ids.shape[1] == 1:
            time.sleep(latency)
        return output

    return hook


SERVE_WITH_TAIL = "--serve-with-long-tail"


def serve_with_long_tail(spec: str, arguments: list[str]) -> int:
    """``auto-research ARGUMENTS`` (a builtin rollout server) whose engine's model samples the long tail: ``spec``
    is F:X:max new tokens:decode latency in ms."""
    from auto_research.cli import main as auto_research
    from auto_research.engine.rollout.builtin import BuiltinEngine

    fraction, factor, max_new, latency = (float(part) for part in spec.split(":"))
    built = BuiltinEngine.__init__

    def hooked(self, model, tokenizer):
        built(self, model, tokenizer)
        model.register_forward_hook(long_tail_hook(fraction, factor, max_new / factor, tokenizer.eos_token_id,
                                                   latency / 1000), with_kwargs=True)

    BuiltinEngine.__init__ = hooked
    return auto_research(arguments)


def one_run(options, level: str, model: str | None, output: Path, server=None) -> dict:
    """One run at --max-staleness K: its timed steps' wall time, rows, and each thread's CPU and run-queue time.
    The run is configured K + 1 steps longer than it is stepped, so that its rollout thread is still alive (waiting
    for weights) when it is measured."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    parsed = parse_level(level)
    K, in_flight, recompute = parsed.K, parsed.in_flight, parsed.recompute
    os.sched_setaffinity(0, options.trainer_cores)  # the main thread: the trainer
    config = GenerationConfig(dataset="arithmetic-generate", model=model, steps=options.steps + K + 1, max_staleness=K,
                              in_flight_updates=in_flight, recompute_kv_on_update=recompute,
                              in_flight_pool=parsed.pool,
                              **({"max_rollout_mismatch": 1e9, "rollout_correction": "none"} if options.long_tail
                                 else {}),
                              seed=options.seed, threads=1, device="cpu", output_dir=output, progress=False,
                              prompts_per_step=options.prompts_per_step, group_size=options.group_size,
                              max_new_tokens=options.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                              eval_every=0, evaluation_examples=8, offline=True,
                              **({"sampler": options.engine, "vllm_mode": "server", "vllm_server": server[1]}
                                 if server else {}))
    trainer = Trainer.build(config, log=lambda text: None)
    if K:  # the side's thread starts at the first step, on these cores
        trainer.side.cpus = options.sampler_cores
    if options.long_tail and not server:  # on the sampling model only (its first batch, drawn at once, is in the warm-up)
        fraction, factor = (float(part) for part in options.long_tail.split(":"))
        c = trainer.models
        hook = long_tail_hook(fraction, factor, options.max_new_tokens / factor, trainer.run.tokenizer.eos_token_id,
                              options.decode_latency / 1000)
        (trainer.side.model if K else c.policy).register_forward_hook(hook, with_kwargs=True)
    if options.train_latency:  # an accelerator's update: the trainer's step takes this much longer, on its cores
        trainer.components.optimizer.register_step_post_hook(
            lambda optimizer, args, kwargs: time.sleep(options.train_latency / 1000))
    rows, started = [], None
    def measure():  # (the side's thread is started by the first step)
        threads = [threading.get_native_id(), trainer.side.thread.native_id if K else None]
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
            "sampler_cpu": sampler_cpu, "sampler_queued": sampler_queued,
            "requeued": getattr(trainer.side, "requeued", 0)}


def summary(runs: list[dict]) -> dict:
    wall = sum(run["wall"] for run in runs)
    rows = [row for run in runs for row in run["rows"]]
    steps = len(rows)
    sample = statistics.fmean(row["time_sample"] + row["time_score"] for row in rows)
    # With a rollout server a push waits for the batches the previous weights still draw: that wait is the
    # trainer's idle time too, counted with the push itself (weight_sync_seconds; the push alone is milliseconds on
    # the tiny model), as benchmarks/fleet.py counts it.
    waiting = sum(row["time_waiting_for_rollouts"] + row.get("weight_sync_seconds", 0.0) for row in rows)
    return {"steps_per_minute": 60 * steps / wall, "t_sample": sample,
            "t_train": statistics.fmean(row["step_seconds"] - row["time_waiting_for_rollouts"] for row in rows),
            "trainer_idle": waiting / wall, "sampler_idle": sum(row["time_sampler_idle"] for row in rows) / wall,
            "staleness_max": max(row["staleness_max"] for row in rows), "steps": steps,
            "versions_per_sequence_max": max(row.get("versions_per_sequence_max", 1) for row in rows),
            "completion_length": statistics.fmean(row["completion_length"] for row in rows),
            "mismatch": statistics.fmean(row.get("rollout_logprob_diff_mean", 0.0) for row in rows),
            "requeued": sum(run["requeued"] for run in runs),
            **{key: sum(run[key] for run in runs) / steps
               for key in ("trainer_cpu", "trainer_queued", "sampler_cpu", "sampler_queued")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder, tiny or wide (random, built here: 2 layers of "
                        "96, 4 of 512), or the embedded model warm-started on arithmetic-generate (default)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--staleness", default="0,1,2", help="levels K, each run in turn; K+ with --in-flight-updates")
    parser.add_argument("--long-tail", default=None, help="F:X, a long-tailed completion length (see above)")
    parser.add_argument("--decode-latency", type=float, default=0.0, help="with --long-tail: milliseconds each decode "
                        "step of the sampling model sleeps, whatever its rows (a GPU's decode, simulated)")
    parser.add_argument("--train-latency", type=float, default=0.0, help="milliseconds each optimizer step also "
                        "sleeps: a trainer as slow as an accelerator's update of a large model, so that the sides "
                        "can be balanced (the trainer's idle time then says what the schedule leaves idle)")
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
    if options.long_tail and options.engine != "builtin":
        parser.error("--long-tail hooks the builtin engine's model (--engine builtin)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    levels = [value.strip() for value in options.staleness.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        model = random_model(Path(folder) / options.model, options.model) if options.model in SHAPES else options.model
        results = {K: [] for K in levels}
        server = None
        if options.rollout_side == "server":
            from servers import start_server

            program = ("-m", "auto_research")
            if options.long_tail:  # the server's model samples the long tail: this script, as its launcher
                program = (__file__, SERVE_WITH_TAIL, f"{options.long_tail}:{options.max_new_tokens}:"
                                                      f"{options.decode_latency}")
            server = start_server(model, threads=len(options.sampler_cores), engine=options.engine,
                                  memory=0.05 if options.engine == "vllm" else None, cores=options.sampler_cores,
                                  program=program)
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
          f"≤ {options.max_new_tokens} tokens; {options.rounds} rounds × {options.steps - options.warmup} timed steps"
          + (f"; each optimizer step sleeps {options.train_latency:g} ms" if options.train_latency else ""))
    print(f"K={levels[0]} phases: t_sample {base['t_sample']:.3f} s, t_train {base['t_train']:.3f} s; overlap bound "
          f"{bound:.2f}×, goal 0.9 × bound = {0.9 * bound:.2f}×" + (f"; long tail {options.long_tail}"
                                                                    if options.long_tail else ""))
    print(f"| K (+: in-flight updates) | steps/min | speedup vs K={levels[0]} | trainer idle | rollout side idle | "
          "staleness max | versions a completion | mean completion tokens | groups drawn again | mean |log π − log μ| "
          "| per step: trainer "
          "CPU s (waiting for a CPU s) | rollout side CPU s (waiting for a CPU s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for K, figure in figures.items():
        print(f"| {K} | {figure['steps_per_minute']:.1f} | {figure['steps_per_minute'] / base['steps_per_minute']:.2f}× "
              f"| {figure['trainer_idle']:.1%} | {figure['sampler_idle']:.1%} | {figure['staleness_max']} "
              f"| {figure['versions_per_sequence_max']} | {figure['completion_length']:.1f} | {figure['requeued']} "
              f"| {figure['mismatch']:.2e} "
              f"| {figure['trainer_cpu']:.3f} ({figure['trainer_queued']:.3f}) "
              f"| {figure['sampler_cpu']:.3f} ({figure['sampler_queued']:.3f}) |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end (other work on the machine delays both threads: the "
          "columns in brackets)")
    if options.json:
        options.json.write_text(json.dumps({"bound": bound, "figures": figures}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == SERVE_WITH_TAIL:
        raise SystemExit(serve_with_long_tail(sys.argv[2], sys.argv[3:]))
    main()
