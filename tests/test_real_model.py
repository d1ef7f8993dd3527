"""A real pretrained model end to end: SmolLM2-135M-Instruct (134.5M parameters, 49,152-token vocabulary, a chat
template, EOS and pad both <|im_end|>) through sampling, training, checkpoints and an exact resume."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file

from auto_research.cli import main

QUESTIONS = [{"question": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)}
             for a, b in [(12, 30), (41, 19), (7, 8), (23, 45), (60, 11), (5, 94), (33, 33), (18, 27), (71, 2), (9, 9),
                          (44, 15), (3, 68)]]


def _data(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in QUESTIONS))
    return path


def _args(model, data, output, steps):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--prompt-field", "question",
            "--answer-field", "answer", "--steps", str(steps), "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "8", "--evaluation-examples", "2", "--eval-every", "0", "--checkpoint-every", "1",
            "--keep-checkpoints", "3", "--learning-rate", "1e-5", "--warmup-steps", "0", "--temperature", "1.0",
            "--seed", "1", "--offline", "--device", "cpu", "--no-progress", "--output-dir", str(output)]


def test_the_chat_template_eos_and_padding_of_a_real_model(smollm2_dir, tmp_path):
    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    config = GenerationConfig(model=str(smollm2_dir), dataset=str(_data(tmp_path)), prompt_field="question",
                              answer_field="answer", steps=1, prompts_per_step=4, group_size=2, max_new_tokens=24,
                              evaluation_examples=2, temperature=1.0, output_dir=tmp_path / "out", offline=True,
                              device="cpu", progress=False)
    trainer = Trainer.build(config, log=lambda text: None)
    run, drawing = trainer.run, trainer.drawing
    # The chat template, with the generation prompt, is what the model sees.
    assert all(prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
               for prompt in drawing.train_prompts)
    assert QUESTIONS[0]["question"] in drawing.train_prompts[0]
    eos = run.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert run.tokenizer.eos_token_id == run.tokenizer.pad_token_id == eos
    rollout = trainer.sample(1)
    ids, mask = rollout.completion_ids, rollout.completion_mask
    finished = 0
    for row in range(ids.shape[0]):
        ended = (ids[row] == eos).nonzero()
        if ended.numel():  # stops at the first <|im_end|>: counted, and every token after it masked out
            first = int(ended[0])
            assert int(mask[row].sum()) == first + 1 and mask[row, first] == 1
            assert (mask[row, first + 1:] == 0).all() and (ids[row, first + 1:] == eos).all()
            finished += 1
        else:
            assert int(mask[row].sum()) == ids.shape[1]
        assert "<|im_end|>" not in rollout.completions[row]
    assert finished > 0  # an instruct model answers a sum within 24 tokens
    # The sampler's log-probs are the model's own: a forward over the same tokens gives them again.
    from auto_research.engine.logprobs import token_logprobs

    with torch.no_grad():
        again = token_logprobs(trainer.models.policy, rollout.sequences, rollout.prompt_mask, mask, 1.0)
    assert float((again - rollout.sampler_logprobs).abs().max()) < 1e-3


def test_a_real_model_trains_saves_reloads_and_resumes_exactly(smollm2_dir, tmp_path, capsys):
    from auto_research.engine.logprobs import token_logprobs
    from auto_research.engine.models import load_policy
    from auto_research.train.trainer import Trainer

    data = _data(tmp_path)
    assert main(_args(smollm2_dir, data, tmp_path / "whole", 2)) == 0, capsys.readouterr().err
    whole = tmp_path / "whole" / "rloo-sums-seed1"
    # A run killed after step 1: its folder as it was then.
    cut = tmp_path / "cut" / "rloo-sums-seed1"
    shutil.copytree(whole / "checkpoints" / "step-000001", cut / "checkpoints" / "step-000001")
    (cut / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    assert main(_args(smollm2_dir, data, tmp_path / "cut", 2) + ["--resume"]) == 0, capsys.readouterr().err
    expected = load_file(str(whole / "checkpoints" / "step-000002" / "model.safetensors"))
    got = load_file(str(cut / "checkpoints" / "step-000002" / "model.safetensors"))
    start = load_file(str(smollm2_dir / "model.safetensors"))
    assert expected.keys() == got.keys() and all(torch.equal(expected[name], got[name]) for name in expected)
    assert max(float((expected[name] - start[name]).abs().max()) for name in start) > 0  # it trained
    # The reloaded checkpoint is the trained model: the same log-probs on the same tokens.
    model, _ = load_policy(str(whole / "checkpoints" / "step-000002"), "cpu", torch.float32, offline=True)
    from auto_research.config.generation import GenerationConfig

    config = GenerationConfig(model=str(smollm2_dir), dataset=str(data), prompt_field="question",
                              answer_field="answer", steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8,
                              evaluation_examples=2, eval_every=0, learning_rate=1e-5, warmup_steps=0, temperature=1.0,
                              seed=1, output_dir=tmp_path / "memory", offline=True, device="cpu", progress=False)
    trainer = Trainer.build(config, log=lambda text: None)
    trainer.step(1)
    trainer.step(2)
    rollout = trainer.sample(3)
    arguments = (rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    with torch.no_grad():
        trained, reloaded = token_logprobs(trainer.components.policy, *arguments), token_logprobs(model, *arguments)
    assert torch.equal(trained, reloaded)


def test_the_packaged_tools_model_shows_tools_and_reads_back_its_calls(smollm2_dir):
    """smollm2-135m-instruct-tools: SmolLM2's weights (linked, not copied) with our tool-calling template. Without
    tools it renders as the model's own template; with them the system turn lists each schema and the
    <tool_call> format, which envs/tools.py reads (hermes); a call drawn by the model is answered by the tool as
    a <tool_response> turn, appended token by token (envs/trajectory.py)."""
    import os
    from pathlib import Path

    from transformers import AutoTokenizer

    from auto_research.engine.packaged import materialise
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.envs import Episode
    from auto_research.envs.tools import call_format, check_template_takes_tools, tool_schema
    from auto_research.envs.trajectory import Conversation, run_episodes

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    folder = Path(materialise("smollm2-135m-instruct-tools", log=lambda text: None))
    assert os.path.samefile(folder / "model.safetensors", smollm2_dir / "model.safetensors")
    tokenizer, plain = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == plain.apply_chat_template(chat, tokenize=False)
    schema = tool_schema(add)
    check_template_takes_tools(tokenizer, [schema], "smollm2-135m-instruct-tools")  # plain's is refused there
    assert call_format(tokenizer) == "hermes"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    replies = iter([call, "It is 5."])

    def generate(prompt_ids, seeds, settings):
        ids = tokenizer(next(replies), add_special_tokens=False)["input_ids"] + [end]
        return [ids], [[-0.5] * len(ids)]

    conversation = Conversation(tokenizer, [schema], (end,))
    [trajectory] = run_episodes(generate, conversation, [Episode(None, {}, {"add": add})], ["What is 2 + 3?"], [1],
                                SamplingSettings(max_new_tokens=64), max_turns=3, max_tokens=400)
    assert trajectory.messages[2] == {"role": "tool", "name": "add", "content": "5"}
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors) == (2, 1, 0)
    text = tokenizer.decode(trajectory.prompt_ids + trajectory.ids)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and \
        json.dumps(schema) in system and "<tool_call>" in system
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n" + call +
                         "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\nIt is 5.<|im_end|>")
    # A structured tool call (a dataset's, OpenAI's shape) renders as the model writes one.
    structured = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "add", "arguments": {"a": 2, "b": 3}}}]}], tools=[schema], tokenize=False)
    assert structured.endswith("<|im_start|>assistant\n" + call + "<|im_end|>\n")
