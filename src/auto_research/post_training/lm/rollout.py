"""Sampling K completions per prompt in one batched ``generate`` call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig


@dataclass
class Rollout:
    """B = groups · K rows; rows g·K … g·K + K − 1 answer prompt g."""

    sequences: torch.Tensor  # (B, P + C) left-padded prompt, then completion
    prompt_mask: torch.Tensor  # (B, P) 1 on prompt tokens, 0 on left padding
    completion_mask: torch.Tensor  # (B, C) 1 up to and including the first EOS
    completions: list[str]  # decoded completions, special tokens removed
    group_size: int

    @property
    def prompt_length(self) -> int:
        return self.prompt_mask.shape[1]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length :]

    def rows(self, start: int, stop: int) -> "Rollout":
        """Rows start … stop − 1 (a micro-batch of whole groups)."""
        return Rollout(
            self.sequences[start:stop],
            self.prompt_mask[start:stop],
            self.completion_mask[start:stop],
            self.completions[start:stop],
            self.group_size,
        )


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every completion token up to and including the first EOS, 0 after it.

    Padding that ``generate`` appends after a finished row comes after its EOS,
    so it is excluded too, whether or not the pad token equals EOS.
    """
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for token in eos_token_ids:
        is_eos |= completion_ids == token
    eos_so_far = is_eos.long().cumsum(dim=1)
    after_eos = (eos_so_far - is_eos.long()) > 0
    return (~after_eos).long()


def encode_prompts(tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    batch = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[str],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
) -> Rollout:
    """K samples for each prompt (or one greedy completion each when ``greedy``)."""
    device = next(model.parameters()).device
    input_ids, attention = encode_prompts(tokenizer, prompts, device)
    repeats = 1 if greedy else group_size
    input_ids = input_ids.repeat_interleave(repeats, dim=0)
    attention = attention.repeat_interleave(repeats, dim=0)
    options = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    eos = eos_ids(tokenizer, model)
    was_training = model.training
    saved_config = model.generation_config
    model.eval()
    # generate() fills every setting it is not given from the checkpoint's generation_config
    # (repetition_penalty, suppress_tokens, min_p, no_repeat_ngram_size …), which would sample
    # from another distribution than the one trained on. A blank config stands in while we
    # sample, so only the settings passed here shape the distribution.
    model.generation_config = GenerationConfig()
    try:
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
            **options,
        )
    finally:
        model.generation_config = saved_config
        model.train(was_training)
    completion_ids = sequences[:, input_ids.shape[1] :]
    mask = completion_mask(completion_ids, eos)
    texts = tokenizer.batch_decode(completion_ids * mask + tokenizer.pad_token_id * (1 - mask), skip_special_tokens=True)
    return Rollout(sequences, attention, mask, texts, repeats)


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(token) for token in configured)
    return sorted(ids)
