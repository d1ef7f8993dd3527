"""The builtin sampler: a lean decoding loop over the training model's own KV cache, seeded per prompt.

Every setting that shapes the distribution is an argument (``SamplingSettings``); the checkpoint's
``generation_config`` (repetition penalty, suppressed tokens, min_p …) is never read. Token t of a
sample is logits/temperature → top-k → top-p → an inverse-CDF draw at a uniform from the prompt's own
generator, so the samples of a prompt do not depend on which other prompts share its batch or process.
Temperature 0 is greedy decoding (the argmax, log-probs of the temperature-1 distribution), as in vLLM.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from auto_research.engine.logprobs import cache_argument, cache_of, token_logprobs
from auto_research.engine.packed import packed_linears
from auto_research.engine.rollout import (Rollout, SamplingSettings, completion_mask, concatenate, eos_ids,
                                          left_padded)


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as texts (tokenized, no special tokens added) or token ids (as they are), left-padded into (ids,
    attention mask). Padded here, not by the tokenizer: a fast tokenizer keeps its padding setting on the object, so
    asking it to pad raced another thread's unpadded call (the sampler against the held-out evaluation)."""
    if prompts and isinstance(prompts[0], str):
        prompts = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    return left_padded(prompts, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, device)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k, then nucleus filtering (−inf outside), as Hugging Face's warpers order them; nucleus keeps the
    smallest set of most probable tokens whose probability reaches ``top_p`` (at least one)."""
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


def draw(logits: torch.Tensor, uniforms: torch.Tensor, probabilities: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF sampling: row b takes the first token whose cumulative probability (the softmax of ``logits``, or
    ``probabilities`` given) exceeds u_b; a row's draw depends on its own uniform only, whatever its batch."""
    cumulative = (logits.softmax(-1) if probabilities is None else probabilities).cumsum(-1)
    target = uniforms.unsqueeze(-1) * cumulative[..., -1:]
    index = torch.searchsorted(cumulative, target, right=True).squeeze(-1)
    return index.clamp(max=logits.shape[-1] - 1)


