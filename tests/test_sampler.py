"""The lean sampler: the distribution it draws from, its filters, and per-prompt seeding."""

from __future__ import annotations

import pytest
import torch

from auto_research.engine.logprobs import completion_logits
from auto_research.engine.rollout import prompt_seed
from auto_research.engine.rollout.builtin import draw, filter_logits, sample


def test_samples_of_a_prompt_do_not_depend_on_its_batch(tiny_lm):
    """Left padding, batch size and order change nothing: each prompt draws from its own seed."""
    model, tokenizer = tiny_lm
    prompts = ["1+2=", "Q: what is 33+4?", "x"]
    seeds = [prompt_seed(42, 3, index) for index in (7, 11, 5)]
    together = sample(model, tokenizer, prompts, 4, 10, temperature=1.3, seeds=seeds)
    for i, prompt in enumerate(prompts):
        alone = sample(model, tokenizer, [prompt], 4, 10, temperature=1.3, seeds=[seeds[i]])
        assert alone.completions == together.completions[4 * i: 4 * i + 4]
        width = int(alone.completion_mask.shape[1])
        assert torch.equal(alone.completion_ids, together.completion_ids[4 * i: 4 * i + 4, :width])
    other_step = sample(model, tokenizer, prompts, 4, 10, temperature=1.3,
                        seeds=[prompt_seed(42, 4, index) for index in (7, 11, 5)])
    assert other_step.completions != together.completions
    assert prompt_seed(42, 3, 7) != prompt_seed(42, 7, 3) != prompt_seed(43, 3, 7)



def test_prompts_given_as_token_ids_draw_what_their_texts_draw(tiny_lm):
    """Token ids go in as they are (a multi-turn history is never re-tokenized): the same draws, ids and
    log-probs as the texts they encode."""
    model, tokenizer = tiny_lm
    prompts = ["1+2=", "Q: what is 33+4?"]
    seeds = [prompt_seed(1, 2, index) for index in range(2)]
    ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    from_texts = sample(model, tokenizer, prompts, 3, 8, temperature=1.1, seeds=seeds)
    from_ids = sample(model, tokenizer, ids, 3, 8, temperature=1.1, seeds=seeds)
    assert torch.equal(from_ids.sequences, from_texts.sequences)
    assert torch.equal(from_ids.prompt_mask, from_texts.prompt_mask)
    assert torch.equal(from_ids.sampler_logprobs, from_texts.sampler_logprobs)
    assert from_ids.completions == from_texts.completions

