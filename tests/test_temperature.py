"""Sampling temperature at its edges (issue 38, case 8): 0 is greedy decoding on every engine, with finite log-probs
(those of the temperature-1 distribution, as vLLM reports them); a temperature below the smallest one sampled
(0.01) is refused in one line by the trainer's flag and by a rollout server (400). vLLM's side is in
test_vllm.py."""

from __future__ import annotations

import json
import math
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
import torch

from auto_research.cli import main
from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout.builtin import sample
from test_builtin_server import builtin_server  # noqa: F401 - the fixture

PROMPTS = ["1+2=", "Q: what is 33+4?", "x"]


def test_builtin_temperature_0_draws_the_argmax_k_times_with_temperature_1_log_probs(tiny_lm):
    model, tokenizer = tiny_lm
    drawn = sample(model, tokenizer, PROMPTS, 3, 6, temperature=0.0, seeds=[1, 2, 3])
    greedy = sample(model, tokenizer, PROMPTS, 1, 6, greedy=True)
    assert drawn.token_lists() == [row for row in greedy.token_lists() for _ in range(3)]
    mask = drawn.completion_mask.bool()
    assert torch.isfinite(drawn.sampler_logprobs).all() and torch.isfinite(drawn.sampler_entropy).all()
    with torch.no_grad():
        expected = token_logprobs(model, drawn.sequences, drawn.prompt_mask, drawn.completion_mask, 1.0)
    assert (drawn.sampler_logprobs - expected)[mask].abs().max() < 1e-5
    assert (drawn.sampler_logprobs[mask] < 0).all()  # a real distribution's, not greedy's log 1 = 0
    assert not drawn.trained_distribution  # the trainer's log π at the run's temperature is another one


def _generate(address: str, temperature) -> tuple[int, dict]:
    body = {"prompt_ids": [[20, 21, 22], [30]], "group_size": 3, "seeds": [5, 6],
            "settings": {"max_new_tokens": 5, "temperature": temperature}}
    request = Request(f"http://{address}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except HTTPError as error:
        text = error.read().decode()
        assert text.count("\n") <= 1, text  # one line
        return error.code, json.loads(text)


def test_a_builtin_server_answers_temperature_0_greedily_and_refuses_one_that_overflows(builtin_server):  # noqa: F811
    engine, address = builtin_server
    status, answer = _generate(address, 0)
    assert status == 200
    greedy = sample(engine.model, engine.tokenizer, [[20, 21, 22], [30]], 1, 5, greedy=True).token_lists()
    assert answer["completions"] == [row for row in greedy for _ in range(3)]
    assert all(math.isfinite(value) and value < 0 for row in answer["logprobs"] for value in row)
    for temperature in (1e-300, 0.001):
        status, answer = _generate(address, temperature)
        assert status == 400
        assert answer == {"error": f"temperature {temperature:g} is below the smallest sampling temperature, 0.01 "
                                   "(vLLM raises anything lower to it; far lower, logits / T overflow); 0 is greedy "
                                   "decoding"}
    assert _generate(address, 0.01)[0] == 200


@pytest.mark.parametrize("value, message", [
    ("1e-300", "--temperature 1e-300 is below the smallest sampling temperature, 0.01 (vLLM raises anything lower to "
               "it; far lower, logits / T overflow); 0 is greedy decoding"),
    ("0", "--temperature 0 is greedy decoding: a prompt's K completions would be identical and no group would carry "
          "a signal to train on; sample at a temperature >= 0.01"),
    ("-1", "--temperature must be a finite number >= 0, got -1.0"),
    ("nan", "--temperature must be a finite number >= 0, got nan"),
])
def test_a_run_s_temperature_that_cannot_train_is_one_line_and_exit_2(tiny_model_dir, sums_jsonl, tmp_path, capsys,
                                                                      value, message):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--temperature", value,
                 "--offline", "--device", "cpu", "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"auto-research: error: {message}"]
    assert not (tmp_path / "out").exists()
