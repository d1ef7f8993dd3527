"""auto-research's RLOO against TRL's RLOOTrainer: seconds per step and peak memory, side by side.

    pip install trl            # a benchmark dependency only, never a runtime one
    python benchmarks/vs_trl.py [--sizes small,medium] [--rounds 3] [--steps 8] [--threads 1]
    python benchmarks/vs_trl.py --model smollm2 [--rounds 3] [--steps 4] [--threads 2]

With ``--model smollm2``: SmolLM2-135M-Instruct (benchmarks/smollm2.py), chat prompts (conversational for
TRL, the same text through the chat template for ours), 8 prompts × K = 4, at most 32 new tokens,
temperature 1.0, β 0.05, learning rate 1e-6, float32, one update per step, the same reward (the share of
digits in a completion); sampling in one call of 32 completions for ours. Besides the ratios it prints our
step's time per phase against the FLOPs of that phase and the machine's float32 matmul rate, so the
distance to what the CPU can do shows.

Both train the same randomly initialised Qwen2 (a 32,000-token vocabulary, untied output layer)
on the same prompts with the same reward: K = 4 completions for each of 8 prompts a step, at most
32 new tokens with completions of varied lengths (the EOS row of the output layer is tilted so
that roughly one completion in two stops early), β = 0.05, learning rate 1e-5, float32, one
optimizer update per step, no evaluation, logging to disk or checkpoints inside the timed steps.
Each measurement is its own process; the implementations alternate A B A B …, and the script
prints the median seconds per step (steps after the first two), the peak resident memory of the
process and of its training alone (peak minus the resident size once the models are loaded), and
the ratios ours / TRL's. Goals: step time <= 0.5x and peak memory <= 0.7x TRL's at the 32k vocabulary with
varied lengths (issue 8); on SmolLM2, step time <= 0.35x and peak RSS <= 0.5x TRL's (issue 26).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {
    # 32k vocabulary; parameters are dominated by the embeddings and the output layer.
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2),
    "medium": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2),
}
VOCABULARY = 32000
K, PROMPTS, NEW_TOKENS, BETA, LEARNING_RATE = 4, 8, 32, 0.05, 1e-5


def word_tokenizer(size: int = VOCABULARY):
    """A byte-level BPE of ``size`` (32,000) tokens: two specials, the 256 bytes, and the words " a" … " zz" … of
    up to four letters (every prefix of a word is a word, so each merges into one token).

    It is built as Qwen2's own tokenizer family (byte-level BPE behind Qwen2's split pattern), because
    transformers 5 rebuilds any tokenizer saved beside a Qwen2 config as a Qwen2 tokenizer.
    """
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    space = "\u0120"  # the byte-level symbol of " "
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocabulary = {"<pad>": 0, "<eos>": 1}
    for symbol in sorted(byte_symbols):
        vocabulary[symbol] = len(vocabulary)
    merges = []
    for length in range(1, 5):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            if len(vocabulary) == size:
                break
            word = space + "".join(letters)
            vocabulary[word] = len(vocabulary)
            merges.append((word[:-1], word[-1]))
    core = Tokenizer(models.BPE(vocab=vocabulary, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def build(folder: Path, size: str) -> None:
    """The model, a word-level tokenizer of 32,000 words and 64 prompts, saved in ``folder``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCABULARY, max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, **SIZES[size])
    model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    prompts = [tokenizer.decode(torch.randint(258, VOCABULARY, (int(n),), generator=generator)).strip()
               for n in torch.randint(4, 12, (64,), generator=generator)]
    # Tilt EOS towards the hidden states' mean direction, so that completions end at varied lengths.
    with torch.no_grad():
        batch = tokenizer(prompts[:16], return_tensors="pt", padding=True)
        hidden = model.model(**batch).last_hidden_state[batch["attention_mask"].bool()]
        direction = hidden.mean(0)
        logits = model.lm_head(hidden)
        target = logits.logsumexp(-1).mean() - 3.5  # P(EOS) of a few percent per token
        model.lm_head.weight[1] = direction * (target / direction.square().sum())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "prompts.json").write_text(json.dumps(prompts))


