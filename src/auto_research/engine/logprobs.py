"""Per-token log-probabilities of completions: the one function the policy, the frozen reference and PPO's old
policy all go through.

A batch row is ``[left-padded prompt | completion]``: ``sequences`` (B, P + C), ``completion_mask`` (B, C) marks the
completion tokens that count (up to and including the first EOS). Position ids come from the attention mask, so
left padding and anything after EOS change nothing, and the numbers match what ``generate`` sampled from.
"""

from __future__ import annotations

import inspect

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache

from auto_research.engine import onednn
from auto_research.engine.embedding import tied_weight
from auto_research.engine.packing import (Grouped, Packed, grouped_layout, layout, takes_block_masks, unwrapped,
                                         whole_groups_with_one_prompt)


def attention_for(sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and position ids for ``[prompt | completion]`` rows."""
    attention = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return attention, positions


def completion_logits(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """(B, C, V) float logits, divided by the temperature, that predict each completion token."""
    completion_length = completion_mask.shape[1]
    attention, positions = attention_for(sequences, prompt_mask, completion_mask)
    # The logit at position t predicts token t + 1: only the last C + 1 positions are needed (the
    # very last predicts past the end), so the output layer skips every prompt position.
    keep = {"logits_to_keep": completion_length + 1} if accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions, use_cache=False, **keep).logits
    logits = logits[:, -(completion_length + 1) : -1].float()
    return logits / temperature if temperature != 1.0 else logits


def accepts(model, argument: str) -> bool:
    """Whether the model under any wrappers (DDP, PEFT, a LoRA reference) takes ``argument`` in forward."""
    for inner in unwrapped(model, 6):
        forward = getattr(inner, "forward", None)
        if forward is not None:
            parameters = inspect.signature(forward).parameters
            if argument in parameters:
                return True
            if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
                return False
    return False


def completion_values(critic, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                      group_size: int = 1, pack: bool = False) -> torch.Tensor:
    """(B, C) the critic's value V(s_t) of the state before each completion token; 0 where masked. The critic is a
    token classifier with one label: as for log-probs, the output one position earlier is the value of the state in
    which y_t is chosen. ``pack``: as for ``token_logprobs``."""
    prompt_length = prompt_mask.shape[1]
    if pack:
        packed = layout(sequences, prompt_mask, completion_mask)
        scores = critic(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits[0, :, 0]
        return _scattered(scores[packed.predictors], completion_mask.bool())
    grouped = grouped_rows(critic, sequences, prompt_mask, completion_mask, group_size)
    if grouped is not None:
        scores = critic(**grouped.inputs(), use_cache=False).logits[..., 0]
        return _scattered(scores.reshape(-1)[grouped.predictors], completion_mask.bool())
    if shares_prompts(critic, sequences, prompt_mask, group_size):
        first, rest = _prompt_then_completions(critic, sequences, prompt_mask, completion_mask, group_size, {})
        scores = torch.cat([first.logits[:, -1:, 0].repeat_interleave(group_size, dim=0), rest.logits[:, :-1, 0]], 1)
        return scores.float() * completion_mask.to(torch.float32)
    attention, positions = attention_for(sequences, prompt_mask, completion_mask)
    scores = critic(input_ids=sequences, attention_mask=attention, position_ids=positions).logits[..., 0]
    return scores[:, prompt_length - 1 : -1].float() * completion_mask.to(torch.float32)


CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
"""The keywords a KV cache is passed under: transformers 5.2x's name, the older one, and decoder layers' singular."""


def cache_argument(model) -> str:
    """The name under which this model's forward takes its KV cache (transformers 5.2x renamed it)."""
    new, old, _ = CACHE_NAMES
    return new if accepts(model, new) else old


def cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _single_process(model, checkpointing_allowed: bool) -> bool:
    """Whether ``model`` is neither under DDP nor FSDP, whose hooks expect every rank to run the same forwards
    over whole rows, nor (unless allowed) under layer recomputation, which a forward through a KV cache skips."""
    inner = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)  # a LoRA reference
    if not isinstance(inner, torch.nn.Module) or isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return False
    return not any(isinstance(module, FSDPModule)
                   or (not checkpointing_allowed and (getattr(module, "gradient_checkpointing", False)
                                                      or getattr(module, "recomputed_in_backward", None) == "layer"))
                   for module in inner.modules())


