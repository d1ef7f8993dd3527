"""Rollout: the Sampler seam. A sampler turns prompts into K completions each, from given seeds, with its own
log-probabilities of the tokens it drew (``sample``); it is handed the policy's new weights after every optimizer
step (``load_weights``). The builtin loop (``builtin.py``) samples from the training model itself; another engine
(vLLM, a rollout server) returns the same ``Rollout``, with what it needs in ``remote.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingSettings:
    """Every setting that shapes the sampled distribution, passed explicitly (never a checkpoint's
    ``generation_config``)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Rollout:
    """B = groups · K rows; rows g·K … g·K + K − 1 answer prompt g."""

    sequences: torch.Tensor
    """(B, P + C) left-padded prompt, then completion."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on prompt tokens, 0 on left padding."""
    completion_mask: torch.Tensor
    """(B, C) 1 up to and including the first EOS."""
    completions: list[str]
    """Decoded completions, special tokens removed."""
    group_size: int
    sampler_logprobs: torch.Tensor | None = None
    """(B, C) the sampler's log-probability of each drawn token under the distribution it sampled (after
    temperature, top-k and top-p), 0 where masked; None for greedy decoding or a fixed batch."""
    sampler_entropy: torch.Tensor | None = None
    """(B, C) the entropy of the distribution each token was drawn from, 0 where masked (when the sampler has it)."""
    trained_distribution: bool = False
    """The sampler drew from the training model's own distribution, unfiltered (the builtin loop with no top-k
    or top-p): its log-probs are the policy's, so with one update per batch no forward need recompute them."""
    policy_versions: torch.Tensor | None = None
    """(B,) the weights version that drew each row (the policy after that many steps); None: the current one."""
    loss_mask: torch.Tensor | None = None
    """(B, C) multi-turn trajectories (envs/): 1 on the model's own tokens, 0 on the environment's and the tools'
    inside the completion span (``completion_mask``); None: every completion token is the model's."""
    episodes: list[dict] | None = None
    """Multi-turn trajectories: one dict per row (turns, tool_calls, tool_errors, truncated, reward of the
    environment, failed, the final reply the reward functions score); None for single-turn rollouts."""
    token_versions: torch.Tensor | None = None
    """(B, C) the weights version that drew each token, −1 where masked (--in-flight-updates: a completion may
    span versions, ``policy_versions`` is then each row's oldest); None: every token has its row's version."""

    def to(self, device) -> "Rollout":
        """Every tensor of the rollout on ``device`` (a remote or multi-turn sampler returns CPU tensors)."""
        moved = {field: value.to(device) for field, value in vars(self).items() if isinstance(value, torch.Tensor)}
        return replace(self, **moved)

    @property
    def trained_mask(self) -> torch.Tensor:
        """(B, C) the tokens that log-probs, KL, entropy and the loss count: the model's own."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def prompt_length(self) -> int:
        return self.prompt_mask.shape[1]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.sequences[:, self.prompt_length:]

    def token_lists(self) -> list[list[int]]:
        """Each completion's token ids up to and including its EOS (TRL's ``completion_ids``)."""
        lengths = self.completion_mask.sum(1).tolist()
        return [row[: int(length)] for row, length in zip(self.completion_ids.tolist(), lengths)]

    def drawn(self) -> tuple[list[list[int]], list[list[float]]]:
        """``token_lists`` and the sampler's log-prob of each of those tokens (an engine's ``generate``)."""
        tokens = self.token_lists()
        return tokens, [row[: len(ids)] for row, ids in zip(self.sampler_logprobs.tolist(), tokens)]

    def rows(self, start: int, stop: int, trim: bool = False) -> "Rollout":
        """Rows start … stop − 1 (a micro-batch of whole groups). ``trim``: without the columns that are padding in
        every one of these rows, so the forward costs what the micro-batch holds (positions come from the attention
        mask, so the kept positions' log-probs and values are unchanged)."""
        sequences, prompt_mask, completion_mask = (self.sequences[start:stop], self.prompt_mask[start:stop],
                                                   self.completion_mask[start:stop])
        per_token = {name: None if getattr(self, name) is None else getattr(self, name)[start:stop]
                     for name in PER_TOKEN}
        if trim and sequences.shape[0]:
            used_prompt = prompt_mask.any(0).nonzero()
            first = int(used_prompt[0]) if used_prompt.numel() else prompt_mask.shape[1] - 1
            used_completion = completion_mask.any(0).nonzero()
            width = int(used_completion[-1]) + 1 if used_completion.numel() else 1
            prompt_length = prompt_mask.shape[1]
            sequences = sequences[:, first: prompt_length + width]
            prompt_mask, completion_mask = prompt_mask[:, first:], completion_mask[:, :width]
            per_token = {name: None if value is None else value[:, :width] for name, value in per_token.items()}
        return replace(self, sequences=sequences, prompt_mask=prompt_mask, completion_mask=completion_mask,
                       completions=self.completions[start:stop],
                       policy_versions=None if self.policy_versions is None else self.policy_versions[start:stop],
                       episodes=None if self.episodes is None else self.episodes[start:stop], **per_token)


PER_TOKEN = {"sampler_logprobs": 0, "sampler_entropy": 0, "loss_mask": 0, "token_versions": -1}
"""The optional (B, C) fields of a ``Rollout``, and the value that pads each past a completion's end."""


class Sampler(Protocol):
    """What the training step needs of a rollout engine, and what it declares it offers."""

    streams: bool
    """Draws across batches (``stream(version, policy)``, ``fleet_stream.Stream``): a fleet of servers."""
    partial: bool
    """Decodes partial rollouts in rounds (``partial_round``, ``partial_state``, ``partial_restore``)."""
    pushed_bytes: int | None
    """The bytes of tensors its last weight push sent; None: it is given no weights that way."""

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        """K completions of each prompt; prompt i's draws come from ``seeds[i]`` alone, so which batch or
        process samples a prompt changes nothing."""

    def load_weights(self, model) -> None:
        """Take the policy's weights after an optimizer step (before the next ``sample``)."""

    def close(self) -> None:
        """The run is over (or failed): let go of what the sampler holds outside this process (a server's lease)."""


def concatenate(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout from several sampled separately: prompts left-padded, completions right-padded to the widest
    (masked out, and positions come from the masks, so nothing changes)."""
    if len(rollouts) == 1:
        return rollouts[0]
    prompt_width = max(r.prompt_length for r in rollouts)
    completion_width = max(r.completion_mask.shape[1] for r in rollouts)
    pad = torch.nn.functional.pad
    sequences, prompt_masks, completion_masks = [], [], []
    for r in rollouts:
        left = prompt_width - r.prompt_length
        right = completion_width - r.completion_mask.shape[1]
        prompt = pad(r.sequences[:, : r.prompt_length], (left, 0), value=pad_token_id)
        sequences.append(torch.cat([prompt, pad(r.completion_ids, (0, right), value=pad_token_id)], dim=1))
        prompt_masks.append(pad(r.prompt_mask, (left, 0)))
        completion_masks.append(pad(r.completion_mask, (0, right)))
    per_token = {name: torch.cat([pad(getattr(r, name), (0, completion_width - r.completion_mask.shape[1]),
                                      value=value) for r in rollouts])
                 if all(getattr(r, name) is not None for r in rollouts) else None
                 for name, value in PER_TOKEN.items()}
    return Rollout(torch.cat(sequences), torch.cat(prompt_masks), torch.cat(completion_masks),
                   [text for r in rollouts for text in r.completions], rollouts[0].group_size,
                   trained_distribution=all(r.trained_distribution for r in rollouts),
                   policy_versions=torch.cat([r.policy_versions for r in rollouts])
                   if all(r.policy_versions is not None for r in rollouts) else None,
                   episodes=[row for r in rollouts for row in r.episodes] if all(r.episodes is not None
                                                                                 for r in rollouts) else None,
                   **per_token)


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every completion token up to and including the first EOS, 0 after it (padding too, even when the pad
    token is EOS)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for token in eos_token_ids:
        is_eos |= completion_ids == token
    eos_so_far = is_eos.long().cumsum(dim=1)
    after_eos = (eos_so_far - is_eos.long()) > 0
    return (~after_eos).long()


def left_padded(rows: list[list[int]], pad: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of token ids left-padded with ``pad`` to the longest: (ids, mask: 1 on each row's own tokens)."""
    width = max(map(len, rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, tokens in enumerate(rows):
        if tokens:
            ids[row, width - len(tokens):] = torch.as_tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
    return ids.to(device), mask.to(device)


def prompt_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of one prompt at one step, from the run's seed, the step and the prompt's dataset index
    (never a process's random stream: 1 or N processes draw the same samples)."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1, np.uint64)[0] >> 1)


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


def head_dim(config) -> int:
    """The size of one attention head's keys and values: the config's ``head_dim`` where it has one."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads
