"""Float32 linear layers through oneDNN on the CPU (engine/onednn.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from auto_research.engine import onednn
from auto_research.engine.logprobs import _plain_output_layer, token_logprobs
from auto_research.engine.onednn import OneDNNLinear, available, linear, use_onednn, use_torch
from auto_research.engine.packed import packed_linears
from auto_research.train.components import checkpoint_layers


def _inputs(bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 48, generator=generator).requires_grad_()
    weight = torch.randn(80, 48, generator=generator).requires_grad_()
    b = torch.randn(80, generator=generator).requires_grad_() if bias else None
    return x, weight, b


def _gradients(function, x, weight, b):
    tensors = [t for t in (x, weight, b) if t is not None]
    out = function(x, weight, b)
    grads = torch.autograd.grad(out.square().sum(), tensors)
    return out, grads


@pytest.mark.parametrize("bias", [False, True])
def test_linear_computes_torchs_product_and_gradients_through_onednn(bias):
    assert available()  # every CPU build of torch this project installs has oneDNN
    x, weight, b = _inputs(bias)
    ours, our_grads = _gradients(linear, x, weight, b)
    assert "_Linear" in ours.grad_fn.name()  # oneDNN's path, not F.linear's
    theirs, their_grads = _gradients(F.linear, x, weight, b)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for mine, torchs in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-4)
    # Only the input's gradient: the weight's is not made (frozen layers, LoRA's base).
    frozen = weight.detach()
    (grad_x,) = torch.autograd.grad(linear(x, frozen, None).sum(), [x])
    torch.testing.assert_close(grad_x, torch.autograd.grad(F.linear(x, frozen).sum(), [x])[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_torchs_own_product_where_onednn_does_not_apply():
    x, weight, b = _inputs(True)
    half = (x.detach().bfloat16(), weight.detach().bfloat16(), b.detach().bfloat16())
    assert torch.equal(linear(*half), F.linear(*half))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, weight, b)
        assert out.dtype == torch.bfloat16 and "_Linear" not in out.grad_fn.name()
    with torch.backends.mkldnn.flags(enabled=False):
        out = linear(x, weight, b)
        assert torch.equal(out, F.linear(x, weight, b)) and "_Linear" not in out.grad_fn.name()
    empty = torch.zeros(0, 48)
    assert linear(empty, weight, b).shape == (0, 80)


def test_use_onednn_changes_only_the_class_of_large_plain_linears(tiny_lm, monkeypatch):
    model = copy.deepcopy(tiny_lm[0])
    sizes = sorted({m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear})
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", sizes[-1])  # only the largest weights
    before = {name: tensor for name, tensor in model.state_dict().items()}
    largest = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() == sizes[-1]]
    assert use_onednn(model) == len(largest) > 0
    assert all(type(m) is OneDNNLinear and isinstance(m, torch.nn.Linear) for m in largest)
    assert all(type(m) is torch.nn.Linear for m in model.modules()
               if isinstance(m, torch.nn.Linear) and m.weight.numel() < sizes[-1])
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in after)
    assert sum(type(m) is OneDNNLinear for m in copy.deepcopy(model).modules()) == len(largest)
    assert use_onednn(model) == 0  # already done
    assert use_torch(model) == len(largest) and not any(type(m) is OneDNNLinear for m in model.modules())


def _sequences(tokenizer):
    prompt = tokenizer("12+30=", add_special_tokens=False)["input_ids"]
    completions = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("42", "4", "420", "7")]
    width = max(map(len, completions))
    rows = torch.tensor([prompt + c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completions])
    return rows, torch.ones(len(completions), len(prompt)), mask


@pytest.mark.parametrize("recomputed", [False, True])
def test_a_models_logprobs_and_gradient_through_onednn_equal_torchs(tiny_lm, monkeypatch, recomputed):
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)  # every layer of the tiny model
    model, tokenizer = tiny_lm
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    assert use_onednn(ours) > 0
    assert type(_plain_output_layer(ours)) is OneDNNLinear  # the chunked output layer still applies
    if recomputed:  # the recomputed forward runs in the backward: oneDNN there too
        checkpoint_layers(plain), checkpoint_layers(ours)
    sequences, prompt_mask, mask = _sequences(tokenizer)
    calls = []
    kernel = onednn.kernel
    monkeypatch.setattr(onednn, "kernel", lambda *args: calls.append(torch.is_grad_enabled()) or kernel(*args))
    results, counts = [], []
    for network in (plain, ours):
        logprobs = token_logprobs(network, sequences, prompt_mask, mask, temperature=0.9, group_size=4)
        forward = len(calls)
        (logprobs * torch.linspace(-1, 1, mask.shape[1])).sum().backward()
        counts.append((forward, len(calls) - forward))
        calls.clear()
        results.append((logprobs.detach(), {n: p.grad for n, p in network.named_parameters()}))
    # Both make the chunked output layer's logits through oneDNN (in the forward, and again in the backward); ours
    # also runs its layers' forward and their inputs' gradients there.
    (plain_forward, plain_backward), (our_forward, our_backward) = counts
    assert plain_forward == plain_backward == 1 and our_forward > 1 and our_backward > 1
    (torch_logprobs, torch_grads), (our_logprobs, our_grads) = results
    torch.testing.assert_close(our_logprobs, torch_logprobs, rtol=1e-5, atol=1e-6)
    assert torch_grads.keys() == our_grads.keys()
    for name, grad in torch_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_sampler_packs_onednn_layers(tiny_lm, monkeypatch):
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)  # the layers', and what the sampler packs
    model = copy.deepcopy(tiny_lm[0])
    layers = use_onednn(model)
    ids = torch.tensor([tiny_lm[1]("12+30=", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with packed_linears(model, rows=1):
            assert sum("forward" in vars(m) for m in model.modules() if type(m) is OneDNNLinear) == layers
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is OneDNNLinear)
