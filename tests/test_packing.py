"""--max-tokens-per-micro-batch: the packed layout and the schedules by hand, the packed forward against the
padded one (log-probs, entropy, values and their gradients), the golden gradient under every budget, packed or
in buckets, and no logits tensor wider than a chunk in a whole step."""

from __future__ import annotations

import pytest
import torch

from auto_research.config.generation import GenerationConfig
from auto_research.engine import logprobs, packing
from auto_research.engine.logprobs import attention_for, completion_values, token_logprobs
from auto_research.engine.tiny import build_model, build_tokenizer
from auto_research.errors import UserError
from auto_research.train import micro_batches
from auto_research.train.micro_batches import packed_bins, sorted_buckets, split_to
from test_lm_core import _Fixed, _golden_setup  # the golden fixture's setup
from conftest import largest_difference, rms_difference
from test_lm_training import reward_module  # noqa: F401  (a fixture)

# Prompts of 3, 5, 1 and 4 tokens (left-padded to 5), completions of 7, 2, 5 and 1 (right-padded to 7).
PROMPT_MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 1, 1, 1, 1]])
COMPLETION_MASK = torch.tensor([[1] * 7, [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0]])


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)


def _batch():
    sequences = torch.randint(4, 260, (4, 12), generator=torch.Generator().manual_seed(0))
    return sequences, PROMPT_MASK, COMPLETION_MASK


def test_the_packed_row_by_hand():
    sequences = torch.arange(100, 100 + 4 * 12).view(4, 12)
    packed = packing.layout(sequences, PROMPT_MASK, COMPLETION_MASK)
    # Row 0: prompt columns 2-4 and completion columns 5-11; row 1: 0-4 and 5-6; row 2: 4 and 5-9; row 3: 1-4, 5.
    kept = [list(range(2, 12)), list(range(0, 7)), list(range(4, 10)), list(range(1, 6))]
    assert packed.input_ids.tolist() == [[100 + 12 * row + column for row in range(4) for column in kept[row]]]
    assert packed.position_ids.tolist() == [[*range(10), *range(7), *range(6), *range(5)]]
    # Each completion token is predicted from the token before it in the packed row: row 0's first completion
    # token (packed index 3) from index 2; row 1's (index 10 + 5) from 14; row 2's (17 + 1) from 17; row 3's from 26.
    assert packed.predictors.tolist() == [2, 3, 4, 5, 6, 7, 8, 14, 15, 17, 18, 19, 20, 21, 26]
    assert packed.targets.tolist() == sequences[:, 5:][COMPLETION_MASK.bool()].tolist()
    assert packing.row_tokens(PROMPT_MASK, COMPLETION_MASK).tolist() == [10, 7, 6, 5]
    with pytest.raises(ValueError, match="a completion without a prompt token"):
        packing.layout(sequences, torch.zeros_like(PROMPT_MASK), COMPLETION_MASK)


def test_schedules_by_hand():
    # First-fit decreasing in 16: 10; 7 does not fit beside it (17), a new one; 6 fits beside 10 (16); 5 beside 7.
    assert packed_bins([10, 7, 6, 5], 16, 4) == [[0, 2], [1, 3]]
    assert packed_bins([10, 7, 6, 5], 16, 1) == [[0], [1], [2], [3]]  # --micro-batch-size 1 caps the rows
    assert packed_bins([30, 2, 2], 16, 4) == [[0], [1, 2]]  # a row over the budget goes alone
    # Buckets by padded size: sorted 10 (3+7), 7 (5+2), 6 (1+5), 5 (4+1); 2 × (5 + 7) = 24 > 16, so 10 alone;
    # 7 and 6 pad to 2 × (5 + 5) = 20 > 16, so 7 alone; 6 and 5: 2 × (4 + 5) = 18 > 16 … each alone.
    assert sorted_buckets([3, 5, 1, 4], [7, 2, 5, 1], 16, 4) == [[0], [1], [2], [3]]
    assert sorted_buckets([3, 5, 1, 4], [7, 2, 5, 1], 24, 4) == [[0, 1], [2, 3]]
    assert sorted_buckets([3, 5, 1, 4], [7, 2, 5, 1], 48, 4) == [[0, 1, 2, 3]]
    # Another rank needs 4 micro-batches: the one with the most rows (the first of equals) is halved.
    assert split_to([[0, 1, 2], [3]], 3) == [[0], [1, 2], [3]]
    assert split_to([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    with pytest.raises(RuntimeError, match="cannot make the 3"):
        split_to([[0], [1]], 3)


def test_the_budget_is_a_positive_integer():
    with pytest.raises(UserError, match="--max-tokens-per-micro-batch must be a positive integer, got 0"):
        GenerationConfig(max_tokens_per_micro_batch=0).validate()
    assert GenerationConfig(max_tokens_per_micro_batch=1).validate().max_tokens_per_micro_batch == 1


def test_the_tiny_model_packs_and_a_model_that_mixes_sequences_does_not(tiny, monkeypatch):
    assert packing.packs_sequences(tiny)
    monkeypatch.setattr(packing, "_CHECKED", {})
    # The eager attention packs too; a model that ignores the position ids' restarts (here, by a mask of
    # ones that makes one causal sequence of the packed row) does not.
    original = type(tiny).forward

    def mixing(self, *args, **kwargs):
        if kwargs.get("attention_mask") is None and "input_ids" in kwargs:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny), "forward", mixing)
    assert not packing.packs_sequences(tiny)