def grouped_rows(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                 group_size: int) -> Grouped | None:
    """The rows as one row per group (``packing.Grouped``) where the model honours a block mask, the batch holds
    whole groups with one prompt each, and neither DDP nor FSDP is in the way; else None. No KV cache: it works
    under activation checkpointing too."""
    if group_size < 2 or not _single_process(model, checkpointing_allowed=True) or not takes_block_masks(model):
        return None
    return grouped_layout(sequences, prompt_mask, completion_mask, group_size)  # (None where the rows do not fit)


def shares_prompts(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> bool:
    """Whether the K rows of each group can share one forward of their prompt through a KV cache: whole groups, a
    model that keeps a cache, and neither DDP, FSDP nor activation checkpointing in the way (``_single_process``)."""
    if not accepts(model, cache_argument(model)) or not _single_process(model, checkpointing_allowed=False):
        return False
    return whole_groups_with_one_prompt(sequences, prompt_mask, group_size)


def _prompt_then_completions(model, sequences, prompt_mask, completion_mask, group_size: int, keep: dict):
    """Each group's prompt once (its KV cache repeated for the K rows), then the completions over that cache:
    the same positions and attention as one forward over ``[prompt | completion]`` rows, K − 1 of every K
    prompt computations fewer, in the forward and in the backward. Returns both outputs."""
    P = prompt_mask.shape[1]
    prompts, masks = sequences[::group_size, :P], prompt_mask[::group_size].long()
    positions = (masks.cumsum(dim=1) - 1).clamp(min=0)
    last = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    cache = DynamicCache()  # filled in place by the prompts' forward (a token classifier returns no cache)
    first = model(input_ids=prompts, attention_mask=masks, position_ids=positions, use_cache=True,
                  **{cache_argument(model): cache}, **last)
    cache.batch_repeat_interleave(group_size)
    attention = torch.cat([masks.repeat_interleave(group_size, dim=0), completion_mask.long()], dim=1)
    steps = torch.arange(completion_mask.shape[1], device=sequences.device)
    completion_positions = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1 + steps
    rest = model(input_ids=sequences[:, P:], attention_mask=attention, position_ids=completion_positions,
                 use_cache=True, **{cache_argument(model): cache}, **keep)
    return first, rest


def token_logprobs(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, group_size: int = 1,
                   entropy_gradient: bool = False, pack: bool = False):
    """log π(y_t | x, y_<t) for each completion token, shape (B, C); 0 where masked. Logits are divided by the
    sampling temperature, so the policy trained is the one that sampled. ``with_entropy``: also the per-token entropy
    (with its gradient when ``entropy_gradient``: the entropy bonus, --entropy-coef).

    Where the output layer is a plain linear map (Llama, Qwen, SmolLM …), the logits are made, used and dropped a
    chunk of positions at a time (``chunked_logprobs``): no (B, C, V) tensor ever exists, forward or backward.
    ``group_size`` K: each group's rows share one forward of their prompt (``grouped_rows``, else ``shares_prompts``).
    ``pack``: the rows go through as one packed row (``packing.py``; the caller checked ``packs_sequences``).
    """
    mask = completion_mask.bool()
    if pack:
        packed = layout(sequences, prompt_mask, completion_mask)
        kept_hidden, weight = packed_hidden(model, packed)
        kept_targets = packed.targets
        if kept_hidden is None:
            keep = {"logits_to_keep": packed.predictors} if accepts(model, "logits_to_keep") else {}
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                           **keep).logits[0]
            logits = (logits if keep else logits[packed.predictors]).float()
            logits = logits / temperature if temperature != 1.0 else logits
            outputs = _from_logits(logits, kept_targets, torch.ones_like(kept_targets, dtype=torch.bool),
                                   with_entropy, entropy_gradient)
            return _scattered(outputs, mask)
    else:
        grouped = grouped_rows(model, sequences, prompt_mask, completion_mask, group_size)
        kept_hidden = None
        if grouped is not None:
            kept_hidden, weight = packed_hidden(model, grouped)
            kept_targets = grouped.targets
        if kept_hidden is None:
            hidden, weight = completion_hidden(model, sequences, prompt_mask, completion_mask, group_size)
            targets = sequences[:, prompt_mask.shape[1]:]
            if hidden is None:
                return _from_logits(completion_logits(model, sequences, prompt_mask, completion_mask, temperature),
                                    targets, mask, with_entropy, entropy_gradient)
            kept_hidden, kept_targets = hidden[mask], targets[mask]
    chosen = chunked_logprobs(kept_hidden, weight, kept_targets, temperature)
    if not with_entropy:
        return _scattered(chosen, mask)
    if entropy_gradient:
        return _scattered((chosen, _ChunkedEntropy.apply(kept_hidden, weight, temperature)), mask)
    return _scattered((chosen, chunked_entropy(kept_hidden.detach(), weight.detach(), temperature)), mask)


