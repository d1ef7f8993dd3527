"""Supervised fine-tuning on prompt → completion pairs (the warm start before RL): the mean NLL of the completion
tokens and the closing EOS. Prompts are tokenised alone and completions appended, as a rollout sees them."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from auto_research.progress import Progress


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    encoded = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt_ids, completion_ids))
    return encoded


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and a mask of the tokens that carry loss."""
    length = max(len(p) + len(c) for p, c in encoded)
    ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), length), dtype=torch.long)
    target = torch.zeros((len(encoded), length), dtype=torch.float)
    for row, (prompt, completion) in enumerate(encoded):
        sequence = prompt + completion
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        target[row, len(prompt) : len(sequence)] = 1.0
    return ids.to(device), attention.to(device), target.to(device)


def completion_nll(model, ids: torch.Tensor, attention: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    mask = target[:, 1:]
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def supervised_fine_tune(model, tokenizer, pairs: list[tuple[str, str]], steps: int, batch_size: int,
                         learning_rate: float, seed: int, warmup_steps: int = 0,
                         evaluate: Callable[[], dict] | None = None, eval_every: int = 0, progress: bool = True,
                         max_seconds: float | None = None) -> list[dict]:
    """Train for ``steps`` batches drawn epoch by epoch (or ``max_seconds``); return the eval history."""
    device = next(model.parameters()).device
    encoded = encode_pairs(tokenizer, pairs)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    order: list[int] = []
    history = []
    model.train()
    bar = Progress(steps, "supervised fine-tuning", enabled=progress, leave=False)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        out_of_time = max_seconds is not None and time.perf_counter() - started >= max_seconds
        if len(order) < batch_size:
            order += rng.permutation(len(encoded)).tolist()
        batch, order = order[:batch_size], order[batch_size:]
        loss = completion_nll(model, *collate([encoded[i] for i in batch], tokenizer.pad_token_id, device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.update({"loss": f"{loss.item():.3f}"})
        if evaluate is not None and eval_every and (step % eval_every == 0 or step == steps or out_of_time):
            model.eval()
            row = {"step": step, "loss": loss.item(), **evaluate()}
            model.train()
            history.append(row)
        if out_of_time:
            break
    bar.close()
    model.eval()
    return history
