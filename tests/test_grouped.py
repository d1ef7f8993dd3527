"""The grouped layout: each group of K rows that share a prompt as one row (the prompt once, the K completions
unpadded, a block mask). By hand, then log-probs, entropies, values and their gradients against the rows apart,
and under layer recomputation."""

from __future__ import annotations

import pytest
import torch

from auto_research.engine import logprobs, packing
from auto_research.engine.logprobs import completion_values, token_logprobs
from auto_research.engine.tiny import build_model, build_tokenizer
from test_packing import tiny, tiny_critic  # noqa: F401  (a fixture, and the critic made from it)

# Two groups of K = 2. Group 0: a prompt of 2 tokens (left-padded to 3), completions of 3 and 1 tokens;
# group 1: a prompt of 3, completions of 2 and 0.
PROMPT_MASK = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
COMPLETION_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
SEQUENCES = torch.tensor([[0, 11, 12, 21, 22, 23],
                          [0, 11, 12, 31, 0, 0],
                          [13, 14, 15, 41, 42, 0],
                          [13, 14, 15, 0, 0, 0]])


def test_the_grouped_rows_by_hand():
    grouped = packing.grouped_layout(SEQUENCES, PROMPT_MASK, COMPLETION_MASK, 2)
    # Group 0: prompt 11 12, then 21 22 23 and 31 (6 tokens); group 1: 13 14 15, then 41 42 (5, padded to 6).
    assert grouped.input_ids.tolist() == [[11, 12, 21, 22, 23, 31], [13, 14, 15, 41, 42, 0]]
    assert grouped.position_ids.tolist() == [[0, 1, 2, 3, 4, 2], [0, 1, 2, 3, 4, 0]]
    # Row 0's tokens are predicted from indices 1 (the prompt's last), 2, 3; row 1's from 1; row 2's from 6 + 2
    # and 6 + 3; row 3 has none.
    assert grouped.predictors.tolist() == [1, 2, 3, 1, 8, 9]
    assert grouped.targets.tolist() == [21, 22, 23, 31, 41, 42]
    attention = grouped.attention[0, 0].int().tolist()
    assert attention[5] == [1, 1, 0, 0, 0, 1]  # 31 sees the prompt and itself, not the other completion
    assert attention[4] == [1, 1, 1, 1, 1, 0]
    assert grouped.attention[1, 0, 5].int().tolist() == [0, 0, 0, 0, 0, 1]  # padding sees only itself


def test_the_layout_refuses_what_it_cannot_hold():
    assert packing.grouped_layout(SEQUENCES, PROMPT_MASK, COMPLETION_MASK, 3) is None  # not whole groups
    other = SEQUENCES.clone()
    other[1, 2] = 99  # a prompt that differs within its group
    assert packing.grouped_layout(other, PROMPT_MASK, COMPLETION_MASK, 2) is None
    gap = COMPLETION_MASK.clone()
    gap[0] = torch.tensor([1, 0, 1])  # a counted token after an uncounted one
    assert packing.grouped_layout(SEQUENCES, PROMPT_MASK, gap, 2) is None


def _rows_apart(monkeypatch):
    """token_logprobs and completion_values with the grouped layout switched off: one padded row a sample."""
    monkeypatch.setattr(logprobs, "grouped_rows", lambda *args, **kwargs: None)
    monkeypatch.setattr(logprobs, "shares_prompts", lambda *args, **kwargs: False)


def _batch(groups: int = 3, K: int = 4):
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 260, (groups, 6), generator=generator).repeat_interleave(K, 0)
    prompt_mask = torch.ones(groups, 6, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :4] = 0
    prompt_mask = prompt_mask.repeat_interleave(K, 0)
    lengths = torch.randint(0, 9, (groups * K,), generator=generator)
    lengths[0] = 8
    completion_mask = (torch.arange(8)[None] < lengths[:, None]).long()
    sequences = torch.cat([prompts, torch.randint(4, 260, (groups * K, 8), generator=generator)], 1)
    return sequences, prompt_mask, completion_mask


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "layers-recomputed"])
def test_grouped_logprobs_and_gradients_equal_the_rows_apart(monkeypatch, recompute):
    from auto_research.train.components import checkpoint_layers

    model = build_model(build_tokenizer(), seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    if recompute:
        checkpoint_layers(model)
    sequences, prompt_mask, mask = _batch()
    weights = torch.arange(1.0, 1.0 + mask.numel()).view(mask.shape) / mask.numel()
    assert logprobs.grouped_rows(model, sequences, prompt_mask, mask, 4) is not None
    results = []
    for apart in (False, True):
        if apart:
            _rows_apart(monkeypatch)
        chosen, entropy = token_logprobs(model, sequences, prompt_mask, mask, 0.7, with_entropy=True, group_size=4,
                                         entropy_gradient=True)
        loss = (chosen * weights).sum() + 0.1 * entropy.sum()
        results.append((chosen.detach(), entropy.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    (chosen, entropy, grads), (want_chosen, want_entropy, want_grads) = results
    assert torch.allclose(chosen, want_chosen, atol=1e-5) and torch.allclose(entropy, want_entropy, atol=1e-5)
    assert bool((chosen[~mask.bool()] == 0).all()) and bool((chosen[mask.bool()] != 0).all())
    scale = max(float(grad.abs().max()) for grad in want_grads)
    for got, want in zip(grads, want_grads):
        assert torch.allclose(got, want, atol=2e-6 * scale), float((got - want).abs().max())


def test_grouped_values_equal_the_rows_apart(tiny, tmp_path, monkeypatch):
    critic = tiny_critic(tiny, tmp_path)
    sequences, prompt_mask, mask = _batch()
    assert logprobs.grouped_rows(critic, sequences, prompt_mask, mask, 4) is not None
    grouped = completion_values(critic, sequences, prompt_mask, mask, group_size=4)
    _rows_apart(monkeypatch)
    apart = completion_values(critic, sequences, prompt_mask, mask, group_size=4)
    assert torch.allclose(grouped, apart, atol=1e-5) and apart.abs().max() > 0


def test_a_model_that_ignores_a_block_mask_is_found_out(tiny):
    class Unmasked(torch.nn.Module):
        """Attends over the whole row whatever the mask: the grouped row would mix the completions."""

        def __init__(self, model):
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, position_ids=None, attention_mask=None, use_cache=False):
            return self.inner(input_ids=input_ids, use_cache=False)

    assert packing.takes_block_masks(tiny)
    assert not packing.takes_block_masks(Unmasked(tiny))
    assert logprobs.grouped_rows(Unmasked(tiny), *_batch(), 4) is None