def _scattered(values, mask: torch.Tensor):
    """(N,) values of the counted tokens (or a tuple of them) → (B, C), 0 where masked."""
    if isinstance(values, tuple):
        return tuple(_scattered(value, mask) for value in values)
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, values.float())


def packed_hidden(model, packed: Packed | Grouped):
    """(N, H) the output layer's input at ``packed.predictors`` (a packed row or grouped rows) and its weight;
    (None, None) for a model whose output layer is no plain map."""
    layer = _plain_output_layer(model)
    if layer is None:
        return None, None
    hidden, weight = _output_layer_inputs(layer, lambda: model(**packed.inputs(), use_cache=False))[0]
    return hidden.reshape(-1, hidden.shape[-1])[packed.predictors], weight


def _output_layer_inputs(layer, forward) -> list:
    """(input, weight) of each call of ``layer`` in ``forward()``, the layer itself computing nothing."""
    captured = []

    def capture(module, args):
        captured.append((args[0], tied_weight(module)))
        return (args[0][..., :0, :],)  # the layer runs on no position at all

    handle = layer.register_forward_pre_hook(capture)
    try:
        forward()
    finally:
        handle.remove()
    return captured


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, with_entropy: bool,
                 entropy_gradient: bool = False):
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = (logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser) * mask
    if not with_entropy:
        return chosen
    with torch.set_grad_enabled(entropy_gradient and torch.is_grad_enabled()):
        log_p = logits - normaliser.unsqueeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) * mask
    return chosen, entropy


def _plain_output_layer(model):
    """The output layer under any wrappers (DDP, PEFT, a LoRA reference) when it is a bias-free nn.Linear whose
    output is the logits as they are (no soft-capping or scaling after it); else None. Not under FSDP, which
    frees the whole weight again as soon as the forward ends."""
    inner = model
    for _ in range(8):
        if isinstance(inner, FSDPModule):
            return None
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            inner = inner.module
            continue
        get = getattr(inner, "get_output_embeddings", None)
        if callable(get):
            layer, config = get(), getattr(inner, "config", None)
            scaled = any(getattr(config, name, None) not in (None, 1.0) for name in ("final_logit_softcapping",
                                                                                        "logit_scale"))
            if onednn.is_linear(layer) and layer.bias is None and not scaled:
                return layer
            return None
        inner = getattr(inner, "model", None)
        if inner is None:
            return None
    return None


def completion_hidden(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                      group_size: int = 1):
    """(B, C, H) the output layer's input at the positions that predict the completion tokens, and its weight;
    (None, None) for a model whose output layer is no plain map, or that cannot skip the prompt positions."""
    layer = _plain_output_layer(model)
    if layer is None or not accepts(model, "logits_to_keep"):
        return None, None
    completion_length = completion_mask.shape[1]
    if shares_prompts(model, sequences, prompt_mask, group_size):
        (first, weight), (rest, _) = _output_layer_inputs(layer, lambda: _prompt_then_completions(
            model, sequences, prompt_mask, completion_mask, group_size, {"logits_to_keep": completion_length}))
        return torch.cat([first[:, -1:].repeat_interleave(group_size, dim=0), rest[:, :-1]], dim=1), weight
    attention, positions = attention_for(sequences, prompt_mask, completion_mask)
    hidden, weight = _output_layer_inputs(layer, lambda: model(
        input_ids=sequences, attention_mask=attention, position_ids=positions, use_cache=False,
        logits_to_keep=completion_length + 1))[0]
    return hidden[:, :-1], weight


CHUNK_ELEMENTS = 1 << 24
"""Logits made at a time by the chunked log-probs: 16M floats (64 MB), whatever the batch and vocabulary."""