def next_token(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Each row's next token (logits/temperature → top-k → top-p → ``draw``), its log-prob under the distribution
    drawn from, and that distribution's entropy. Temperature 0: the argmax, with the unfiltered temperature-1
    distribution's log-prob and entropy (as vLLM's greedy ``processed_logprobs``; logits / 0 would be NaN)."""
    if temperature == 0:
        probabilities = logits.double().softmax(-1)
        token = logits.argmax(-1)
    else:
        logits = logits / temperature if temperature != 1.0 else logits
        filtered = filter_logits(logits, top_k, top_p).double()
        probabilities = filtered.softmax(-1)
        token = draw(filtered, uniforms, probabilities)
    logprob = probabilities.gather(-1, token.unsqueeze(-1)).squeeze(-1).log().float()
    return token, logprob, -torch.special.xlogy(probabilities, probabilities).sum(-1).float()


def _prefill(model, input_ids, attention, repeats: int):
    """The prompts' forward, once per prompt: its last logits and the KV cache, then each repeated ``repeats``
    times for the K samples (a cache that cannot be repeated is made by a forward over the repeated rows)."""
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    output = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                   logits_to_keep=1)
    cache = cache_of(output)
    logits = output.logits[:, -1].float()
    if repeats > 1:
        if hasattr(cache, "batch_repeat_interleave"):
            cache.batch_repeat_interleave(repeats)
            logits = logits.repeat_interleave(repeats, dim=0)
        else:  # pragma: no cover - a model with a legacy tuple cache
            return _prefill(model, input_ids.repeat_interleave(repeats, 0), attention.repeat_interleave(repeats, 0), 1)
    return logits, cache, positions.repeat_interleave(repeats, dim=0)[:, -1:] + 1


def droppable(cache) -> bool:
    """Whether rows can be dropped from this KV cache mid-decode: each of its layers is a plain dynamic layer
    (full or sliding-window attention), whose keys and values are indexed by row. Anything else (a quantized,
    static or linear-attention layer, a legacy tuple cache) keeps every row until the end."""
    layers = getattr(cache, "layers", None)
    return (hasattr(cache, "batch_select_indices") and bool(layers)
            and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers))


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[str] | list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    seeds: list[int] | None = None,
    drop_finished: bool = True,
) -> Rollout:
    """K samples for each prompt (one greedy completion each when ``greedy``: no log-probs), with the log-prob and
    entropy of each drawn token (``next_token``). Each prompt is prefilled once, its KV cache shared by its K samples;
    without ``seeds`` the uniforms come from torch's global generator. ``drop_finished``: an ended row leaves the
    batch and its KV cache at once (``droppable``), its draws unchanged (``tests/test_sampler.py``)."""
    batch = _batch(model, tokenizer, prompts, 1 if greedy else group_size, max_new_tokens, greedy, seeds)
    was_training = model.training
    model.eval()
    try:
        with packed_linears(model, batch.input_ids.shape[0]):  # the decode's small products on weights packed once
            completion_ids, logprobs, entropies = _decode(model, batch, max_new_tokens, temperature, top_k, top_p,
                                                          drop_finished)
    finally:
        model.train(was_training)
    # The training model's own distribution, as the trainer computes it (logits / T): not at temperature 0, whose
    # log-probs are temperature 1's.
    unfiltered = not greedy and not top_k and top_p >= 1.0 and temperature != 0
    return _rollout(tokenizer, batch, completion_ids, logprobs, entropies, unfiltered)


@dataclass(frozen=True)
class _Batch:
    """A call's prompts once (the prefill's input) and as rows (repeated for each sample), the rows' uniforms (None
    when greedy), the end and padding ids."""

    prompt_ids: torch.Tensor
    prompt_attention: torch.Tensor
    input_ids: torch.Tensor
    prompt_mask: torch.Tensor
    repeats: int
    uniforms: torch.Tensor | None
    eos: torch.Tensor
    pad: int


def _batch(model, tokenizer, prompts, repeats: int, max_new_tokens: int, greedy: bool, seeds) -> _Batch:
    """The prompts encoded on the model's device, with every uniform the decode draws at (drawn before it starts)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_attention = encode_prompts(tokenizer, prompts, device)
    input_ids = prompt_ids.repeat_interleave(repeats, dim=0)
    prompt_mask = prompt_attention.repeat_interleave(repeats, dim=0)
    uniforms = None if greedy else _uniforms(seeds, len(prompts), input_ids.shape[0], repeats, max_new_tokens, device)
    eos = torch.tensor(eos_ids(tokenizer, model), device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos[0])
    return _Batch(prompt_ids, prompt_attention, input_ids, prompt_mask, repeats, uniforms, eos, pad)


def _uniforms(seeds: list[int] | None, prompts: int, rows: int, repeats: int, max_new_tokens: int,
              device) -> torch.Tensor:
    """(rows, max_new_tokens) float64 uniforms: a prompt's from its own generator seeded with its seed, so its
    samples do not depend on its batch; without seeds, from torch's global generator."""
    if seeds is None:
        return torch.rand(rows, max_new_tokens, dtype=torch.float64).to(device)
    if len(seeds) != prompts:
        raise ValueError(f"{len(seeds)} seeds for {prompts} prompts")
    return torch.cat([torch.rand(repeats, max_new_tokens, generator=torch.Generator().manual_seed(seed),
                                 dtype=torch.float64) for seed in seeds]).to(device)


