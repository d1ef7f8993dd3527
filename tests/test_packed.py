"""Linear layers on oneDNN-packed weights while decoding on the CPU (engine/packed.py)."""

from __future__ import annotations

import pytest
import torch

from auto_research.engine import onednn
from auto_research.engine.packed import available, packed_linears
from auto_research.engine.rollout import prompt_seed
from auto_research.engine.rollout.builtin import sample
from auto_research.engine.tiny import build_model, build_tokenizer


@pytest.fixture
def every_size(monkeypatch):
    """Every layer of the tiny model packed (by default only weights of 2^18 entries or more are)."""
    monkeypatch.setattr(onednn, "MIN_ELEMENTS", 0)


def _linears(model) -> list[torch.nn.Linear]:
    return [module for module in model.modules() if type(module) is torch.nn.Linear]


def _patched(model) -> int:
    return sum("forward" in vars(module) for module in _linears(model))


def test_packed_layers_compute_the_plain_products_from_a_copy_taken_on_entry(tiny_lm, every_size):
    model, tokenizer = tiny_lm
    assert available()  # every CPU build of torch this project installs has oneDNN
    ids = torch.tensor([tokenizer("12+30=", add_special_tokens=False)["input_ids"]] * 3)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linears(model, rows=3):
            assert _patched(model) == len(_linears(model)) > 0
            packed = model(input_ids=ids).logits
            # The products read the packed copy: a weight changed in place inside does not reach them.
            layer = _linears(model)[0]
            saved = layer.weight.clone()
            layer.weight.add_(1.0)
            unchanged = model(input_ids=ids).logits
            layer.weight.copy_(saved)
        assert _patched(model) == 0  # every layer computes as before again
        again = model(input_ids=ids).logits
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(unchanged, packed)
    assert torch.equal(again, plain)


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # torch's note on switching oneDNN off
def test_nothing_is_packed_where_the_packed_product_would_compute_something_else(tiny_lm, every_size):
    model, _ = tiny_lm
    with packed_linears(model, rows=4):  # autograd on: the packed product has no gradient
        assert _patched(model) == 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), packed_linears(model, rows=4):
        assert _patched(model) == 0  # autocast computes in bfloat16, which the packed float32 weights would not
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False), packed_linears(model, rows=4):
        assert _patched(model) == 0
    half = build_model(build_tokenizer(), seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2).to(torch.bfloat16)
    with torch.no_grad(), packed_linears(half, rows=4):
        assert _patched(half) == 0


def test_nested_calls_pack_once_and_an_error_restores_the_layers(tiny_lm, every_size):
    model, _ = tiny_lm
    count = len(_linears(model))
    with torch.no_grad():
        with packed_linears(model, rows=4):
            forwards = [vars(module)["forward"] for module in _linears(model)]
            with packed_linears(model, rows=4):  # an inner call (sample() inside a sampler's call) keeps them
                assert [vars(module)["forward"] for module in _linears(model)] == forwards
            assert _patched(model) == count  # and leaves them to the outer call
        with pytest.raises(RuntimeError, match="boom"):
            with packed_linears(model, rows=4):
                raise RuntimeError("boom")
    assert _patched(model) == 0


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_sampling_on_packed_weights_draws_what_the_plain_layers_draw(tiny_lm, every_size):
    """The same tokens, texts and masks, log-probs and entropies to float32 rounding, with the layers packed
    (the default on the CPU) and with oneDNN switched off."""
    model, tokenizer = tiny_lm
    prompts = ["1+2=", "Q: what is 33+4?", "x"]
    seeds = [prompt_seed(7, 1, index) for index in range(3)]
    packed = sample(model, tokenizer, prompts, 4, 12, temperature=1.2, seeds=seeds)
    with torch.backends.mkldnn.flags(enabled=False):
        plain = sample(model, tokenizer, prompts, 4, 12, temperature=1.2, seeds=seeds)
    assert torch.equal(packed.sequences, plain.sequences) and packed.completions == plain.completions
    assert torch.equal(packed.completion_mask, plain.completion_mask)
    torch.testing.assert_close(packed.sampler_logprobs, plain.sampler_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.sampler_entropy, plain.sampler_entropy, rtol=0, atol=1e-5)
    assert _patched(model) == 0


def test_small_weights_stay_on_torch_s_own_product(tiny_lm):
    """oneDNN's fixed cost per call makes small products slower packed: below 2^18 entries nothing is packed."""
    model, tokenizer = tiny_lm
    wide = build_model(tokenizer, seed=0, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=1)
    with torch.no_grad():
        with packed_linears(model, rows=32):
            assert _patched(model) == 0
        with packed_linears(wide, rows=32):
            packed = {name for name, module in wide.named_modules() if "forward" in vars(module)}
    # 512 × 512 and 1024 × 512 weights (q, o and the MLP's), not the 128 × 512 of k and v, not the small vocabulary's
    # output layer
    assert packed == {f"model.layers.0.{name}" for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                                            "mlp.up_proj", "mlp.down_proj")}, packed
