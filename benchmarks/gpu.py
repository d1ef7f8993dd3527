"""RLOO throughput and memory on the machine at hand: generation and training tokens/s, model FLOPs
utilisation and peak memory, for full fine-tuning and LoRA, in one process and under torchrun.

    python benchmarks/gpu.py                    # CUDA: a ~0.5B Qwen2-shaped model; CPU: a tiny one
    python benchmarks/gpu.py --size tiny --steps 2 --variants full,lora   # what the tests run
    python benchmarks/gpu.py --sampler builtin,vllm  # on a GPU: vLLM against the builtin loop (tokens/s, weight sync)
    python benchmarks/gpu.py --max-staleness 1       # rollouts in flight: steps per minute, idle fractions

Nothing is downloaded: the model is randomly initialised in the shape of Qwen2.5-0.5B (24 layers,
hidden 896, 151,936-token vocabulary, tied embeddings) or, with ``--size tiny``, a 2-layer one with
a 32,000-token vocabulary, with the byte-level word tokenizer of ``vs_trl.py``. Each variant runs in
a process of its own (peak memory is per process): full and LoRA on one process, then, when several
GPUs are present, both under ``torchrun --nproc-per-node <GPUs>`` (DDP; add ``--fsdp`` to shard).
On CUDA the forward passes run under bf16 autocast over float32 master weights; on the CPU in
float32. Each measurement skips the first step (compilation of kernels, allocator warm-up).

Figures: generation tokens/s = completion tokens sampled / time in the collect phase; training
tokens/s = (prompt + completion) tokens through the policy's forward and backward / time in the
update; training state = the policy's weights, a gradient per trainable weight, the optimizer's states and
the reference's own weights, counted exactly (peak memory adds the allocator's working memory, whose
size varies from run to run); MFU = (2·N per token for each no-grad forward and every sampled token, 6·N per trained
token) / step time / the device's peak bf16 FLOP/s (known for A100, H100, H200; otherwise n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True),
    # Weights large enough next to the CPU's working memory for LoRA's saving to show (the tests' size).
    "wide": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True),
}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def build(folder: Path, size: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vs_trl import word_tokenizer

    shape = SHAPES[size]
    tokenizer = word_tokenizer(shape["vocab_size"])
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=1, **shape)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    prompts = [tokenizer.decode(torch.randint(258, shape["vocab_size"], (int(n),), generator=generator)).strip()
               for n in torch.randint(16, 48, (256,), generator=generator)]
    (folder / "prompts.json").write_text(json.dumps(prompts))


def child(options) -> None:
    """One measured run (every rank under torchrun): prints RESULT json on rank 0."""
    import torch

    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    folder = Path(options.folder)
    prompts = json.loads((folder / "prompts.json").read_text())
    rows = [{"prompt": prompt, "answer": "0"} for prompt in prompts]
    cuda = torch.cuda.is_available()
    config = GenerationConfig(model=str(folder), dataset="memory:gpu-bench", output_dir=folder / "runs",
                              steps=options.steps, prompts_per_step=options.prompts, group_size=4,
                              max_new_tokens=options.new_tokens, beta=0.05, learning_rate=1e-6, temperature=1.0,
                              progress=False, offline=True, device="cuda" if cuda else "cpu",
                              dtype="bfloat16" if cuda else "float32", chat_template=False, eval_every=0,
                              checkpoint_every=0, evaluation_examples=1, micro_batch_size=options.micro_batch,
                              lora_r=options.lora_r or None, fsdp=options.fsdp, sampler=options.sampler,
                              rollout_memory=options.vllm_memory, max_staleness=options.max_staleness)
    trainer = Trainer.build(config, log=lambda text: None, rows=rows,
                            reward_functions=[("length", lambda p, completions, r: [float(len(c)) for c in completions])])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps, rows_seen = [], []
    for step in range(1, options.steps + 1):
        started = time.perf_counter()
        rows_seen.append(trainer.step(step))
        steps.append(time.perf_counter() - started)
    trainer.close()
    c, world, tokenizer = trainer.models, trainer.run.world, trainer.run.tokenizer
    prompts = trainer.drawing.train_prompts
    parameters = sum(p.numel() for p in c.policy.parameters())
    held = held_bytes(c, trainer.run.config.lora.lora_r)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # This rank's prompt tokens, times the ranks: the step's (every rank holds as many prompts).
    prompt_tokens = sum(len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
                        for prompt in prompts) / len(prompts)
    result = {"steps": steps[1:], "collect": [row["time_sample"] for row in rows_seen[1:]],
              "update": [row["time_update_actor"] for row in rows_seen[1:]],
              "weight_sync": [row.get("weight_sync_seconds", 0.0) for row in rows_seen[1:]],
              "waiting": [row["time_waiting_for_rollouts"] for row in rows_seen[1:]],
              "sampler_idle": [row["time_sampler_idle"] for row in rows_seen[1:]],
              "mismatch": max((row.get("rollout_logprob_diff_max", 0.0) for row in rows_seen), default=0.0),
              "generated": [row["completion_length"] * options.prompts * 4 for row in rows_seen[1:]],
              "prompt_tokens": prompt_tokens * options.prompts * 4, "parameters": parameters, "peak_mb": peak,
              "processes": world.size, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "trainable": sum(p.numel() for p in c.policy.parameters() if p.requires_grad), "held": held}
    world.stop()
    if world.main:
        print("RESULT " + json.dumps(result), flush=True)


def held_bytes(c, lora_r: int) -> dict:
    """The training state this process holds, counted tensor by tensor: the policy's weights, a gradient
    for every trainable weight, the optimizer's states and the reference's own weights. Exact and the same
    on every run, where peak memory also holds the allocator's and the framework's working memory."""
    import torch

    def size(tensors) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    own_reference = c.reference is not None and not lora_r
    held = {"weights": size(c.policy.parameters()),
            "gradients": size(p for p in c.policy.parameters() if p.requires_grad),
            "optimizer": size(value for state in c.optimizer.state.values() for value in state.values()
                              if torch.is_tensor(value)),
            "reference": size(c.reference.parameters()) if own_reference else 0}
    return {**held, "total": sum(held.values())}


def run(folder: Path, options, lora: bool, processes: int) -> dict | None:
    arguments = ["--child", "--folder", str(folder), "--steps", str(options.steps), "--prompts", str(options.prompts),
                 "--new-tokens", str(options.new_tokens), "--micro-batch", str(options.micro_batch),
                 "--lora-r", str(options.lora_r if lora else 0), *(["--fsdp"] if options.fsdp and processes > 1 else []),
                 "--sampler", options.sampler, "--max-staleness", str(options.max_staleness),
                 *(["--vllm-memory", str(options.vllm_memory)] if options.vllm_memory else [])]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   __file__, *arguments]
    else:
        command = [sys.executable, __file__, *arguments]
    output = subprocess.run(command, capture_output=True, text=True)
    line = next((line for line in output.stdout.splitlines() if line.startswith("RESULT ")), None)
    if output.returncode or line is None:
        print(f"  failed ({'LoRA' if lora else 'full'}, {processes} process(es)):\n{output.stderr[-3000:]}")
        return None
    return json.loads(line[len("RESULT "):])


def report(name: str, result: dict, options) -> None:
    step = statistics.median(result["steps"])
    generated = statistics.median(result["generated"])
    generation = generated / statistics.median(result["collect"])
    trained = generated + result["prompt_tokens"]
    training = trained / statistics.median(result["update"])
    n = result["parameters"]
    # Sampling (2N per sampled token), reference and old-policy forwards (2 × 2N), policy forward + backward (6N).
    flops = 2 * n * generated + 2 * 2 * n * trained + 6 * n * trained
    peak_flops = next((value for key, value in PEAK_BF16_FLOPS.items() if key in result["device"]), None)
    mfu = f"{flops / step / (peak_flops * result['processes']):.1%}" if peak_flops else "n/a"
    print(f"  {name:22s} step {step:7.3f} s | generation {generation:9.0f} tok/s | training {training:9.0f} tok/s | "
          f"MFU {mfu:>6s} | peak memory {result['peak_mb']:8.0f} MB/process | training state "
          f"{result['held']['total'] / 2**20:7.1f} MB | trainable {result['trainable']:,}")
    total = sum(result["steps"])
    print(f"  {'':22s} --max-staleness {options.max_staleness}: {60 * len(result['steps']) / total:.1f} steps/min | "
          f"trainer idle {sum(result['waiting']) / total:.1%} | rollout side idle "
          f"{sum(result['sampler_idle']) / total:.1%}")
    if options.sampler == "vllm":
        sync = statistics.median(result["weight_sync"])
        print(f"  {'':22s} weight sync {sync:.3f} s ({sync / step:.1%} of the step) | max |Δlog p| "
              f"sampler/trainer {result['mismatch']:.2e}")
    elif options.max_staleness:
        print(f"  {'':22s} max |Δlog p| stale sampler/trainer {result['mismatch']:.2e} (corrected)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default=None, help="default: 0.5b on CUDA, tiny on the CPU")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 16 on CUDA, 4 on CPU)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 on CUDA, 16 on CPU")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--variants", default="full,lora")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 under torchrun instead of DDP")
    parser.add_argument("--sampler", default="builtin", help="builtin, vllm, or builtin,vllm (one after the other; "
                                                             "vllm in one process only)")
    parser.add_argument("--vllm-memory", type=float, default=None, help="default: the trainer's (0.3 GPU, 0.05 CPU)")
    parser.add_argument("--max-staleness", type=int, default=0, help="K: rollouts in flight (builtin sampler; "
                        "docs/async.md); steps per minute and both sides' idle fractions are reported")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    options = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    options.prompts = options.prompts or (16 if cuda else 4)
    options.new_tokens = options.new_tokens or (128 if cuda else 16)
    if options.child:
        return child(options)
    size = options.size or ("0.5b" if cuda else "tiny")
    gpus = torch.cuda.device_count() if cuda else 1
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        build(folder, size)
        device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores)"
        print(f"{size} Qwen2-shaped model on {device}: {options.prompts} prompts x K=4 per step, <= "
              f"{options.new_tokens} new tokens, micro-batches of {options.micro_batch}, {options.steps} steps "
              f"(the first not counted)")
        samplers = options.sampler.split(",")
        for sampler in samplers:
            options.sampler = sampler
            for processes in sorted({1, gpus}) if sampler == "builtin" else [1]:
                for variant in options.variants.split(","):
                    result = run(folder, options, variant == "lora", processes)
                    if result:
                        report(f"{sampler}, {variant}, {processes} proc", result, options)


if __name__ == "__main__":
    main()