def _decode(model, batch: _Batch, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
            drop_finished: bool):
    """Prefill, then one token a row a forward until every row has ended or the budget is spent: the completion ids,
    log-probs and entropies (None when greedy), cut to the steps taken."""
    rows, device = batch.input_ids.shape[0], batch.input_ids.device
    uniforms, eos, pad, greedy = batch.uniforms, batch.eos, batch.pad, batch.uniforms is None
    # transformers 5.2x renamed past_key_values to cache; older models keep the old name.
    argument = cache_argument(model)
    logits, cache, position = _prefill(model, batch.prompt_ids, batch.prompt_attention, batch.repeats)
    compact = droppable(cache) if drop_finished else False
    # ``live``: the rows still in the decode batch (indices into all rows). A row that ends leaves the batch
    # and its KV cache when ``compact``; otherwise it stays, fed padding, until every row has ended.
    live, attention = torch.arange(rows, device=device), batch.prompt_mask
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    completion_ids = batch.input_ids.new_full((rows, max_new_tokens), pad)
    logprobs = torch.zeros(rows, max_new_tokens, device=device) if not greedy else None
    entropies = torch.zeros(rows, max_new_tokens, device=device) if not greedy else None
    steps = 0
    for t in range(max_new_tokens):
        if greedy:
            token = logits.argmax(-1)
        else:
            token, logprobs[live, t], entropies[live, t] = next_token(logits, uniforms[live, t], temperature,
                                                                      top_k, top_p)
        token = torch.where(finished[live], torch.full_like(token, pad), token)
        completion_ids[live, t] = token
        finished[live] |= torch.isin(token, eos)
        steps = t + 1
        if bool(finished.all()) or t == max_new_tokens - 1:
            break
        if compact and bool(finished[live].any()):
            keep = (~finished[live]).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            live, token, attention, position = live[keep], token[keep], attention[keep], position[keep]
        attention = torch.cat([attention, attention.new_ones(len(live), 1)], dim=1)
        output = model(input_ids=token.unsqueeze(1), attention_mask=attention, position_ids=position,
                       use_cache=True, **{argument: cache})
        cache, logits = cache_of(output), output.logits[:, -1].float()
        position = position + 1
    return (completion_ids[:, :steps], logprobs[:, :steps] if logprobs is not None else None,
            entropies[:, :steps] if entropies is not None else None)


def _rollout(tokenizer, batch: _Batch, completion_ids: torch.Tensor, logprobs: torch.Tensor | None,
             entropies: torch.Tensor | None, unfiltered: bool) -> Rollout:
    """The decoded rows as a ``Rollout``, log-probs and entropies zeroed where masked."""
    sequences = torch.cat([batch.input_ids, completion_ids], dim=1)
    mask = completion_mask(completion_ids, batch.eos.tolist())
    texts = tokenizer.batch_decode(completion_ids * mask + batch.pad * (1 - mask), skip_special_tokens=True)
    sampled = logprobs * mask if logprobs is not None else None
    entropy = entropies * mask if entropies is not None else None
    return Rollout(sequences, batch.prompt_mask, mask, texts, batch.repeats, sampled, entropy, unfiltered)


class BuiltinSampler:
    """Samples from the training model itself, in chunks of ``chunk_prompts`` prompts (the same shapes on 1 or N
    processes), inside ``context`` (bf16 autocast, FSDP's whole parameters). There is no second copy to load."""

    streams = partial = False
    pushed_bytes = None

    def __init__(self, model, tokenizer, settings: SamplingSettings, chunk_prompts: int | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.chunk_prompts, self.context = chunk_prompts, context

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        return concatenate(self._chunks(prompts, group_size, seeds, self.settings), self.tokenizer.pad_token_id)

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], settings: SamplingSettings | None = None
                     ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt given as token ids (a multi-turn history, never re-tokenized): its ids up to
        and including its EOS, and the sampler's log-prob of each (``envs.trajectory.run_episodes``)."""
        drawn = [part.drawn() for part in self._chunks(prompt_ids, 1, seeds, settings or self.settings)]
        return [row for tokens, _ in drawn for row in tokens], [row for _, values in drawn for row in values]

    def _chunks(self, prompts: list, group_size: int, seeds: list[int], s: SamplingSettings) -> list[Rollout]:
        """The Rollout of each chunk of ``chunk_prompts`` prompts, the weights packed once for them all."""
        chunk = self.chunk_prompts or len(prompts)
        with self.context(), torch.no_grad(), packed_linears(self.model, chunk * group_size):
            return [sample(self.model, self.tokenizer, prompts[start: start + chunk], group_size, s.max_new_tokens,
                           s.temperature, s.top_p, s.top_k, seeds=seeds[start: start + chunk])
                    for start in range(0, len(prompts), chunk)]

    def load_weights(self, model) -> None:
        pass

    def close(self) -> None:
        pass


