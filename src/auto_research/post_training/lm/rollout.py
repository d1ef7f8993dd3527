"""Sampling K completions per prompt: a lean decoding loop over the KV cache, seeded per prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def rows(self, start: int, stop: int, trim: bool = False) -> "Rollout":
        """Rows start … stop − 1 (a micro-batch of whole groups).

        With ``trim``, without the prompt columns that are left padding in every one of these rows
        and the completion columns after the longest of their completions: the forward then costs
        what the micro-batch holds, not what the longest row of the whole batch needs. Log-probs
        and values of the kept positions are unchanged (positions come from the attention mask).
        """
        sequences, prompt_mask, completion_mask = (self.sequences[start:stop], self.prompt_mask[start:stop],
                                                   self.completion_mask[start:stop])
        if trim and sequences.shape[0]:
            used_prompt = prompt_mask.any(0).nonzero()
            first = int(used_prompt[0]) if used_prompt.numel() else prompt_mask.shape[1] - 1
            used_completion = completion_mask.any(0).nonzero()
            width = int(used_completion[-1]) + 1 if used_completion.numel() else 1
            prompt_length = prompt_mask.shape[1]
            sequences = sequences[:, first: prompt_length + width]
            prompt_mask, completion_mask = prompt_mask[:, first:], completion_mask[:, :width]
        return Rollout(sequences, prompt_mask, completion_mask, self.completions[start:stop], self.group_size)


def concatenate(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout from several sampled separately: prompts left-padded, completions right-padded
    to the widest (padding is masked out, and positions come from the masks, so nothing changes)."""
    if len(rollouts) == 1:
        return rollouts[0]
    prompt_width = max(r.prompt_length for r in rollouts)
    completion_width = max(r.completion_mask.shape[1] for r in rollouts)
    sequences, prompt_masks, completion_masks = [], [], []
    for r in rollouts:
        left = prompt_width - r.prompt_length
        right = completion_width - r.completion_mask.shape[1]
        prompt = torch.nn.functional.pad(r.sequences[:, : r.prompt_length], (left, 0), value=pad_token_id)
        completion = torch.nn.functional.pad(r.completion_ids, (0, right), value=pad_token_id)
        sequences.append(torch.cat([prompt, completion], dim=1))
        prompt_masks.append(torch.nn.functional.pad(r.prompt_mask, (left, 0)))
        completion_masks.append(torch.nn.functional.pad(r.completion_mask, (0, right)))
    return Rollout(torch.cat(sequences), torch.cat(prompt_masks), torch.cat(completion_masks),
                   [text for r in rollouts for text in r.completions], rollouts[0].group_size)


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


def prompt_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of one prompt at one step: from the run's seed, the step and the prompt's
    dataset index, never from a process's random stream, so 1 or N processes draw the same samples."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, index]).generate_state(1, np.uint64)[0] >> 1)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k, then nucleus filtering (−inf outside), as Hugging Face's warpers order them.

    Nucleus keeps the smallest set of most probable tokens whose probability reaches ``top_p``
    (at least one token).
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probabilities = ordered.softmax(-1)
        # Mass strictly before each token: a token stays while the ones above it hold < top_p.
        before = probabilities.cumsum(-1) - probabilities
        remove = before >= top_p
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row b takes the first token whose cumulative probability exceeds u_b.

    Exact for the softmax of ``logits``, and a row's draw depends on its own uniform only, so
    batch composition cannot change which token a prompt gets.
    """
    cumulative = logits.softmax(-1).cumsum(-1)
    target = uniforms.unsqueeze(-1) * cumulative[..., -1:]
    index = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    return index.clamp(max=logits.shape[-1] - 1)


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
    seeds: list[int] | None = None,
) -> Rollout:
    """K samples for each prompt (or one greedy completion each when ``greedy``).

    A lean decoding loop over the model's KV cache. Every setting that shapes the
    distribution is an argument here; the checkpoint's ``generation_config``
    (repetition penalty, suppressed tokens, min_p …) is never read. Token t of a
    sample is logits/temperature → top-k → top-p → inverse CDF at a uniform drawn
    from the prompt's own generator (``seeds``, one per prompt), so the samples of a
    prompt do not depend on which other prompts share its batch or process.
    Without ``seeds`` the uniforms come from torch's global generator.
    """
    device = next(model.parameters()).device
    input_ids, attention = encode_prompts(tokenizer, prompts, device)
    repeats = 1 if greedy else group_size
    input_ids = input_ids.repeat_interleave(repeats, dim=0)
    attention = attention.repeat_interleave(repeats, dim=0)
    rows = input_ids.shape[0]
    uniforms = None
    if not greedy:
        if seeds is not None:
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
            uniforms = torch.cat([torch.rand(repeats, max_new_tokens, generator=torch.Generator().manual_seed(seed),
                                             dtype=torch.float64) for seed in seeds]).to(device)
        else:
            uniforms = torch.rand(rows, max_new_tokens, dtype=torch.float64).to(device)
    eos = torch.tensor(eos_ids(tokenizer, model), device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos[0])
    was_training = model.training
    model.eval()
    # transformers 5.2x renamed past_key_values to cache; older models keep the old name.
    cache_argument = _cache_argument(model)
    try:
        positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
        output = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                       logits_to_keep=1)
        position = positions[:, -1:] + 1
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        tokens = []
        for t in range(max_new_tokens):
            logits = output.logits[:, -1].float()
            if greedy:
                token = logits.argmax(-1)
            else:
                logits = logits / temperature if temperature != 1.0 else logits
                token = draw(filter_logits(logits, top_k, top_p).double(), uniforms[:, t])
            token = torch.where(finished, torch.full_like(token, pad), token)
            tokens.append(token)
            finished |= torch.isin(token, eos)
            if bool(finished.all()) or t == max_new_tokens - 1:
                break
            attention = torch.cat([attention, attention.new_ones(rows, 1)], dim=1)
            output = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=position,
                           use_cache=True, **{cache_argument: _cache_of(output)})
            position = position + 1
    finally:
        model.train(was_training)
    completion_ids = torch.stack(tokens, dim=1) if tokens else input_ids.new_zeros(rows, 0)
    sequences = torch.cat([input_ids, completion_ids], dim=1)
    mask = completion_mask(completion_ids, eos.tolist())
    texts = tokenizer.batch_decode(completion_ids * mask + pad * (1 - mask), skip_special_tokens=True)
    return Rollout(sequences, attention[:, : input_ids.shape[1]], mask, texts, repeats)


def _cache_argument(model) -> str:
    """The name under which this model's forward takes its KV cache (transformers 5.2x renamed it)."""
    from auto_research.post_training.lm.logprobs import accepts

    return "cache" if accepts(model, "cache") else "past_key_values"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


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