def reward(completions) -> list[float]:
    """The same reward for both: how many words of the completion have an even number of letters."""
    return [float(sum(len(word) % 2 == 0 for word in text.split())) for text in completions]


def _rss_mb() -> float:
    with open("/proc/self/statm") as stream:
        return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _setting(folder: Path) -> tuple[list[str], bool, float, object]:
    """(prompts, whether they are chat questions, learning rate, reward) of the model in ``folder``."""
    if (folder / "smollm2.json").is_file():
        from smollm2 import digit_reward

        return json.loads((folder / "smollm2.json").read_text()), True, 1e-6, digit_reward
    return json.loads((folder / "prompts.json").read_text()), False, LEARNING_RATE, reward


OURS_SETTINGS = ("checkpoint_mlp", "gradient_checkpointing", "offload_reference", "max_tokens_per_micro_batch")
"""Settings of ours that TRL has no counterpart of in this comparison (each a flag of this script)."""


def run_ours(folder: Path, steps: int, micro: int = 0, settings: dict | None = None) -> dict:
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    prompts, chat, learning_rate, scorer = _setting(folder)
    model = folder / "model" if (folder / "model").exists() else folder
    rows = [{"prompt": prompt, "answer": "0"} for prompt in prompts]
    config = GenerationConfig(model=str(model), dataset="memory:bench", output_dir=folder / "ours", steps=steps,
                              prompts_per_step=PROMPTS, group_size=K, max_new_tokens=NEW_TOKENS, beta=BETA,
                              learning_rate=learning_rate, warmup_steps=0, temperature=1.0, top_p=1.0, top_k=0,
                              progress=False, offline=True, device="cpu", dtype="float32", chat_template=chat,
                              eval_every=0, checkpoint_every=0, evaluation_examples=1, micro_batch_size=micro or None,
                              generation_batch_size=PROMPTS * K, **(settings or {})).filled().validate()
    trainer = Trainer.build(config, log=lambda text: None, rows=rows, reward_functions=[("bench", lambda p, c, r: scorer(c))])
    loaded = _rss_mb()
    times, lengths, phases = [], [], []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        row = trainer.step(step)
        times.append(time.perf_counter() - started)
        lengths.append(row["completion_length"])
        phases.append({key[5:]: value for key, value in row.items() if key.startswith("time_")})
    c, prompts = trainer.models, trainer.drawing.train_prompts
    prompt_tokens = sum(len(trainer.run.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    offloaded = trainer.models.offloaded_reference
    return {"times": times, "lengths": lengths, "peak_mb": _peak_mb(), "loaded_mb": loaded, "phases": phases,
            "offloaded_mb": sum(p.numel() * p.element_size() for p in dict.fromkeys(c.reference.parameters())) / 2**20
            if offloaded is not None else 0.0,
            "prompt_tokens": prompt_tokens / len(prompts),
            "parameters": sum(p.numel() for p in c.policy.parameters()),
            "embedding": c.policy.get_output_embeddings().weight.numel()}


def run_trl(folder: Path, steps: int, micro: int = 0, recompute: bool = False) -> dict:
    """TRL's RLOOTrainer on the same model, prompts and reward (``recompute``: its gradient_checkpointing)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    prompts, chat, learning_rate, scorer = _setting(folder)
    model_folder = folder / "model" if (folder / "model").exists() else folder
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype="float32")
    times, lengths, started = [], [], {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - started["t"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    # With micro-batches: the same 32 completions generated at once, the update accumulated over 32 // micro parts.
    accumulation = (PROMPTS * K) // micro if micro else 1
    args = RLOOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=PROMPTS * K // accumulation,
                      num_generations=K, steps_per_generation=accumulation, num_iterations=1,
                      gradient_accumulation_steps=accumulation,
                      max_completion_length=NEW_TOKENS, beta=BETA, learning_rate=learning_rate,
                      lr_scheduler_type="constant", temperature=1.0, top_p=1.0, top_k=0, max_steps=steps,
                      logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                      disable_dropout=True, seed=0, dataloader_num_workers=0, gradient_checkpointing=recompute)
    def texts(completions):  # conversational completions are message lists
        return [c[0]["content"] if isinstance(c, list) else c for c in completions]

    dataset = {"prompt": [[{"role": "user", "content": p}] for p in prompts] if chat else prompts}
    trainer = RLOOTrainer(model=model, reward_funcs=lambda prompts, completions, **kw: scorer(texts(completions)),
                          args=args, train_dataset=Dataset.from_dict(dataset), processing_class=tokenizer,
                          callbacks=[Clock()])
    loaded = _rss_mb()
    trainer.train()
    return {"times": times, "lengths": lengths, "peak_mb": _peak_mb(), "loaded_mb": loaded}


def child(options) -> None:
    import torch

    torch.set_num_threads(options.threads)
    folder = Path(options.folder)
    if options.child == "ours":
        result = run_ours(folder, options.steps, options.micro_batch, ours_settings(options))
    else:
        result = run_trl(folder, options.steps, options.micro_batch, options.gradient_checkpointing)
    print("RESULT " + json.dumps(result), flush=True)


def ours_settings(options) -> dict:
    """The OURS_SETTINGS given on the command line, as GenerationConfig fields."""
    return {name: getattr(options, name) for name in OURS_SETTINGS if getattr(options, name)}


def ours_flags(options) -> list[str]:
    flags = []
    for name, value in ours_settings(options).items():
        flags += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
    return flags


def measure(name: str, folder: Path, options) -> dict:
    command = [sys.executable, __file__, "--child", name, "--folder", str(folder), "--steps", str(options.steps),
               "--threads", str(options.threads), "--micro-batch", str(options.micro_batch), *ours_flags(options)]
    environment = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    output = subprocess.run(command, capture_output=True, text=True, env=environment)
    line = next((line for line in output.stdout.splitlines() if line.startswith("RESULT ")), None)
    if output.returncode or line is None:
        raise SystemExit(f"{name} failed:\n{output.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def smollm2(folder: Path) -> None:
    """The real model's folder (linked), and its chat questions, in ``folder``."""
    from smollm2 import model_folder, sums

    (folder / "model").symlink_to(model_folder(), target_is_directory=True)
    (folder / "smollm2.json").write_text(json.dumps([row["question"] for row in sums(64)]))


def flops_report(runs: list[dict], threads: int, recomputed: bool = False) -> None:
    """Our step's phases against their FLOPs and the machine's float32 matmul rate (``recomputed``: the layers'
    forward counted again in the update, --gradient-checkpointing)."""
    import torch

    from smollm2 import matmul_rate, phase_flops

    torch.set_num_threads(threads)
    rate = matmul_rate()
    first = runs[0]
    completion = statistics.mean(x for run in runs for x in run["lengths"][1:])
    flops = phase_flops(first["parameters"], first["embedding"], PROMPTS, K, first["prompt_tokens"], completion,
                        recomputed)
    print(f"  our phases (medians; FLOPs 2 a weight a token forward, 4 more backward"
          f"{', 2 more for the recomputed layers' if recomputed else ''}; the machine's float32 matmul "
          f"rate {rate / 1e9:.0f} GFLOP/s with {threads} threads):")
    for phase, count in flops.items():
        seconds = statistics.median(step[phase] for run in runs for step in run["phases"][1:])
        print(f"    {phase:13s} {seconds:6.2f} s  {count / 1e9:7.1f} GFLOP  {count / seconds / 1e9:6.1f} GFLOP/s  "
              f"= {count / seconds / rate:.0%} of the matmul rate")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2"], default=None, help="the real model instead of --sizes")
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs per size")
    parser.add_argument("--steps", type=int, default=8, help="steps per measured process (the first 2 are warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--checkpoint-mlp", action="store_true", help="ours with --checkpoint-mlp (TRL as it is)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both recompute their decoder layers in the backward pass: ours with "
                             "--gradient-checkpointing, TRL with gradient_checkpointing=True")
    parser.add_argument("--offload-reference", action="store_true",
                        help="ours with --offload-reference (TRL as it is); the reference's MB, then in the page "
                             "cache and not in our peak RSS, are printed beside it")
    parser.add_argument("--micro-batch", type=int, default=0, help="completions a forward/backward, for both: ours "
                        "--micro-batch-size, TRL's gradient accumulation over the same generation (default: all 32)")
    parser.add_argument("--max-tokens-per-micro-batch", type=int, default=0,
                        help="ours with --max-tokens-per-micro-batch N (packed micro-batches; TRL as it is)")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        return child(options)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs TRL: pip install trl") from None
    for size in (["smollm2"] if options.model else options.sizes.split(",")):
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch)
            smollm2(folder) if options.model else build(folder, size)
            results = {"ours": [], "trl": []}
            for round_ in range(options.rounds):
                for name in ("ours", "trl"):
                    results[name].append(measure(name, folder, options))
            weights = folder / "model" / "model.safetensors" if options.model else folder / "model.safetensors"
            parameters = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"])
                             .load_file(str(weights)).values())
        vocabulary = 49152 if options.model else VOCABULARY
        print(f"\n{size}: {parameters / 1e6:.1f}M parameters, vocabulary {vocabulary}, K={K}, {PROMPTS} prompts/step, "
              f"<= {NEW_TOKENS} new tokens, {options.threads} thread(s), {options.rounds} alternating rounds; ours "
              f"with {' '.join(ours_flags(options)) or 'the defaults'}; TRL with "
              f"{'gradient_checkpointing=True' if options.gradient_checkpointing else 'its defaults'}")
        summary = {}

        def spread(values) -> str:
            return f"{statistics.median(values):.2f} (range {min(values):.2f} … {max(values):.2f})"

        for name, runs in results.items():
            step = statistics.median(t for run in runs for t in run["times"][2:])
            peak = statistics.median(run["peak_mb"] for run in runs)
            training = statistics.median(run["peak_mb"] - run["loaded_mb"] for run in runs)
            length = statistics.mean(x for run in runs for x in run["lengths"])
            summary[name] = (step, peak, training)
            rounds = ", ".join(f"{statistics.median(run['times'][2:]):.2f}" for run in runs)
            print(f"  {name:5s} median step {step:.3f} s (rounds: {rounds}), peak RSS {peak:.0f} MB, training above "
                  f"loaded models {training:.0f} MB, mean completion length {length:.1f}")
        (ours_step, ours_peak, ours_training), (trl_step, trl_peak, trl_training) = summary["ours"], summary["trl"]
        pairs = list(zip(results["ours"], results["trl"]))
        step_ratios = [statistics.median(a["times"][2:]) / statistics.median(b["times"][2:]) for a, b in pairs]
        peak_ratios = [a["peak_mb"] / b["peak_mb"] for a, b in pairs]
        print(f"  ratio ours/TRL: step time {ours_step / trl_step:.3f}, by round {spread(step_ratios)} "
              f"(goal <= 0.35); peak RSS {ours_peak / trl_peak:.3f}, by round {spread(peak_ratios)} (goal <= 0.5); "
              f"training memory {ours_training / max(trl_training, 1e-9):.2f}")
        offloaded = statistics.median(run["offloaded_mb"] for run in results["ours"])
        if offloaded:
            print(f"  ours offloads its reference: {offloaded:.0f} MB in the page cache (reclaimable) and not in its "
                  f"peak RSS; counting it, the peak ratio would be {(ours_peak + offloaded) / trl_peak:.3f}")
        if options.model:
            flops_report(results["ours"], options.threads, recomputed=bool(options.gradient_checkpointing))


if __name__ == "__main__":
    main()
