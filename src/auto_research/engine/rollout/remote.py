"""What every engine other than the training model needs: the policy's weights as named tensors to push (LoRA
merged, FSDP2 shards gathered), and the Rollout built from an engine's token ids and log-probs."""

from __future__ import annotations

from typing import Iterator

import torch

from auto_research.engine.rollout import Rollout, completion_mask, left_padded


def _named_weights(model) -> Iterator[tuple[str, torch.nn.Parameter, object]]:
    """``(checkpoint name, parameter, the LoRA module adapting it or None)`` for each weight a push sends, in
    ``pushed_weights``' order: a LoRA layer's base weight under its plain name, the adapters' own tensors left out."""
    lora_modules = {}
    if hasattr(model, "peft_config"):
        base = model.get_base_model()
        lora_modules = {name: module for name, module in base.named_modules()
                        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")}
        model = base
    # Tied weights under both names (lm_head too): vLLM's in-place reload re-processes a layer (on the CPU it
    # repacks linear weights) only once every weight it expects has arrived.
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        module = None
        if ".base_layer." in name:
            owner, _, leaf = name.rpartition(".base_layer.")
            module = lora_modules.get(owner) if leaf == "weight" else None
            name = f"{owner}.{leaf}"
        yield name, parameter, module


def pushed_weights(model, dtype: torch.dtype, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the checkpoint names vLLM loads, one tensor at a time: LoRA merged (W + s·B·A;
    ``merged=False``: the base alone, the adapter sent apart), FSDP2 shards gathered (every rank takes part)."""
    for name, parameter, module in _named_weights(model):
        tensor = parameter.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if module is not None and merged:
            tensor = tensor + sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
        yield name, tensor.to(dtype)


def tied_weights(model) -> dict[str, str]:
    """``{name: the earlier name it repeats}`` for the weights the model ties (SmolLM2's lm_head: 17% of its push),
    never a LoRA layer's base (whose merged weights differ): a push may send them once."""
    named = [(name, id(parameter)) for name, parameter, module in _named_weights(model) if module is None]
    first: dict[int, str] = {}
    for name, key in named:
        first.setdefault(key, name)
    return {name: first[key] for name, key in named if first[key] != name}


def adapter_factors(model) -> dict[str, torch.Tensor] | None:
    """A LoRA policy's adapter as ``POST /weights/adapter`` takes it: ``W::A`` (r, in), ``W::B`` (out, r) float32 and
    ``W::scaling`` float64 for each adapted weight W, FSDP2 shards gathered. None without adapters, or with ones an
    engine could not merge as PEFT does (several active, DoRA, a bias, fan-in-fan-out, an embedding's)."""
    if not hasattr(model, "peft_config"):
        return None
    factors = {}
    for name, module in model.get_base_model().named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        adapters = list(module.active_adapters)
        adapter = adapters[0] if len(adapters) == 1 else None
        if (adapter is None or adapter not in getattr(module, "lora_A", {}) or getattr(module, "fan_in_fan_out", False)
                or getattr(module, "use_dora", {}).get(adapter) or getattr(module, "lora_bias", {}).get(adapter)
                or not isinstance(module.base_layer, torch.nn.Linear)):
            return None
        for part, layer in (("A", module.lora_A[adapter]), ("B", module.lora_B[adapter])):
            tensor = layer.weight.detach()
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            factors[f"{name}.weight::{part}"] = tensor.to(device="cpu", dtype=torch.float32).contiguous()
        factors[f"{name}.weight::scaling"] = torch.tensor([float(module.scaling[adapter])], dtype=torch.float64)
    return factors or None


def sample_by_ids(engine, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
    """A Sampler's ``sample`` over an engine's ``generate(prompt_ids, group_size, seeds)``, ``tokenizer``, ``eos``."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    prompt_ids = engine.tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completions, logprobs = engine.generate(prompt_ids, group_size, seeds)
    return build_rollout(engine.tokenizer, engine.eos, engine.pad, prompt_ids, completions, logprobs, group_size)


def build_rollout(tokenizer, eos: tuple, pad: int, prompt_ids: list[list[int]], completions: list[list[int]],
                  logprobs: list[list[float]], group_size: int) -> Rollout:
    """The Rollout of an engine's token ids and log-probs (colocated or from a server)."""
    rows, width = len(completions), max(1, max(len(tokens) for tokens in completions))
    prompt, prompt_mask = left_padded([prompt_ids[row // group_size] for row in range(rows)], pad)
    completion = torch.full((rows, width), pad, dtype=torch.long)
    sampled = torch.zeros(rows, width)
    for row, (tokens, values) in enumerate(zip(completions, logprobs)):
        completion[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        sampled[row, : len(values)] = torch.tensor(values)
    mask = completion_mask(completion, eos)
    # A row cut at max_tokens ends in a token, not padding: the mask keeps every drawn token, none after.
    lengths = torch.tensor([len(tokens) for tokens in completions])
    mask = mask * (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    texts = tokenizer.batch_decode(completion * mask + pad * (1 - mask), skip_special_tokens=True)
    return Rollout(torch.cat([prompt, completion], dim=1), prompt_mask, mask, texts, group_size, sampled * mask,
                   None, False)
