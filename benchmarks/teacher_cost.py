"""A served teacher's cost (issue 55: at most 0.3× sampling): one builtin rollout server, a ``/generate`` of a batch
(prompts × K) against a ``/logprobs`` of the same rows (the prompts, the completions that generate drew), in
alternating rounds, with the ratio of their median times.

    python benchmarks/teacher_cost.py                      # the embedded model, a minute or so
    python benchmarks/teacher_cost.py --model smollm2      # SmolLM2-135M-Instruct, sums through its chat template
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import start_server  # noqa: E402

from auto_research.http import request  # noqa: E402


def prompts_of(model: str | None, count: int) -> list[list[int]]:
    """Token ids of ``count`` sums: bare ("41+19=") for the embedded model, in its chat template for another."""
    if model is None:
        from auto_research.engine.tiny import build_tokenizer

        generator = random.Random(0)
        texts = [f"{generator.randint(10, 99)}+{generator.randint(10, 99)}=" for _ in range(count)]
        return build_tokenizer()(texts, add_special_tokens=False)["input_ids"]
    from smollm2 import sums
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for row in sums(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="smollm2, or a model folder (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    args = parser.parse_args()
    if args.model == "smollm2":
        from smollm2 import model_folder

        args.model = str(model_folder())
    prompts = prompts_of(args.model, args.prompts)
    process, address = start_server(args.model, args.threads, engine="builtin")

    def call(path: str, body: dict) -> tuple[float, dict]:
        started = time.perf_counter()
        answer = json.loads(request(f"http://{address}{path}", json.dumps(body).encode(), "application/json", 600,
                                    0, 0.5))
        return time.perf_counter() - started, answer

    try:
        draw = {"prompt_ids": prompts, "group_size": args.group_size, "seeds": list(range(len(prompts))),
                "settings": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0}}
        _, drawn = call("/generate", draw)  # a warm-up, and the completions to score
        score = {"prompt_ids": [ids for ids in prompts for _ in range(args.group_size)],
                 "completion_ids": drawn["completions"]}
        call("/logprobs", score)
        times = {"/generate": [], "/logprobs": []}
        for number in range(args.rounds):
            for path in (("/generate", "/logprobs") if number % 2 == 0 else ("/logprobs", "/generate")):
                seconds, answer = call(path, draw if path == "/generate" else score)
                times[path].append(seconds)
                if path == "/generate":
                    assert answer["completions"] == drawn["completions"]  # the same seeds: the same rows scored
            print(f"round {number + 1}: generate {times['/generate'][-1]:.3f} s, logprobs {times['/logprobs'][-1]:.3f} s",
                  flush=True)
    finally:
        process.terminate()
        process.wait()
    generate, logprobs = statistics.median(times["/generate"]), statistics.median(times["/logprobs"])
    tokens = sum(map(len, drawn["completions"]))
    print(f"{args.model or 'embedded'}: {args.prompts} prompts x K={args.group_size}, {tokens} completion tokens "
          f"(max {args.max_new_tokens} new), server threads {args.threads}; median of {args.rounds} rounds: "
          f"generate {generate:.3f} s, logprobs {logprobs:.3f} s, ratio {logprobs / generate:.3f}x (goal <= 0.3x)")


if __name__ == "__main__":
    main()
