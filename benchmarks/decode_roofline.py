"""Where the builtin sampler's decoding time goes on this machine, against its memory bandwidth and matmul rate.

    python benchmarks/decode_roofline.py                                   # SmolLM2-135M-Instruct, 2 threads
    python benchmarks/decode_roofline.py --model tiny --threads 1          # a random 2-layer model, seconds

One invocation measures, side by side: the machine's read bandwidth (summing a 1 GiB tensor) and copy bandwidth;
the matmul rate at a decode step's shape (rows × hidden against each weight matrix of the model), with torch's plain
linear and as the sampler runs them (weights of 2^18 entries or more packed for oneDNN, engine/packed.py); the
sampler's completion tokens per second on 8 prompts × K = 4, ≤ 32 new tokens (``sample``, as a run calls it: a row
that has ended leaves the batch, the layers on packed weights), against the same loop on torch's plain layers (the
completions that differ counted) and against the loop that kept every row to the end (``drop_finished=False``, the
draws checked equal), rotating, the same seeds; and one
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
    from auto_research.engine.onednn import MIN_ELEMENTS
    from auto_research.engine.packed import pack, packed_linears, packed_product
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
    # As the sampler runs them: weights of MIN_ELEMENTS entries or more packed, the rest on torch's product.
    packed = [(pack(weight.detach(), rows) if weight.numel() >= MIN_ELEMENTS else None, weight) for weight in linears]

    def all_packed_matmuls():
        with torch.no_grad():
            for packed_weight, weight in packed:
                x = inputs[tuple(weight.shape)]
                packed_product(x, packed_weight) if packed_weight is not None else torch.nn.functional.linear(x, weight)

    packed_matmul_seconds = median_seconds(all_packed_matmuls, options.repeats)
    del packed

    # The sampler as a run calls it (rows that end leave the batch, the linear layers on weights packed for oneDNN:
    # engine/packed.py), against the same loop on torch's plain layers, and against the loop that kept every row to
    # the end, rotating in one process, each round's seeds the same for all.
    def sampler(round_, variant):
        with torch.backends.mkldnn.flags(enabled=variant != "plain"):
            rollout = sample(model, tokenizer, PROMPTS, options.group_size, options.max_new_tokens, 1.0,
                             seeds=[prompt_seed(0, round_, index) for index in range(len(PROMPTS))],
                             drop_finished=variant != "kept")
        return rollout.completion_ids.tolist(), int(rollout.completion_mask.sum()), rollout.completion_ids.shape[1]

    variants = ("run", "plain", "kept")
    for variant in variants:  # warm-up
        sampler(0, variant)
    timings = {variant: [] for variant in variants}
    tokens, widths, differing = [], [], []
    for round_ in range(1, options.repeats + 1):
        drawn = {}
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            started = time.perf_counter()
            drawn[variant] = sampler(round_, variant)
            timings[variant].append(time.perf_counter() - started)
        if drawn["run"] != drawn["kept"]:
            raise SystemExit(f"round {round_}: dropping finished rows changed the draws")
        # Another kernel sums in another order: logits move by ~1e-5, which moves an inverse-CDF draw that lands
        # among the far tail's tokens (probabilities ~1e-6, packed next to each other) to a neighbour.
        differing.append(sum(a != b for a, b in zip(drawn["run"][0], drawn["plain"][0])))
        tokens.append(drawn["run"][1])
        widths.append(drawn["run"][2])
    sample_seconds = statistics.median(timings["run"])
    plain_seconds = statistics.median(timings["plain"])
    kept_seconds = statistics.median(timings["kept"])
    rates = [n / t for n, t in zip(tokens, timings["run"])]
    plain_rates = [n / t for n, t in zip(tokens, timings["plain"])]
    kept_rates = [n / t for n, t in zip(tokens, timings["kept"])]
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

    with torch.no_grad(), packed_linears(model, rows):  # as the sampler runs it
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
          f"{matmul_flops / matmul_seconds / gb:.1f} GFLOP/s with torch's plain linear ({matmul_seconds * 1e3:.1f} ms "
          f"for one step's), {matmul_flops / packed_matmul_seconds / gb:.1f} GFLOP/s as the sampler runs them "
          f"({packed_matmul_seconds * 1e3:.1f} ms; weights of {MIN_ELEMENTS} entries or more packed for oneDNN)")
    print(f"sampler: {sample_seconds:.3f} s a call, {statistics.median(rates):.0f} completion tokens/s (rounds "
          f"{min(rates):.0f}…{max(rates):.0f}; {tokens:.0f} tokens a call, median), as a run samples: rows dropped "
          f"from the batch as they end, the linear layers on packed weights")
    print(f"  torch's plain linear layers: {plain_seconds:.3f} s a call, {statistics.median(plain_rates):.0f} tokens/s "
          f"(rounds {min(plain_rates):.0f}…{max(plain_rates):.0f}); completions of {rows} differing from the packed "
          f"layers' by round (a draw in the far tail moved by rounding): {differing}")
    print(f"  every row kept to the end: {kept_seconds:.3f} s a call, {statistics.median(kept_rates):.0f} "
          f"tokens/s (rounds {min(kept_rates):.0f}…{max(kept_rates):.0f}; {row_steps:.0f} row-steps decoded for "
          f"{tokens:.0f} tokens); the same draws every round")
    for label, other in (("packed / plain layers", "plain"), ("as a run / every row kept", "kept")):
        ratios = [theirs / ours for theirs, ours in zip(timings[other], timings["run"])]
        print(f"  throughput {label}: {statistics.median(timings[other]) / sample_seconds:.2f}x (rounds "
              f"{min(ratios):.2f}…{max(ratios):.2f})")
    step = forward_seconds + tail_seconds
    print(f"one decode step: {step * 1e3:.1f} ms = forward {forward_seconds * 1e3:.1f} ms + sampling tail "
          f"{tail_seconds * 1e3:.1f} ms ({tail_seconds / step:.0%})")
    floor_bandwidth = linear_bytes / read
    print(f"the forward (packed layers) against its floors: reading the matmul weights once at the read bandwidth "
          f"{floor_bandwidth * 1e3:.1f} ms ({floor_bandwidth / forward_seconds:.0%} of the forward); its matmuls at "
          f"the measured packed rate {packed_matmul_seconds * 1e3:.1f} ms "
          f"({packed_matmul_seconds / forward_seconds:.0%}); the rest "
          f"{max(0.0, forward_seconds - packed_matmul_seconds) * 1e3:.1f} ms (attention over the cache, norms, rotary "
          f"embedding, Python and dispatch)")
    print(f"achieved in the forward: {linear_bytes / forward_seconds / gb:.1f} GB/s of weights "
          f"({linear_bytes / forward_seconds / read:.0%} of the read bandwidth), "
          f"{matmul_flops / forward_seconds / gb:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
