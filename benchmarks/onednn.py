"""torch's float32 linear (MKL) against oneDNN's (engine/onednn.py) on this CPU, side by side in one run.

    python benchmarks/onednn.py                          # SmolLM2-135M-Instruct's shapes and its update, 2 threads
    python benchmarks/onednn.py --model none --rows 512  # the matrix products alone

Two measurements, each rotating the two implementations (A B A B …) and printing medians with their ranges:

1. The three products of a linear layer's training at SmolLM2-135M-Instruct's weight shapes and ``--rows`` rows
   (1,400: a step's tokens in the vs_trl benchmark): the forward x·Wᵀ, the input's gradient g·W and the weight's
   gradient gᵀ·x, in GFLOP/s, torch's (``F.linear``, ``@``) against oneDNN's (``onednn.linear`` and its backward).
2. With ``--model``: the update's forward and backward on that model, its decoder layers recomputed in the
   backward (--gradient-checkpointing), over 8 prompts × K = 4 completions of 32 tokens: the log-probs of
   ``token_logprobs`` (a group's prompt once, the output layer in chunks) and their gradient, on the model's
   layers as loaded (oneDNN's) against the same model on torch's layers (``onednn.use_torch``). Also the largest
   difference of the log-probs and the gradients' relative difference, to show the two compute the same thing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"q_proj, o_proj": (576, 576), "k_proj, v_proj": (576, 192), "gate_proj, up_proj": (576, 1536),
          "down_proj": (1536, 576), "lm_head (tied)": (576, 49152)}
"""SmolLM2-135M-Instruct's linear layers, as (in, out)."""


def rotate(functions: dict, repeats: int) -> dict:
    """Seconds of each function over ``repeats`` rounds, run in turn within each round (after one warm call each)."""
    for function in functions.values():
        function()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            function()
            times[name].append(time.perf_counter() - started)
    return times


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f} … {max(values):.2f})"


def products(rows: int, repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from auto_research.engine import onednn

    print(f"products at {rows} rows, GFLOP/s (medians of {repeats}; torch / oneDNN, ratio oneDNN ÷ torch by round):")
    for name, (fan_in, fan_out) in SHAPES.items():
        x, weight, grad = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in), torch.randn(rows, fan_out)
        flops = 2 * rows * fan_in * fan_out
        pairs = {"forward x·Wᵀ": (lambda: F.linear(x, weight), lambda: onednn.kernel(x, weight)),
                 "input's gradient g·W": (lambda: grad @ weight, lambda: onednn.kernel(grad, weight.t())),
                 "weight's gradient gᵀ·x": (lambda: grad.t() @ x, None)}
        for product, (theirs, ours) in pairs.items():
            if ours is None:
                times = rotate({"torch": theirs}, repeats)
                print(f"  {name:18s} {product:24s} {flops / statistics.median(times['torch']) / 1e9:6.0f}        "
                      f"(torch's in both)")
                continue
            times = rotate({"torch": theirs, "onednn": ours}, repeats)
            ratios = [a / b for a, b in zip(times["torch"], times["onednn"])]
            print(f"  {name:18s} {product:24s} {flops / statistics.median(times['torch']) / 1e9:6.0f} / "
                  f"{flops / statistics.median(times['onednn']) / 1e9:4.0f}  × {spread(ratios)}")


def update_step(tokenizer, results: dict, vocabulary: int = 10000):
    """``(step, tokens)``: ``step(network, name)`` is a function running the update's forward and backward on a
    fixed batch (8 prompts × 4 completions of up to 32 tokens), keeping its log-probs and gradients in
    ``results[name]``."""
    import torch

    from auto_research.engine.logprobs import token_logprobs
    from auto_research.engine.models import format_prompt
    from smollm2 import sums

    prompts = [format_prompt(tokenizer, row["question"], True) for row in sums(8)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    generator = torch.Generator().manual_seed(0)
    completions = torch.randint(min(100, vocabulary // 2), vocabulary, (32, 32), generator=generator)
    lengths = torch.randint(8, 33, (32,), generator=generator)
    mask = (torch.arange(32)[None] < lengths[:, None]).float()
    sequences = torch.cat([encoded["input_ids"].repeat_interleave(4, 0), completions], 1)
    prompt_mask = encoded["attention_mask"].repeat_interleave(4, 0)
    weights = torch.linspace(-1, 1, 32)

    def step(network, name):
        def run():
            network.zero_grad(set_to_none=True)
            logprobs = token_logprobs(network, sequences, prompt_mask, mask, group_size=4)
            (logprobs * weights).sum().backward()
            results[name] = logprobs.detach(), [p.grad for p in network.parameters()]
        return run

    return step, int(prompt_mask.sum() / 4 + mask.sum())


def update(model_name: str, repeats: int) -> None:
    import torch

    from auto_research.engine import onednn
    from auto_research.engine.models import load_policy
    from auto_research.train.components import checkpoint_layers

    model, tokenizer = load_policy(model_name, "cpu", torch.float32, offline=True, log=lambda line: None)
    model.eval()
    theirs = copy.deepcopy(model)
    changed = onednn.use_torch(theirs)
    checkpoint_layers(model), checkpoint_layers(theirs)
    results = {}
    step, tokens = update_step(tokenizer, results)
    print(f"\nthe update's forward and backward on {model_name} ({changed} linear layers on oneDNN; 8 prompts × 4 "
          f"completions, {tokens} tokens, layers recomputed), seconds (medians of {repeats}, ranges):")
    times = rotate({"torch": step(theirs, "torch"), "onednn": step(model, "onednn")}, repeats)
    ratios = [a / b for a, b in zip(times["torch"], times["onednn"])]
    print(f"  torch's layers {spread(times['torch'])} s, oneDNN's {spread(times['onednn'])} s: "
          f"oneDNN {spread(ratios)}× as fast")
    (a, grads_a), (b, grads_b) = results["torch"], results["onednn"]
    relative = max(float((x - y).norm() / y.norm().clamp(min=1e-30)) for x, y in zip(grads_b, grads_a))
    print(f"  largest log-prob difference {float((a - b).abs().max()):.2e}; largest relative gradient difference "
          f"(by tensor, Frobenius) {relative:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name or folder; none: skip")
    parser.add_argument("--rows", type=int, default=1400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    import torch

    from auto_research.engine import onednn

    if not onednn.available():
        raise SystemExit("this torch build has no oneDNN linear: nothing to compare")
    torch.set_num_threads(options.threads)
    products(options.rows, options.repeats)
    if options.model != "none":
        update(options.model, max(3, options.repeats // 2))


if __name__ == "__main__":
    main()