@pytest.mark.parametrize("entropy_gradient", [False, True])
def test_packed_logprobs_and_entropy_equal_the_padded_batch_in_value_and_gradient(tiny, entropy_gradient):
    sequences, prompt_mask, mask = _batch()
    weights = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    results = []
    for pack in (False, True):
        chosen, entropy = token_logprobs(tiny, sequences, prompt_mask, mask, 1.3, with_entropy=True,
                                         entropy_gradient=entropy_gradient, pack=pack)
        loss = (chosen * weights).sum() + ((entropy * weights).sum() if entropy_gradient else 0.0)
        results.append((chosen.detach(), entropy.detach(), torch.autograd.grad(loss, list(tiny.parameters()))))
    (chosen, entropy, grads), (packed, packed_entropy, packed_grads) = results
    assert torch.allclose(packed, chosen, atol=1e-5) and torch.allclose(packed_entropy, entropy, atol=1e-5)
    assert (packed[mask == 0] == 0).all() and (packed_entropy[mask == 0] == 0).all()
    assert (packed[mask == 1] != 0).all()
    scale = max(float(grad.abs().max()) for grad in grads)
    for got, want in zip(packed_grads, grads):
        assert torch.allclose(got, want, atol=2e-6 * scale), float((got - want).abs().max())


def test_packed_logprobs_through_a_models_own_logits_equal_the_padded_ones(tiny, monkeypatch):
    """A model whose output layer cannot be taken apart (FSDP, soft-capped logits): the logits at the
    completion positions only, through ``logits_to_keep``."""
    sequences, prompt_mask, mask = _batch()
    expected = token_logprobs(tiny, sequences, prompt_mask, mask, 0.7, with_entropy=True)
    monkeypatch.setattr(logprobs, "_plain_output_layer", lambda model: None)
    shapes = []
    handle = tiny.lm_head.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
    got = token_logprobs(tiny, sequences, prompt_mask, mask, 0.7, with_entropy=True, pack=True)
    handle.remove()
    assert shapes == [(1, int(mask.sum()), 260)]  # 15 completion tokens, not 4 rows × 12 columns
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-5)


def tiny_critic(tiny, folder):
    """A critic (one-label token classifier) from the tiny model, its head drawn at random (at zero every value
    would be 0)."""
    from auto_research.engine.models import load_critic

    tiny.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    critic = load_critic(str(folder), "cpu", True, 260)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(2))
    return critic


def test_packed_values_equal_the_padded_ones_in_value_and_gradient(tiny, tmp_path):
    critic = tiny_critic(tiny, tmp_path)
    sequences, prompt_mask, mask = _batch()
    weights = torch.arange(1.0, 29.0).view(4, 7)
    results = []
    for pack in (False, True):
        values = completion_values(critic, sequences, prompt_mask, mask, pack=pack)
        results.append((values.detach(), torch.autograd.grad((values * weights).sum(), list(critic.parameters()))))
    (values, grads), (packed, packed_grads) = results
    assert torch.allclose(packed, values, atol=1e-5) and values.abs().max() > 0
    scale = max(float(grad.abs().max()) for grad in grads)
    for got, want in zip(packed_grads, grads):
        assert torch.allclose(got, want, atol=2e-6 * scale), float((got - want).abs().max())


@pytest.mark.parametrize("packs", [True, False], ids=["packed", "buckets"])
@pytest.mark.parametrize("budget, micro_batch_size", [(1, None), (11, None), (20, None), (40, None), (200, None),
                                                      (40, 3)])
def test_rloo_gradient_equals_the_golden_under_a_token_budget(budget, micro_batch_size, packs, monkeypatch):
    # The golden's 12 rows hold 9, 11 and 9 tokens (prompts of 4, 6, 4 and completions of 5): a budget of 1 or 11
    # gives every row a micro-batch of its own, 20 pairs, 40 fours, 200 one micro-batch (at most 3 rows with
    # --micro-batch-size 3). Without packing, the same budgets make length-sorted buckets.
    if not packs:
        monkeypatch.setattr(micro_batches, "packs_sequences", lambda model: False)
    golden, config, policy, reference, tokenizer, rollout = _golden_setup(
        max_tokens_per_micro_batch=budget, micro_batch_size=micro_batch_size)
    grads = _Fixed(config, policy, reference, tokenizer, rollout, golden["rewards"]).gradient()
    scale = max(float(golden[f"grad.{name}"].abs().max()) for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, golden[f"grad.{name}"], atol=2e-6 * scale), name


