"""Where the builtin sampler's decoding time goes on this machine, against its memory bandwidth and matmul rate.

    python benchmarks/decode_roofline.py                                   # SmolLM2-135M-Instruct, 2 threads
    python benchmarks/decode_roofline.py --model tiny --threads 1          # a random 2-layer model, seconds

One invocation measures, side by side: the machine's read bandwidth (summing a 1 GiB tensor) and copy bandwidth;
the matmul rate at a decode step's shape (rows × hidden against each weight matrix of the model); the sampler's
completion tokens per second on 8 prompts × K = 4, ≤ 32 new tokens (``sample``, as a run calls it: a row that has
ended leaves the batch), against the loop that kept every row to the end (``drop_finished=False``), alternating,
the same seeds, the draws checked equal; and one
decode step split into the model's forward (one token per row, with the KV cache) and the sampling tail
(temperature, filters, softmax, the draw and the entropy, in float64, over the vocabulary). It prints what the
forward would take if it only read its weights at the measured bandwidth, or only ran its matmuls at the
measured rate, so the time left over is the rest (attention over the cache, norms, Python and dispatch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PROMPTS = ["What is 12 plus 30?", "Name a colour of the sky.", "Write a number between 1 and 9.", "Say hello.",
           "What is 7 times 8?", "Spell the word cat.", "Give one word that rhymes with tree.", "Count to three."]


def median_seconds(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name, folder or tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    import torch

    from auto_research.engine.logprobs import cache_argument, cache_of
    from auto_research.engine.rollout import prompt_seed
    from auto_research.engine.rollout.builtin import draw, encode_prompts, filter_logits, sample

    torch.set_num_threads(options.threads)
    if options.model == "tiny":
        from auto_research.engine.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=0, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                            num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=128)
    else:
        from auto_research.engine.models import load_policy

        model, tokenizer = load_policy(options.model, "cpu", torch.float32, offline=True, log=lambda line: None)
    model.eval()
    rows = len(PROMPTS) * options.group_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # What one decode step multiplies: every linear layer (the tied output layer included), not the embedding lookup.
    linears = [module.weight for module in model.modules() if isinstance(module, torch.nn.Linear)]
    matmul_flops = 2 * rows * sum(weight.numel() for weight in linears)
    linear_bytes = sum(weight.numel() * weight.element_size() for weight in linears)

    # The machine: bandwidth and the matmul rate at this model's decode shapes.
    big = torch.ones(2**28)  # 1 GiB of float32
    target = torch.empty_like(big)
    read = big.numel() * 4 / median_seconds(lambda: big.sum(), options.repeats)
    copy = 2 * big.numel() * 4 / median_seconds(lambda: target.copy_(big), options.repeats)
    del big, target
    inputs = {tuple(weight.shape): torch.randn(rows, weight.shape[1]) for weight in linears}

    def all_matmuls():
        with torch.no_grad():
            for weight in linears:
                torch.nn.functional.linear(inputs[tuple(weight.shape)], weight)

    matmul_seconds = median_seconds(all_matmuls, options.repeats)

    # The sampler as a run calls it (rows that end leave the batch), against the loop that kept every row to the
    # end, alternating in one process, each round's seeds the same for both: the same draws, other work.
    def sampler(round_, drop_finished):
        rollout = sample(model, tokenizer, PROMPTS, options.group_size, options.max_new_tokens, 1.0,
                         seeds=[prompt_seed(0, round_, index) for index in range(len(PROMPTS))],
                         drop_finished=drop_finished)
        return rollout.completion_ids.tolist(), int(rollout.completion_mask.sum()), rollout.completion_ids.shape[1]

    sampler(0, True), sampler(0, False)  # warm-up
    timings = {True: [], False: []}
    tokens, widths = [], []
    for round_ in range(1, options.repeats + 1):
        drawn = {}
        for drop_finished in (True, False) if round_ % 2 else (False, True):
            started = time.perf_counter()
            drawn[drop_finished] = sampler(round_, drop_finished)
            timings[drop_finished].append(time.perf_counter() - started)
        if drawn[True] != drawn[False]:
            raise SystemExit(f"round {round_}: dropping finished rows changed the draws")
        tokens.append(drawn[True][1])
        widths.append(drawn[True][2])
    sample_seconds = statistics.median(timings[True])
    kept_seconds = statistics.median(timings[False])
    rates = [n / t for n, t in zip(tokens, timings[True])]
    kept_rates = [n / t for n, t in zip(tokens, timings[False])]
    tokens = statistics.median(tokens)
    row_steps = rows * statistics.median(widths)

    # One decode step, split: the forward with the cache (after a prefill of the prompts), and the tail.
    input_ids, attention = encode_prompts(tokenizer, PROMPTS, "cpu")
    input_ids, attention = input_ids.repeat_interleave(options.group_size, 0), attention.repeat_interleave(
        options.group_size, 0)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                       logits_to_keep=1)
    cache, logits = cache_of(output), output.logits[:, -1].float()
    argument = cache_argument(model)
    step_attention = torch.cat([attention, attention.new_ones(rows, 1)], dim=1)
    token = logits.argmax(-1, keepdim=True)

    def forward():
        with torch.no_grad():
            model(input_ids=token, attention_mask=step_attention, position_ids=positions[:, -1:] + 1, use_cache=True,
                  **{argument: cache})
        cache.crop(-1)  # the same step again next time: the cache back to the prompts

    forward_seconds = median_seconds(forward, options.repeats * 4)
    uniforms = torch.rand(rows, dtype=torch.float64)

    def tail():
        filtered = filter_logits(logits, 0, 1.0).double()
        probabilities = filtered.softmax(-1)
        chosen = draw(filtered, uniforms, probabilities)
        probabilities.gather(-1, chosen.unsqueeze(-1)).log()
        -torch.special.xlogy(probabilities, probabilities).sum(-1)

    tail_seconds = median_seconds(tail, options.repeats * 4)

    gb = 1e9
    print(f"machine: {os.cpu_count()} cores, {options.threads} thread(s); model {options.model}: "
          f"{weight_bytes / gb:.3f} GB of fp32 weights, {linear_bytes / gb:.3f} GB in its matmuls; {rows} rows "
          f"({len(PROMPTS)} prompts × K={options.group_size}), ≤ {options.max_new_tokens} new tokens")
    print(f"bandwidth: read {read / gb:.1f} GB/s, copy {copy / gb:.1f} GB/s; matmuls at the decode shape: "
          f"{matmul_flops / matmul_seconds / gb:.1f} GFLOP/s ({matmul_seconds * 1e3:.1f} ms for one step's)")
    print(f"sampler: {sample_seconds:.3f} s a call, {statistics.median(rates):.0f} completion tokens/s (rounds "
          f"{min(rates):.0f}…{max(rates):.0f}; {tokens:.0f} tokens a call, median), rows dropped from the batch as "
          f"they end")
    print(f"  every row kept to the end: {kept_seconds:.3f} s a call, {statistics.median(kept_rates):.0f} tokens/s "
          f"(rounds {min(kept_rates):.0f}…{max(kept_rates):.0f}; {row_steps:.0f} row-steps decoded for {tokens:.0f} "
          f"tokens); the same draws every round")
    ratios = [kept / dropped for kept, dropped in zip(timings[False], timings[True])]
    print(f"  throughput dropping / keeping: {kept_seconds / sample_seconds:.2f}x (rounds {min(ratios):.2f}"
          f"…{max(ratios):.2f})")
    step = forward_seconds + tail_seconds
    print(f"one decode step: {step * 1e3:.1f} ms = forward {forward_seconds * 1e3:.1f} ms + sampling tail "
          f"{tail_seconds * 1e3:.1f} ms ({tail_seconds / step:.0%})")
    floor_bandwidth = linear_bytes / read
    print(f"the forward against its floors: reading the matmul weights once at the read bandwidth "
          f"{floor_bandwidth * 1e3:.1f} ms ({floor_bandwidth / forward_seconds:.0%} of the forward); its matmuls at "
          f"the measured rate {matmul_seconds * 1e3:.1f} ms ({matmul_seconds / forward_seconds:.0%}); the rest "
          f"{max(0.0, forward_seconds - matmul_seconds) * 1e3:.1f} ms (attention over the cache, norms, rotary "
          f"embedding, Python and dispatch)")
    print(f"achieved in the forward: {linear_bytes / forward_seconds / gb:.1f} GB/s of weights "
          f"({linear_bytes / forward_seconds / read:.0%} of the read bandwidth), "
          f"{matmul_flops / forward_seconds / gb:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