def _chunks(rows: int, vocabulary: int):
    size = max(1, CHUNK_ELEMENTS // vocabulary)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = onednn.product(hidden, weight.to(hidden.dtype)).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h Wᵀ / T)[y] for N rows, a chunk of rows at a time; the backward makes each chunk's logits
    again (d/dlogits = g · (onehot(y) − softmax) / T), so only one chunk of logits is alive at any moment."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        normalisers = torch.empty_like(out)
        for start, stop in _chunks(hidden.shape[0], weight.shape[0]):
            logits = _logits(hidden[start:stop], weight, temperature)
            normalisers[start:stop] = torch.logsumexp(logits, dim=-1)
            out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - normalisers[start:stop]
        ctx.save_for_backward(hidden, weight, targets, normalisers)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, normalisers = ctx.saved_tensors
        compute = hidden.dtype
        grad_hidden, grad_weight, w = _backward_buffers(ctx, hidden, weight)
        for start, stop in _chunks(hidden.shape[0], weight.shape[0]):
            # In place, one chunk of logits becomes its gradient: no second (chunk, V) tensor at any moment.
            grad = _logits(hidden[start:stop], weight, ctx.temperature)
            grad.sub_(normalisers[start:stop, None]).exp_().neg_()
            grad.scatter_add_(-1, targets[start:stop, None], torch.ones_like(grad[:, :1]))
            grad *= (grad_out[start:stop] / ctx.temperature)[:, None]
            _accumulate(grad.to(compute), hidden[start:stop], w, grad_hidden, grad_weight, start, stop)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def _backward_buffers(ctx, hidden, weight):
    """The output layer's backward: d/dhidden's rows to fill (None when not needed), d/dW's float32 sum from zero
    (None when not needed), and W in the compute dtype."""
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
        if ctx.needs_input_grad[1] else None
    return grad_hidden, grad_weight, weight.to(hidden.dtype)


def _accumulate(grad, hidden, weight, grad_hidden, grad_weight, start: int, stop: int) -> None:
    """A chunk's share of the output layer's backward: d/dhidden = grad · W into its rows, d/dW += gradᵀ · hidden
    (in place, no temporary the size of W, when both are float32)."""
    if grad_hidden is not None:
        torch.mm(grad, weight, out=grad_hidden[start:stop]) if grad_hidden.dtype == grad.dtype \
            else grad_hidden[start:stop].copy_(grad @ weight)
    if grad_weight is not None:
        if grad.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad.t(), hidden)
        else:
            grad_weight += (grad.t() @ hidden).float()


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """(N,) log-probabilities of ``targets`` under softmax(hidden · weightᵀ / T), never all N logits at once."""
    return _ChunkedLogProbs.apply(hidden, weight, targets, temperature)


class _ChunkedEntropy(torch.autograd.Function):
    """H = −Σ_v p_v log p_v of softmax(h Wᵀ / T) for N rows, a chunk at a time, with its gradient: the backward
    makes each chunk's logits again, dH/dz_v = −p_v (log p_v + H), so no (N, V) tensor outlives its chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, temperature):
        ctx.save_for_backward(hidden, weight)
        ctx.temperature = temperature
        return chunked_entropy(hidden, weight, temperature)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight = ctx.saved_tensors
        compute = hidden.dtype
        grad_hidden, grad_weight, w = _backward_buffers(ctx, hidden, weight)
        for start, stop in _chunks(hidden.shape[0], weight.shape[0]):
            log_p = torch.log_softmax(_logits(hidden[start:stop], weight, ctx.temperature), dim=-1)
            p = log_p.exp()
            entropy = -(p * log_p).sum(-1, keepdim=True)
            grad = (-p * (log_p + entropy) * (grad_out[start:stop] / ctx.temperature)[:, None]).to(compute)
            _accumulate(grad, hidden[start:stop], w, grad_hidden, grad_weight, start, stop)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None


@torch.no_grad()
def chunked_entropy(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(N,) entropy of softmax(hidden · weightᵀ / T), a chunk of rows at a time."""
    entropy = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start, stop in _chunks(hidden.shape[0], weight.shape[0]):
        log_p = torch.log_softmax(_logits(hidden[start:stop], weight, temperature), dim=-1)
        entropy[start:stop] = -(log_p.exp() * log_p).sum(-1)
    return entropy


def kl_per_token(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Sampled estimators of KL(π ‖ π_ref) per token (Schulman, 2020, "Approximating KL divergence"). With log r =
    log π_ref − log π on a token sampled from π: k1 = −log r (unbiased, the paper's shaping), k2 = ½ (log r)² and
    k3 = (r − 1) − log r (unbiased and non-negative, the GRPO choice)."""
    log_ratio = reference_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return log_ratio.exp() - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")