def test_no_logits_tensor_wider_than_a_chunk_in_a_whole_step(monkeypatch):
    """The reference, π_old and the update's forward and backward under a token budget: every logits tensor
    made, by the output layer or by the chunked log-probs, has at most CHUNK_ELEMENTS elements."""
    golden, config, policy, reference, tokenizer, rollout = _golden_setup(max_tokens_per_micro_batch=40)
    vocabulary = policy.config.vocab_size
    assert packing.packs_sequences(policy)  # the one-time check (5 tokens' logits) made before counting
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * vocabulary)
    made = []
    original = logprobs._logits
    monkeypatch.setattr(logprobs, "_logits", lambda *args: made.append(original(*args).shape) or original(*args))
    hooks = [model.lm_head.register_forward_hook(lambda module, args, output: made.append(output.shape))
             for model in (policy, reference)]
    grads = _Fixed(config, policy, reference, tokenizer, rollout, golden["rewards"]).gradient()
    for hook in hooks:
        hook.remove()
    assert grads and max(float(grad.abs().max()) for grad in grads.values()) > 0
    # 2 forward passes (reference, π_old) and the update's forward and backward, over 3 micro-batches of 4 rows
    # (20 completion tokens each, so 7 chunks of at most 3 rows).
    assert max(shape.numel() for shape in made) <= 3 * vocabulary
    assert sum(1 for shape in made if shape[-1] == vocabulary and shape.numel() > 0) >= 4 * 3 * 7


def test_a_rank_runs_as_many_micro_batches_as_the_rank_that_needs_the_most(tiny):
    """Under FSDP each forward is a collective: the schedule takes the most any rank packed (here another rank
    reports 4) and halves its largest micro-batches to match; rows keep their places."""
    from types import SimpleNamespace

    from auto_research.engine.rollout import Rollout

    sequences, prompt_mask, mask = _batch()
    rollout = Rollout(torch.cat([sequences] * 2), torch.cat([prompt_mask] * 2), torch.cat([mask] * 2), [""] * 8, 4)

    class World:
        def __init__(self, other):
            self.other = other

        def gather(self, tensor):
            return torch.cat([tensor, torch.tensor([self.other])])

    from auto_research.config.generation import GenerationConfig

    config = GenerationConfig(micro_batch_size=None, max_tokens_per_micro_batch=20)
    # Rows 4-7 (tokens 10, 7, 6, 5 as rows 0-3): first-fit decreasing in 20 gives [4, 5] (17), then [6, 7] (11).
    pack, parts = micro_batches.micro_batches(SimpleNamespace(config=config, world=World(1)), rollout, slice(4, 8),
                                              tiny)
    assert pack and [part.tolist() for part in parts] == [[4, 5], [6, 7]]
    pack, parts = micro_batches.micro_batches(SimpleNamespace(config=config, world=World(4)), rollout, slice(4, 8),
                                              tiny)
    assert [part.tolist() for part in parts] == [[4], [5], [6], [7]]
    chunk = micro_batches.rows_of(rollout, parts[1])  # row 5, trimmed: its prompt of 5, its completion of 2
    assert torch.equal(chunk.completion_mask, mask[1:2, :2]) and torch.equal(chunk.prompt_mask, prompt_mask[1:2])
    assert torch.equal(chunk.sequences, sequences[1:2, :7])


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(lora_r=4),
    dict(gradient_checkpointing=True),
    dict(checkpoint_mlp=True),
    dict(algorithm="ppo-rlhf"),
    dict(algorithm="grpo", entropy_coef=0.01),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "rloo")
def test_a_whole_step_under_a_token_budget_ends_where_the_unpacked_step_ends(tiny_model_dir, tmp_path, reward_module,
                                                                            overrides):
    """One trainer step (sampling, π_old and reference passes, the update) on prompts of 4 to 8 tokens, with
    micro-batches of at most 24 tokens against the whole batch: the same weights after AdamW's first step."""
    import json

    from test_lm_training import _one_step_weights

    data = tmp_path / "varied.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in (1, 12, 123, 1234, 12345, 7) for b in range(6)))
    whole, whole_row = _one_step_weights(tiny_model_dir, data, tmp_path / "a", reward_module, **overrides)
    packed, packed_row = _one_step_weights(tiny_model_dir, data, tmp_path / "b", reward_module,
                                           max_tokens_per_micro_batch=24, **overrides)
    assert packed_row["loss"] == pytest.approx(whole_row["loss"], abs=1e-6)
    # The gradient summed in another order, which AdamW's first step lifts to up to 2 lr in an element whose
    # gradient is within rounding of zero; a row lost or counted twice turns most elements' steps: RMS <= lr / 10
    # (conftest.rms_difference); a uniform scale, which the step hides, shows in the norm (~1e-6 relative rounding).
    assert packed_row["grad_norm"] == pytest.approx(whole_row["grad_norm"], rel=1e-4)
    difference, bound = rms_difference(packed, whole), whole_row["learning_rate"] / 10
    print(f"weights' RMS difference {difference:.2e} (bound {bound:.1e}), "
          f"largest {largest_difference(packed, whole):.2e}; grad norms {packed_row['grad_norm']:.8g}, "
          f"{whole_row['grad_norm']:.8g}")
    assert difference <= bound, (difference, bound)
    assert whole_row["grad_norm"] > 0
