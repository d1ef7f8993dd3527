"""The one log-prob function: against a hand loop, padding, post-EOS tokens and generate's own scores."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from auto_research.engine.logprobs import kl_per_token, token_logprobs
from auto_research.engine.rollout import completion_mask
from auto_research.engine.rollout.builtin import sample


def _load(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def test_completion_mask_keeps_tokens_up_to_and_including_the_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 2, 0, 0, 0], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, [2]), expected)


def test_logprobs_equal_a_hand_loop_over_tokens(tiny_model_dir):
    model, tokenizer = _load(tiny_model_dir)
    prompt = tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    completion = tokenizer("51", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sequence = torch.tensor([prompt + completion])
    got = token_logprobs(model, sequence, torch.ones(1, len(prompt)), torch.ones(1, len(completion)))
    with torch.no_grad():
        for t, token in enumerate(completion):
            prefix = torch.tensor([prompt + completion[:t]])
            logits = model(input_ids=prefix).logits[0, -1]
            expected = torch.log_softmax(logits.double(), dim=-1)[token].item()
            assert abs(got[0, t].item() - expected) < 1e-5


def test_left_padding_and_tokens_after_eos_change_nothing(tiny_model_dir):
    model, tokenizer = _load(tiny_model_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt = tokenizer("7+8=", add_special_tokens=False)["input_ids"]
    completion = tokenizer("51", add_special_tokens=False)["input_ids"] + [eos]
    plain = token_logprobs(model, torch.tensor([prompt + completion]), torch.ones(1, len(prompt)), torch.ones(1, 3))
    # Three pad tokens on the left, and junk after EOS that the mask excludes.
    junk = tokenizer("99", add_special_tokens=False)["input_ids"]
    sequence = torch.tensor([[pad] * 3 + prompt + completion + junk])
    prompt_mask = torch.tensor([[0] * 3 + [1] * len(prompt)])
    mask = completion_mask(sequence[:, prompt_mask.shape[1]:], [eos])
    padded = token_logprobs(model, sequence, prompt_mask, mask)
    assert torch.allclose(padded[0, :3], plain[0], atol=1e-5)
    assert torch.all(padded[0, 3:] == 0)


def test_logprobs_match_what_generate_sampled_from(tiny_model_dir):
    model, tokenizer = _load(tiny_model_dir)
    torch.manual_seed(0)
    prompts = ["1+2=", "13+45="]
    batch = tokenizer(prompts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    out = model.generate(**batch, do_sample=True, top_k=0, max_new_tokens=5, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    prompt_length = batch["input_ids"].shape[1]
    completion = out.sequences[:, prompt_length:]
    mask = completion_mask(completion, [tokenizer.eos_token_id])
    from_generate = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1) * mask
    ours = token_logprobs(model, out.sequences, batch["attention_mask"], mask).detach()
    assert torch.allclose(ours, from_generate, atol=1e-5)


def test_sample_returns_groups_of_k_with_masks(tiny_model_dir):
    model, tokenizer = _load(tiny_model_dir)
    torch.manual_seed(1)
    rollout = sample(model, tokenizer, ["1+1=", "22+33="], group_size=3, max_new_tokens=4)
    assert rollout.sequences.shape[0] == 6 and rollout.completion_mask.shape == (6, rollout.completion_ids.shape[1])
    assert len(rollout.completions) == 6
    # Rows 0..2 answer the first prompt: their prompt tokens are identical.
    assert torch.equal(rollout.sequences[0, : rollout.prompt_length], rollout.sequences[2, : rollout.prompt_length])


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # log r = ref − logp = [−0.5, 1.0]
    assert torch.allclose(kl_per_token(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_per_token(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    expected_k3 = torch.tensor([torch.exp(torch.tensor(-0.5)) - 1 + 0.5, torch.exp(torch.tensor(1.0)) - 1 - 1.0])
    assert torch.allclose(kl_per_token(logp, ref, "k3"), expected_k3)


def test_the_checkpoints_generation_config_does_not_change_what_is_sampled(tiny_model_dir, tmp_path):
    # Instruct checkpoints often ship repetition_penalty=1.1 and the like; sampling must still be
    # from exactly the distribution that training computes log-probs of.
    model, tokenizer = _load(tiny_model_dir)
    prompts = ["1+2=", "13+45=", "7+7="]
    torch.manual_seed(3)
    plain = sample(model, tokenizer, prompts, 4, 6, temperature=1.0)
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.do_sample, model.generation_config.top_k = True, 3
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    styled, _ = _load(tmp_path)
    assert styled.generation_config.repetition_penalty == 5.0
    torch.manual_seed(3)
    again = sample(styled, tokenizer, prompts, 4, 6, temperature=1.0)
    assert torch.equal(plain.sequences, again.sequences)
    assert styled.generation_config.repetition_penalty == 5.0  # the model's own config is left as it was
    # Greedy too: a suppressed token in the checkpoint's config does not change the argmax.
    first = sample(model, tokenizer, prompts, 1, 1, greedy=True).completion_ids[:, 0]
    styled.generation_config.suppress_tokens = first.tolist()
    assert torch.equal(sample(styled, tokenizer, prompts, 1, 1, greedy=True).completion_ids[:, 0], first)


def test_chunked_logprobs_equal_the_full_logits_in_value_and_gradient(tiny_model_dir, monkeypatch):
    from auto_research.engine import logprobs
    from auto_research.engine.logprobs import completion_hidden, completion_logits

    model, tokenizer = _load(tiny_model_dir)
    rows = [("3+4=", "7"), ("12+30=", "24"), ("5+5=", "01")]
    encoded = [(tokenizer(p, add_special_tokens=False)["input_ids"],
                tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for p, c in rows]
    P, C, pad = max(len(p) for p, _ in encoded), max(len(c) for _, c in encoded), tokenizer.pad_token_id
    sequences = torch.tensor([[pad] * (P - len(p)) + p + c + [pad] * (C - len(c)) for p, c in encoded])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _ in encoded])
    mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for _, c in encoded])
    assert completion_hidden(model, sequences, prompt_mask, mask)[0] is not None  # the tiny Qwen2 takes this path
    # Several chunks of 5 rows' logits (the vocabulary is 260 tokens wide).
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 5 * 260)
    chunked, entropy = token_logprobs(model, sequences, prompt_mask, mask, temperature=1.3, with_entropy=True)
    chunked_grads = torch.autograd.grad((chunked * torch.arange(1.0, 1 + chunked.numel()).view_as(chunked)).sum(),
                                        list(model.parameters()))
    logits = completion_logits(model, sequences, prompt_mask, mask, temperature=1.3)
    log_p = torch.log_softmax(logits, dim=-1)
    full = log_p.gather(-1, sequences[:, P:].unsqueeze(-1)).squeeze(-1) * mask
    full_grads = torch.autograd.grad((full * torch.arange(1.0, 1 + full.numel()).view_as(full)).sum(),
                                     list(model.parameters()))
    assert torch.allclose(chunked, full, atol=1e-6)
    assert torch.allclose(entropy, (-(log_p.exp() * log_p).sum(-1) * mask).detach(), atol=1e-5)
    for got, want in zip(chunked_grads, full_grads):
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert (entropy[mask == 0] == 0).all() and (chunked[mask == 0] == 0).all()


@pytest.mark.parametrize("sharing", ["grouped rows", "kv cache"])
@pytest.mark.parametrize("kind", ["policy", "lora reference", "critic"])
def test_a_groups_prompt_shared_by_its_samples_gives_the_same_numbers_and_gradients(tiny_model_dir, kind, sharing,
                                                                                    monkeypatch):
    """Both ways of computing a group's prompt once (one row a group under a block mask; or the prompt's KV cache
    repeated for the K rows, for models that take no block mask) against one padded row a sample."""
    from auto_research.engine import logprobs
    from auto_research.engine.logprobs import completion_values, shares_prompts
    from auto_research.engine.models import load_critic

    model, tokenizer = _load(tiny_model_dir)
    groups = [("3+4=", ["7", "8", "17"]), ("12+30=", ["24", "2", "240"])]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in groups]
    P, pad, eos = max(map(len, prompt_ids)), tokenizer.pad_token_id, tokenizer.eos_token_id
    rows = [(ids, tokenizer(c, add_special_tokens=False)["input_ids"] + [eos]) for ids, (_, cs) in zip(prompt_ids, groups)
            for c in cs]
    C = max(len(c) for _, c in rows)
    sequences = torch.tensor([[pad] * (P - len(p)) + p + c + [pad] * (C - len(c)) for p, c in rows])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p, _ in rows])
    mask = torch.tensor([[1] * len(c) + [0] * (C - len(c)) for _, c in rows])
    if kind == "critic":
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            model = load_critic(folder, "cpu", True, len(tokenizer))
        torch.manual_seed(0)
        with torch.no_grad():
            model.score.weight.normal_()  # a head at zero would make every value 0
        function = completion_values
    else:
        function = token_logprobs
    if kind == "lora reference":
        import peft

        from auto_research.engine.lora import AdaptersDisabled

        model = AdaptersDisabled(peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"])))
    assert shares_prompts(model, sequences, prompt_mask, 3) and not shares_prompts(model, sequences, prompt_mask, 2)
    assert logprobs.grouped_rows(model, sequences, prompt_mask, mask, 3) is not None
    if sharing == "kv cache":
        monkeypatch.setattr(logprobs, "grouped_rows", lambda *args, **kwargs: None)
    weights = torch.arange(1.0, 1 + mask.numel()).view_as(mask)
    results = []
    for group_size in (3, 1):
        out = function(model, sequences, prompt_mask, mask, group_size=group_size)
        parameters = [p for p in model.parameters() if p.requires_grad]
        # (The reference's weights are all frozen: its numbers are compared, there are no gradients.)
        grads = torch.autograd.grad((out * weights).sum(), parameters) if out.requires_grad else ()
        results.append((out.detach(), grads))
    (shared, shared_grads), (whole, whole_grads) = results
    assert torch.allclose(shared, whole, atol=1e-5), float((shared - whole).abs().max())
    assert shared.abs().max() > 0
    scale = max((float(grad.abs().max()) for grad in whole_grads), default=0.0)  # float32 rounding, relative
    for got, want in zip(shared_grads, whole_grads):
        assert torch.allclose(got, want, atol=2e-6 * scale), float((got - want).abs().max())