class BuiltinEngine:
    """The builtin sampler as a rollout server's engine (``rollout-serve --engine builtin``): a model in a process of
    its own (no interpreter lock shared with the trainer) drawing exactly what ``sample`` draws in the trainer's."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model.requires_grad_(False).eval(), tokenizer
        self.parameters = dict(model.named_parameters(remove_duplicate=False))
        self.bases: dict = {}
        """The adapted weights as the last full push left them (``load_adapter`` merges onto these)."""
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", None) or 4096)
        self.partial_rollouts = True
        """A rollout server over it decodes partial rollouts (``partial.builtin_pool``; ``/partial/round``)."""

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int],
                 settings: SamplingSettings) -> tuple[list[list[int]], list[list[float]]]:
        """Each prompt's ``group_size`` completions (token ids through the first EOS) and their tokens' log-probs."""
        return sample(self.model, self.tokenizer, prompt_ids, group_size, settings.max_new_tokens,
                      settings.temperature, settings.top_p, settings.top_k, seeds=seeds).drawn()

    @property
    def longest_scored(self) -> int:
        """The longest row (prompt + completion) ``logprobs`` scores."""
        return self.max_model_len

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Each completion token's log-prob at temperature 1 given all before it (a served teacher's scores), by the
        trainer's own ``token_logprobs``, consecutive rows of one prompt sharing its forward as a group does."""
        device, pad = next(self.model.parameters()).device, self.tokenizer.pad_token_id or 0
        prompts, prompt_mask = left_padded(prompt_ids, pad, device)
        completions, completion_mask = (tensor.flip(1) for tensor in left_padded([ids[::-1] for ids in completion_ids],
                                                                                 pad, device))
        group = next((row for row, ids in enumerate(prompt_ids) if ids != prompt_ids[0]), len(prompt_ids))
        values = token_logprobs(self.model, torch.cat([prompts, completions], 1), prompt_mask, completion_mask,
                                group_size=group)  # (token_logprobs checks that the rows are such groups)
        return [row[: len(ids)] for row, ids in zip(values.tolist(), completion_ids)]

    @torch.no_grad()
    def load_named(self, weights) -> None:
        """Pushed tensors (checked by the server) copied in place: new base weights for later adapters."""
        for parameter, tensor, _ in self._targets(weights):
            parameter.copy_(tensor)

    @torch.no_grad()
    def adopt_named(self, weights) -> None:
        """Pushed tensors served as they are, without a copy (memory the server does not write while they are served:
        ``pushes.collective_push``); one taken already by another weight (a tie this model lacks) is copied."""
        for parameter, tensor, taken in self._targets(weights):
            if taken:
                parameter.copy_(tensor)
            else:
                parameter.data = tensor

    def _targets(self, weights):
        """A full push's (parameter, tensor, taken by another parameter already), new base weights set; a tensor sent
        once for two names this model ties goes to their one parameter once."""
        self.bases, owners = {}, {}
        for name, tensor in weights:
            parameter = self.parameters[name]
            owner = owners.get(id(tensor))
            if owner is parameter:  # a tied weight, sent once, is in already
                continue
            if owner is None:
                owners[id(tensor)] = parameter
            yield parameter, tensor, owner is not None

    @torch.no_grad()
    def load_adapter(self, factors: dict) -> None:
        """A LoRA adapter (``{weight: (A, B, scaling)}``) merged as PEFT merges: base + (B @ A) · scaling, the base
        being the weight as the last full push left it (copied at the first adapter after that push)."""
        for name, (A, B, scaling) in factors.items():
            weight = self.parameters[name]
            base = self.bases.setdefault(name, weight.detach().clone())
            weight.copy_(base + (B @ A) * scaling)
