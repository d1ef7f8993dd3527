"""What rows independent of their co-batched rows would cost the builtin sampler: one decode over the whole
batch (what one rollout server draws without --generation-batch-size) against the same prompts drawn in chunks of
c groups, down to one group a forward (a batch composition that depends only on the group, whatever the number
of servers). Also how far apart the log-probs of the same tokens are between the two compositions.

    OMP_NUM_THREADS=1 python benchmarks/batch_invariance.py            # the embedded model and a wider one

Random weights, arithmetic-like prompts of a few lengths, every row decoding --new-tokens tokens (no end token:
``drop_finished`` never shrinks the batch, so the times compare forwards of equal count). One torch thread."""

from __future__ import annotations

import argparse
import platform
import time

import torch

from auto_research.engine.rollout.builtin import sample
from auto_research.engine.tiny import build_model, build_tokenizer


def draw(model, tokenizer, prompts, group_size, new_tokens, chunk):
    parts = [sample(model, tokenizer, prompts[start: start + chunk], group_size, new_tokens, 1.0,
                    seeds=list(range(start, min(start + chunk, len(prompts)))), drop_finished=False)
             for start in range(0, len(prompts), chunk)]
    return parts


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    prompts = [f"{a} + {b * 37} =" for a, b in zip(range(args.prompts), range(3, 3 + args.prompts))]
    print(f"{_cpu()}, torch {torch.__version__}, 1 thread; "
          f"{args.prompts} prompts x {args.group_size}, {args.new_tokens} new tokens")
    for label, overrides in (("embedded (hidden 96, 3 layers)", {}),
                             ("wider (hidden 512, 8 layers)", dict(hidden_size=512, intermediate_size=1536,
                                                                   num_hidden_layers=8, num_attention_heads=8,
                                                                   num_key_value_heads=8, max_position_embeddings=128))):
        model = build_model(tokenizer, seed=0, **overrides)
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
        whole = None
        for chunk in (args.prompts, args.prompts // 4, 1):
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                parts = draw(model, tokenizer, prompts, args.group_size, args.new_tokens, chunk)
                best = min(best, time.perf_counter() - started)
            logprobs = torch.cat([part.sampler_logprobs.flatten() for part in parts])
            ids = torch.cat([part.completion_ids.flatten() for part in parts])
            if whole is None:
                whole, base = (ids, logprobs), best
                note = ""
            else:
                same = torch.equal(ids, whole[0])
                note = (f"; token ids {'equal' if same else 'differ'}, log-probs up to "
                        f"{(logprobs - whole[1]).abs().max().item():.1e} apart" if same else "; token ids differ")
            print(f"  {label}: chunks of {chunk:2d} groups: {best:6.3f} s ({best / base:4.2f}x the whole batch){note}")


if __name__ == "__main__":
    main()