def test_first_token_frequencies_match_the_trained_distribution(tiny_lm):
    """40000 draws of the first token against softmax(logits / T) from the training forward."""
    model, tokenizer = tiny_lm
    temperature = 0.7
    rollout = sample(model, tokenizer, ["7+8="], 40000, 1, temperature=temperature, seeds=[123])
    exact = completion_logits(model, rollout.sequences[:1], rollout.prompt_mask[:1], torch.ones(1, 1, dtype=torch.long),
                              temperature)[0, 0].softmax(-1).double()
    counts = torch.bincount(rollout.completion_ids[:, 0], minlength=exact.numel()).double()
    total_variation = 0.5 * (counts / counts.sum() - exact).abs().sum()
    assert total_variation < 0.04, total_variation


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (20, 0.5), (0, 0.01)])
def test_filters_keep_the_same_tokens_as_hugging_face(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    ours = filter_logits(logits, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert (~torch.isinf(ours)).sum(-1).min() >= 1


def test_draw_is_the_inverse_cdf():
    """Hand example: probabilities (0.5, 0.25, 0.25) split [0, 1) at 0.5 and 0.75; −inf never drawn."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 5, dtype=torch.float64))
    uniforms = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.99], dtype=torch.float64)
    assert draw(logits, uniforms).tolist() == [0, 0, 1, 1, 2]


def test_greedy_equals_hugging_face_generate(tiny_lm):
    model, tokenizer = tiny_lm
    prompts = ["1+2=", "Q: what is 33+4?", "x"]
    ours = sample(model, tokenizer, prompts, 1, 12, greedy=True)
    batch = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    theirs = model.generate(**batch, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    width = ours.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids, theirs[:, batch["input_ids"].shape[1]:][:, :width])


def test_top_k_sampling_stays_inside_the_top_k(tiny_lm):
    model, tokenizer = tiny_lm
    rollout = sample(model, tokenizer, ["7+8="], 2000, 1, temperature=1.0, top_k=3, seeds=[5])
    logits = completion_logits(model, rollout.sequences[:1], rollout.prompt_mask[:1], torch.ones(1, 1, dtype=torch.long))
    allowed = set(torch.topk(logits[0, 0], 3).indices.tolist())
    drawn = set(rollout.completion_ids[:, 0].tolist())
    assert drawn == allowed


def test_trimmed_micro_batches_give_the_log_probs_and_gradient_of_the_padded_batch(tiny_lm):
    """Micro-batches cut to their own longest prompt and completion, with logits only at completion
    positions, against the whole padded batch through the full output layer."""
    from auto_research.engine.logprobs import attention_for, token_logprobs
    from auto_research.engine.rollout import Rollout
    from auto_research.train.experience import widen as _widen

    model, tokenizer = tiny_lm
    rollout = sample(model, tokenizer, ["1+2=", "Q: what is 33+4?"], 2, 8, temperature=1.0, seeds=[1, 2])
    # Completions of 8, 2, 5 and 1 tokens; the first group has the short prompt (left padding).
    lengths = torch.tensor([8, 2, 5, 1])
    mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rollout = Rollout(rollout.sequences, rollout.prompt_mask, mask, rollout.completions, 2)
    weights = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def padded_loss():
        attention, positions = attention_for(rollout.sequences, rollout.prompt_mask, mask)
        logits = model(input_ids=rollout.sequences, attention_mask=attention, position_ids=positions).logits
        logits = logits[:, rollout.prompt_length - 1: -1].log_softmax(-1)
        chosen = logits.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1) * mask
        return chosen, (chosen * weights).sum()

    model.zero_grad()
    expected, loss = padded_loss()
    loss.backward()
    expected_grad = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    pieces = []
    for start in (0, 2):
        chunk = rollout.rows(start, start + 2, trim=True)
        assert chunk.sequences.shape[1] < rollout.sequences.shape[1]  # something was cut
        logprobs = _widen(token_logprobs(model, chunk.sequences, chunk.prompt_mask, chunk.completion_mask), 8)
        (logprobs * weights[start: start + 2]).sum().backward()
        pieces.append(logprobs.detach())
    assert torch.allclose(torch.cat(pieces), expected.detach(), atol=1e-5)
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.grad, expected_grad[name], atol=1e-5), name
    model.zero_grad()


def test_rows_that_end_leave_the_decode_batch_and_every_draw_stays_the_same(tiny_lm):
    """With the end-of-sequence logit raised, rows end at varied steps: dropping each from the batch and its KV
    cache as it ends draws the same tokens, log-probs and entropies as decoding every row to the end, while
    the forwards run on fewer and fewer rows."""
    import copy

    model, tokenizer = tiny_lm
    tilted = copy.deepcopy(model)
    with torch.no_grad():
        tilted.lm_head.weight[tokenizer.eos_token_id] += 0.6 * tilted.model.norm.weight / tilted.model.norm.weight.norm()
    prompts = ["1+2=", "Q: what is 33+4?", "x", "hello there"]
    seeds = [prompt_seed(7, 0, index) for index in range(len(prompts))]
    rows_seen = []
    hook = tilted.model.register_forward_pre_hook(lambda module, args, kwargs: rows_seen.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    dropped = sample(tilted, tokenizer, prompts, 4, 24, temperature=1.2, seeds=seeds)
    decode_rows = rows_seen[1:]
    rows_seen.clear()
    kept = sample(tilted, tokenizer, prompts, 4, 24, temperature=1.2, seeds=seeds, drop_finished=False)
    hook.remove()
    lengths = dropped.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and bool((lengths < 24).any())  # rows did end at varied steps
    assert set(rows_seen[1:]) == {16} and decode_rows[0] == 16 and decode_rows[-1] < 16
    assert decode_rows == sorted(decode_rows, reverse=True)
    assert sum(decode_rows) < sum(rows_seen[1:])
    assert torch.equal(dropped.sequences, kept.sequences)
    assert torch.equal(dropped.completion_mask, kept.completion_mask)
    assert dropped.completions == kept.completions
    assert torch.allclose(dropped.sampler_logprobs, kept.sampler_logprobs, atol=1e-6)
    assert torch.allclose(dropped.sampler_entropy, kept.sampler_entropy, atol=1e-6)
    greedy_dropped = sample(tilted, tokenizer, prompts, 1, 24, greedy=True)
    greedy_kept = sample(tilted, tokenizer, prompts, 1, 24, greedy=True, drop_finished=False)
    assert torch.equal(greedy_dropped.sequences, greedy_kept.sequences)
