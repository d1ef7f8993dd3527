"""Training on multi-turn trajectories (--environment, --tools): the loss counts the model's own tokens only, the
trained ids are the sampled ids, a scripted game's rewards and advantages are the hand-computed ones, the builtin
sampler and vLLM build the same trajectories, a resumed run (with batches in flight) ends exactly as a whole one,
and bad input is one line and exit 2."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from auto_research.config.generation import GenerationConfig
from auto_research.envs.trajectory import turn_seed
from auto_research.train import update as update_module
from auto_research.train.experience import build_experience
from auto_research.train.rollouts import agreed_scores, draw_batch, produce
from auto_research.train.trainer import Trainer
from auto_research.train.update import estimate_advantages, update_actor
from conftest import run_cli

def _trainer(model_dir, data, output, **overrides) -> Trainer:
    from sums_game import make_env

    settings = dict(model=str(model_dir), dataset=str(data), output_dir=output, steps=4, prompts_per_step=1,
                    group_size=4, max_new_tokens=3, max_turns=3, max_trajectory_tokens=20, learning_rate=1e-3,
                    evaluation_examples=4,
                    progress=False, offline=True, seed=3, device="cpu", beta=0.0)
    settings.update(overrides)
    return Trainer.build(GenerationConfig(**settings).filled().validate(), log=lambda text: None,
                         environment=make_env)


# Trajectory k of the group: its replies turn by turn (answer: the row's sum). Rewards by hand:
# k0: right at once → 1.0; k1: wrong, right → −0.1 + 1 = 0.9; k2: wrong ×3 → −0.3, truncated at --max-turns 3;
# k3: "!" → the environment raises → None (unscored, out of the baseline).
SCRIPT = [lambda answer: [answer], lambda answer: ["x", answer], lambda answer: ["x", "y", "z"],
          lambda answer: ["!"]]


def _scripted(trainer: Trainer, step: int = 1):
    """The step's batch, its trajectories' replies drawn from SCRIPT (each reply ends in EOS, log-prob −0.5 a
    token), through the run's own rollout side: (drawn, source)."""
    source = trainer.source()
    batch = draw_batch(source, copy.deepcopy(trainer.state.rng), step)
    [seed], [example] = batch.seeds, batch.examples
    which = {turn_seed(turn_seed(seed, k, 0), 0, t): (k, t) for k in range(4) for t in range(3)}
    eos = trainer.run.tokenizer.eos_token_id

    def generate(prompt_ids, seeds, settings):
        replies = [SCRIPT[which[s][0]](example.answer)[which[s][1]] for s in seeds]
        tokens = [trainer.run.tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos] for reply in replies]
        return tokens, [[-0.5] * len(ids) for ids in tokens]

    trainer.drawing.sampler.generate_ids = generate  # the rollout side asks the sampler for each turn
    source = trainer.source()
    return produce(source, trainer.state.rng, step, step - 1), example


def test_a_scripted_game_gives_the_hand_computed_rewards_and_advantages(tiny_model_dir, sums_jsonl, tmp_path, game):
    trainer = _trainer(tiny_model_dir, sums_jsonl, tmp_path)
    drawn, example = _scripted(trainer)
    rollout = drawn.rollout
    assert drawn.rewards[:3] == pytest.approx([1.0, 0.9, -0.3]) and drawn.rewards[3] is None
    assert [row["turns"] for row in rollout.episodes] == [1, 2, 3, 1]
    assert [row["truncated"] for row in rollout.episodes] == [False, False, True, False]
    assert rollout.episodes[3]["failed"] == "RuntimeError: boom"
    tokenizer = trainer.run.tokenizer
    # Row 1's trajectory: "x</s>", the environment's "\nno\n", then the answer and </s>; mask 1 on the model's.
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    row = rollout.completion_ids[1][rollout.completion_mask[1].bool()].tolist()
    assert row == ids("x") + [eos] + ids("\nno\n") + ids(example.answer) + [eos]
    assert rollout.loss_mask[1][: len(row)].tolist() == ([1] * (len(ids("x")) + 1) + [0] * len(ids("\nno\n"))
                                                        + [1] * (len(ids(example.answer)) + 1))
    scores = agreed_scores(trainer.run.world, drawn, 1, 4)
    experience = build_experience(trainer.run, trainer.models, rollout, scores, 0)
    advantages = estimate_advantages(trainer.run, experience).advantages
    # Leave-one-out over the three scored: 1 − (0.9 − 0.3)/2, 0.9 − (1 − 0.3)/2, −0.3 − (1 + 0.9)/2; 0 unscored.
    by_hand = torch.tensor([0.7, 0.55, -1.25, 0.0])
    owned = rollout.loss_mask.bool()
    for index in range(4):
        assert torch.allclose(advantages[index][owned[index]], by_hand[index].expand(int(owned[index].sum())),
                              atol=1e-6)
    assert float(advantages[~owned].abs().max()) == 0.0  # the environment's tokens carry nothing


def _gradient(trainer: Trainer, experience, monkeypatch, perturb=None) -> list[torch.Tensor]:
    """The actor's gradient of one update on ``experience`` (the optimizer step replaced by a recorder);
    ``perturb(targets) -> bool mask``: positions whose policy log-probs are changed (× 3 + 1, with gradient)."""
    recorded = []
    original = update_module.token_logprobs

    def changed(*args, **kwargs):
        output = original(*args, **kwargs)
        logprobs = output[0] if isinstance(output, tuple) else output
        sequences, prompt_mask = args[1], args[2]
        where = perturb(sequences[:, prompt_mask.shape[1]:]).float() if perturb else 0.0
        logprobs = logprobs + where * (2 * logprobs + 1.0)
        return (logprobs, *output[1:]) if isinstance(output, tuple) else logprobs

    def record(c, model, optimizer, update):
        recorded.extend(p.grad.detach().clone() for p in model.parameters() if p.grad is not None)
        optimizer.zero_grad(set_to_none=True)
        return 0.0

    monkeypatch.setattr(update_module, "token_logprobs", changed)
    monkeypatch.setattr(update_module, "optimizer_step", record)
    update_actor(trainer.run, trainer.models, experience, estimate_advantages(trainer.run, experience), 0)
    return recorded


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_changing_only_the_environment_s_log_probs_leaves_the_gradient_unchanged(tiny_model_dir, sums_jsonl, tmp_path,
                                                                                  game, monkeypatch, algorithm):
    trainer = _trainer(tiny_model_dir, sums_jsonl, tmp_path, algorithm=algorithm, beta=0.1,
                       **({"kl_in": "loss"} if algorithm == "grpo" else {}))
    drawn, _ = _scripted(trainer)
    scores = agreed_scores(trainer.run.world, drawn, 1, 4)
    experience = build_experience(trainer.run, trainer.models, drawn.rollout, scores, 0)
    environment = (drawn.rollout.completion_mask - drawn.rollout.loss_mask).bool()
    assert environment.any()
    base = _gradient(trainer, experience, monkeypatch)
    assert max(float(g.abs().max()) for g in base) > 0
    # The environment's tokens: the sampler's, the old policy's and the reference's log-probs set to other values,
    # and the policy's own (those the gradient flows through) changed too.
    other = lambda values: torch.where(environment, values - 3.0, values)  # noqa: E731
    changed = replace(experience, old_logprobs=other(experience.old_logprobs),
                      reference_logprobs=other(experience.reference_logprobs),
                      rollout=replace(experience.rollout, sampler_logprobs=other(experience.rollout.sampler_logprobs)))
    newline, n = (trainer.run.tokenizer(text, add_special_tokens=False)["input_ids"][0] for text in ("\n", "n"))
    only_environment = _gradient(trainer, changed, monkeypatch,
                                 lambda targets: (targets == newline) | (targets == n))  # only "\nno\n" has these
    assert all(torch.equal(a, b) for a, b in zip(base, only_environment))
    # The same change on one of the model's own tokens (its EOS) does change the gradient: the check can fail.
    eos = trainer.run.tokenizer.eos_token_id
    on_model = _gradient(trainer, experience, monkeypatch, lambda targets: targets == eos)
    assert max(float((a - b).abs().max()) for a, b in zip(base, on_model)) > 1e-6


def test_the_trained_ids_are_the_sampled_ids_and_the_trainer_s_log_probs_are_the_sampler_s(tiny_model_dir, sums_jsonl,
                                                                                           tmp_path, game):
    trainer = _trainer(tiny_model_dir, sums_jsonl, tmp_path, prompts_per_step=2, temperature=1.0)
    calls = []
    drawing = trainer.drawing.sampler.generate_ids

    def recorded(prompt_ids, seeds, settings):
        completions, logprobs = drawing(prompt_ids, seeds, settings)
        calls.extend(zip(prompt_ids, completions, logprobs))
        return completions, logprobs

    trainer.drawing.sampler.generate_ids = recorded
    rollout = trainer.sample(1)
    P = rollout.prompt_length
    rows = [(rollout.sequences[i][rollout.prompt_mask[i].bool().tolist() + rollout.completion_mask[i].bool().tolist()]
             .tolist(), rollout.loss_mask[i], rollout.sampler_logprobs[i]) for i in range(8)]
    covered = [torch.zeros_like(rollout.loss_mask[i]) for i in range(8)]
    for prompt_ids, completion, logprobs in calls:
        # Every draw sits in some trained row exactly where it was drawn, after exactly the ids it was drawn from.
        found = [i for i, (ids, _, _) in enumerate(rows) if ids[: len(prompt_ids)] == list(prompt_ids)
                 and ids[len(prompt_ids): len(prompt_ids) + len(completion)] == list(completion)[: len(ids) - len(prompt_ids)]]
        assert found, (prompt_ids, completion)
        i = found[0]
        start = len(prompt_ids) - int(rollout.prompt_mask[i].sum())
        kept = min(len(completion), len(rows[i][0]) - len(prompt_ids))
        assert rows[i][1][start: start + kept].tolist() == [1] * kept
        assert torch.allclose(rows[i][2][start: start + kept], torch.tensor(logprobs[:kept]))
        covered[i][start: start + kept] = 1
    assert all(torch.equal(covered[i], rollout.loss_mask[i]) for i in range(8))  # and nothing else is the model's
    assert (rollout.completion_mask - rollout.loss_mask).sum() > 0  # the environment spoke
    # The trainer's forward over the trained rows gives the sampler's log-probs on the model's tokens (fp32).
    from auto_research.engine.logprobs import token_logprobs

    with torch.no_grad():
        trainer_logprobs = token_logprobs(trainer.models.policy, rollout.sequences, rollout.prompt_mask,
                                          rollout.completion_mask)
    owned = rollout.loss_mask.bool()
    assert (trainer_logprobs - rollout.sampler_logprobs)[owned].abs().max() < 1e-5
    assert P == rollout.prompt_mask.shape[1]


VLLM_RUN = """
import json, sys
import torch
from auto_research.data.types import Example
from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.rollout.builtin import BuiltinSampler
from auto_research.engine.rollout.vllm import VLLMSampler
from auto_research.engine.tiny import build_model, build_tokenizer
from auto_research.envs import EnvironmentFactory
from auto_research.envs.rollout import EpisodeRunner

tokenizer = build_tokenizer()
model = build_model(tokenizer, seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64).eval()
with torch.no_grad():
    model.lm_head.weight.mul_(5.0)  # sharper than the random init: argmax margins well above fp32 noise
settings = SamplingSettings(4, 1.0, 1.0, 1)
samplers = {"builtin": BuiltinSampler(model, tokenizer, settings),
            "vllm": VLLMSampler(model, tokenizer, settings, 0.02, torch.float32, 64, seed=0)}
factory = EnvironmentFactory.load("sums_game:make_env", {"answer": "7"})
examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in ((3, 4), (1, 1), (5, 2))]
runs = {}
for name, sampler in samplers.items():
    runner = EpisodeRunner(sampler.generate_ids, tokenizer, factory, {}, settings, 3, 16,
                           (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    runs[name] = [dict(prompt_ids=t.prompt_ids, ids=t.ids, loss_mask=t.loss_mask, logprobs=t.logprobs, turns=t.turns,
                       truncated=t.truncated, reward=t.reward) for t in runner.trajectories(examples, 2, [5, 6, 7])]
print(json.dumps(runs))
"""


def test_the_builtin_sampler_and_vllm_build_the_same_trajectories(game):
    """With top-k 1 both draw the argmax: the same trajectories token for token, with the same masks. (In a
    process of its own: vLLM keeps one engine per process, and test_vllm.py's holds it there.)"""
    pytest.importorskip("vllm")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(game), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", VLLM_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs["builtin"]) == len(runs["vllm"]) == 6
    for ours, theirs in zip(runs["builtin"], runs["vllm"]):
        for key in ("prompt_ids", "ids", "loss_mask", "turns", "truncated", "reward"):
            assert ours[key] == theirs[key], key
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-4)  # top-k 1: log 1 = 0, every token
    assert sum(t["turns"] for t in runs["builtin"]) > 6  # some went on after the environment answered
    assert any(0 in t["loss_mask"] for t in runs["builtin"])


def test_an_environment_given_from_python_gives_colocated_vllm_room_for_a_whole_trajectory(sums_jsonl, tmp_path, game,
                                                                                           monkeypatch):
    """A factory passed from Python (``--environment`` unset) still makes a multi-turn run: the colocated engine's
    context holds the longest prompt, a trajectory's --max-trajectory-tokens and one more turn's draw (20 + 3), not
    one completion's 3 tokens, as without an environment."""
    pytest.importorskip("vllm")
    from auto_research.engine.rollout import vllm as vllm_module
    from auto_research.engine.tiny import build_model, build_tokenizer

    model_dir = tmp_path / "model"  # head size 32: a model vLLM's CPU attention serves
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    built = {}

    class Recorder:
        def __init__(self, policy, tokenizer, settings, memory, dtype, max_model_len, seed, verbose=False):
            built["max_model_len"] = max_model_len
            raise KeyboardInterrupt  # stop before any engine starts

    monkeypatch.setattr(vllm_module, "VLLMSampler", Recorder)
    lengths = []
    for environment in (True, False):
        with pytest.raises(KeyboardInterrupt):
            if environment:
                _trainer(model_dir, sums_jsonl, tmp_path / "env", sampler="vllm")
            else:  # the same settings, one completion a sample
                Trainer.build(GenerationConfig(model=str(model_dir), dataset=str(sums_jsonl),
                                               output_dir=tmp_path / "plain", steps=4, prompts_per_step=1,
                                               group_size=4, max_new_tokens=3, max_turns=3, max_trajectory_tokens=20,
                                               evaluation_examples=4, progress=False, offline=True, seed=3,
                                               device="cpu", sampler="vllm").filled().validate(),
                              log=lambda text: None)
        lengths.append(built.pop("max_model_len"))
    with_environment, without = lengths
    assert with_environment - without == (20 + 3) - 3  # the same longest prompt on both


def _cli(model, data, output, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "4", "--prompts-per-step", "2",
            "--group-size", "4", "--max-new-tokens", "3", "--max-turns", "3", "--learning-rate", "1e-2",
            "--evaluation-examples", "4", "--eval-every", "2", "--temperature", "1.0", "--offline", "--device", "cpu",
            "--no-progress", "--threads", "1", "--environment", "sums_game:make_env", "--output-dir", str(output),
            *extra]


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time_") and k not in
             ("tokens_per_second", "step_seconds")} for row in rows]


def test_a_resumed_run_with_an_environment_and_a_batch_in_flight_ends_exactly_as_a_whole_one(tiny_model_dir, sums_jsonl,
                                                                                          tmp_path, game):
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(game), os.environ.get("PYTHONPATH")]))}
    common = ("--checkpoint-every", "2", "--max-staleness", "1", "--rollout-correction", "none", "--beta", "0.05",
              "--reward", "sums_game:checksum")
    whole = run_cli(*_cli(tiny_model_dir, sums_jsonl, tmp_path / "whole", *common), env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "whole" / "rloo-sums-seed42"
    rows = _rows(run_dir)
    assert [sorted(k for k in row if k in ("turns_mean", "tool_calls_mean", "tool_errors", "truncated_fraction"))
            for row in rows] == [["tool_calls_mean", "tool_errors", "truncated_fraction", "turns_mean"]] * 4
    assert all(1.0 <= row["turns_mean"] <= 3.0 and row["tool_calls_mean"] == 0.0 for row in rows)
    # The same run, stopped after its step-2 checkpoint (which holds step 3's batch, drawn in flight).
    stopped = tmp_path / "stopped" / "rloo-sums-seed42"
    shutil.copytree(run_dir, stopped)
    checkpoint = stopped / "checkpoints" / "step-000002"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert [batch["step"] for batch in state["in_flight"][0]] == [3]
    assert state["in_flight"][0][0]["episodes"][0].keys() >= {"turns", "truncated", "reply"}
    shutil.rmtree(stopped / "checkpoints" / "step-000004")
    resumed = run_cli(*_cli(tiny_model_dir, sums_jsonl, tmp_path / "stopped", *common), "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = lambda folder: load_file(str(folder / "checkpoints" / "step-000004" / "model.safetensors"))  # noqa: E731
    expected, got = final(run_dir), final(stopped)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((expected[name] - start[name]).abs().max()) for name in start) > 1e-4  # it trained
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert _rows(stopped) == rows


def test_bad_environments_and_tools_are_one_line_and_exit_2_before_any_work(tiny_model_dir, sums_jsonl, tmp_path,
                                                                            game, capsys):
    from auto_research.cli import main

    def error(*flags) -> str:
        args = [a for a in _cli(tiny_model_dir, sums_jsonl, tmp_path / "out") if a not in
                ("--environment", "sums_game:make_env")]
        assert main(args + list(flags)) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("auto-research: error: "), lines
        return lines[0][len("auto-research: error: "):]

    assert error("--environment", "no_such_module_xyz:make_env") == (
        "--environment 'no_such_module_xyz:make_env': cannot import module 'no_such_module_xyz' (no "
        f"no_such_module_xyz.py in the working folder {os.getcwd()} or on the import path)")
    assert error("--environment", "sums_game:make_nothing") == (
        "--environment 'sums_game:make_nothing': sums_game has no 'make_nothing'")
    assert error("--environment", "sums_game:make_nostep") == (
        "--environment sums_game:make_nostep: the object it returns has no reset/step methods (an environment has "
        "reset() and step(text); got NoStep)")
    assert error("--tools", "sums_game:unhinted") == (
        "--tools: tool 'unhinted' cannot be described to the model: Argument a is missing a type hint in function "
        "unhinted")
    assert error("--tools", "sums_game:add") == (
        f"--tools: {tiny_model_dir}'s tokenizer has no chat template, so the model cannot be shown tools")
    assert error("--environment", "sums_game:make_env", "--max-turns", "0") == "--max-turns must be >= 1, got 0"
    assert error("--environment", "sums_game:make_env", "--algorithm", "remax") == (
        "--environment/--tools with remax is not built (its greedy baseline is one single-turn completion)")
    assert not list((tmp_path / "out").glob("*/metrics.jsonl"))  # nothing was trained or written


CHATML_WITH_TOOLS = (
    "{%- if tools %}tools:{%- for tool in tools %} {{ tool.function.name }}{%- endfor %} <tool_call>\n{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}</s>\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}")


def test_tools_in_training_answer_calls_and_the_task_s_verifier_scores_the_final_reply(tiny_model_dir, sums_jsonl,
                                                                                       tmp_path, game):
    """--tools alone (from Python): a call is answered as a tool message (masked), a reply without a call ends the
    trajectory, and the task's verifier (match) scores the final reply."""
    from sums_game import add

    model = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": CHATML_WITH_TOOLS}))
    config = GenerationConfig(model=str(model), dataset=str(sums_jsonl), output_dir=tmp_path, steps=2,
                              prompts_per_step=1, group_size=2, max_new_tokens=3, max_turns=3,
                              max_trajectory_tokens=200, evaluation_examples=4, progress=False, offline=True, seed=3,
                              device="cpu").filled().validate()
    trainer = Trainer.build(config, log=lambda text: None, tools=[add])
    source = trainer.source()
    batch = draw_batch(source, copy.deepcopy(trainer.state.rng), 1)
    [seed], [example] = batch.seeds, batch.examples
    a, b = (int(x) for x in example.prompt.rstrip("=").split("+"))
    call = '<tool_call>{"name": "add", "arguments": {"a": %d, "b": %d}}</tool_call>' % (a, b)
    # Trajectory 0 calls the tool, then answers with its result; trajectory 1 answers "x" at once.
    replies = {turn_seed(turn_seed(seed, 0, 0), 0, 0): call, turn_seed(turn_seed(seed, 0, 0), 0, 1): str(a + b),
               turn_seed(turn_seed(seed, 1, 0), 0, 0): "x"}
    eos = trainer.run.tokenizer.eos_token_id

    def generate(prompt_ids, seeds, settings):
        tokens = [trainer.run.tokenizer(replies[s], add_special_tokens=False)["input_ids"] + [eos] for s in seeds]
        return tokens, [[-0.5] * len(ids) for ids in tokens]

    trainer.drawing.sampler.generate_ids = generate
    drawn = produce(trainer.source(), trainer.state.rng, 1, 0)
    assert drawn.rewards == [1.0, 0.0]  # match on the final reply
    assert [(row["turns"], row["tool_calls"], row["tool_errors"]) for row in drawn.rollout.episodes] == [(2, 1, 0),
                                                                                                       (1, 0, 0)]
    ids = lambda text: trainer.run.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    answer = ids(call) + [eos] + ids(f"\ntool: {a + b}</s>\nassistant: ") + ids(str(a + b)) + [eos]
    row = drawn.rollout.completion_ids[0][drawn.rollout.completion_mask[0].bool()].tolist()
    assert row == answer
    assert drawn.rollout.loss_mask[0][: len(row)].tolist() == ([1] * (len(ids(call)) + 1)
                                                             + [0] * len(ids(f"\ntool: {a + b}</s>\nassistant: "))
                                                             + [1] * (len(ids(str(a + b))) + 1))
    assert "tool: " + str(a + b) in drawn.rollout.completions[0]  # the table shows the whole conversation


# --- limits: timeouts and failures, from the command line ------------------------------------------------------

LIMITS = '''
import itertools, pathlib, time

HERE = pathlib.Path(__file__).parent
_resets = itertools.count()


class Sometimes:
    """Every other reset() (counted over the process) hangs past any timeout; the others play one turn."""
    def reset(self):
        if next(_resets) % 2:
            time.sleep(600)  # abandoned: the process ends without waiting for it
        return None
    def step(self, text):
        return None, float(len(text) % 3), True

def make_sometimes(row):
    return Sometimes()


class HangsWhenFlagged:
    """step() hangs once the file "hang" exists beside this module, after writing "hanging" there."""
    def reset(self):
        return None
    def step(self, text):
        if (HERE / "hang").exists():
            (HERE / "hanging").write_text("")
            time.sleep(600)
        return "more", float(len(text) % 3), False

def make_flagged(row):
    return HangsWhenFlagged()


class Broken:
    def __init__(self, how):
        self.how = how
    def reset(self):
        if self.how == "reset":
            raise ConnectionError("the simulator is down")
        return None
    def step(self, text):
        return {"four": (None, 1.0, True, {}), "lots": (None, "lots", True)}[self.how]

def make_reset(row):
    return Broken("reset")

def make_four(row):
    return Broken("four")

def make_lots(row):
    return Broken("lots")

def make_first_row(row):
    return Broken(row["no_such_field"])
'''


@pytest.fixture
def limits(tmp_path):
    """LIMITS as the file limits_envs.py in a folder of its own (given to the runs by path)."""
    folder = tmp_path / "limits"
    folder.mkdir()
    (folder / "limits_envs.py").write_text(LIMITS)
    return folder


def _with(environment: str, args: list[str]) -> list[str]:
    """``_cli``'s arguments with another --environment."""
    return [environment if a == "sums_game:make_env" else a for a in args]


def test_an_environment_that_hangs_past_the_env_timeout_fails_those_samples_and_the_run_goes_on(tiny_model_dir,
                                                                                               sums_jsonl, tmp_path,
                                                                                               limits):
    args = _with(f"{limits}/limits_envs.py:make_sometimes",
                 _cli(tiny_model_dir, sums_jsonl, tmp_path / "out", "--steps", "2", "--eval-every", "0",
                      "--evaluation-examples", "2", "--env-timeout", "1"))
    done = run_cli(*args, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(tmp_path / "out" / "rloo-sums-seed42")
    # Each step resets 2 prompts × K 4 = 8 environments, every other one hangs: 4 of its 8 samples time out.
    assert [(row["env_timeouts"], row["tool_timeouts"], row["environment_errors"], row["unscored_samples"])
            for row in rows] == [(4, 0, 4, 4)] * 2


def test_a_sigterm_while_the_environment_hangs_stops_the_run_at_the_timeout_keeping_its_checkpoint(tiny_model_dir,
                                                                                                  sums_jsonl, tmp_path,
                                                                                                  limits):
    import signal
    import time

    args = _with(f"{limits}/limits_envs.py:make_flagged",
                 _cli(tiny_model_dir, sums_jsonl, tmp_path / "out", "--steps", "200", "--checkpoint-every", "1",
                      "--eval-every", "0", "--env-timeout", "1"))
    process = subprocess.Popen([sys.executable, "-m", "auto_research", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoints = tmp_path / "out" / "rloo-sums-seed42" / "checkpoints"
    try:
        deadline = time.time() + 240
        # Any checkpoint: with two kept, step 1's is gone by step 3, which a fast run reaches between two looks.
        while time.time() < deadline and not any(checkpoints.glob("step-*")) and process.poll() is None:
            time.sleep(0.05)
        (limits / "hang").write_text("")
        while time.time() < deadline and not (limits / "hanging").exists() and process.poll() is None:
            time.sleep(0.05)
        assert (limits / "hanging").exists(), "the environment never hung"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("auto-research: error: the run was asked to stop while step() ran, and it ran past "
                           "--env-timeout 1 s: this step is given up; saved the last good step ("), last
    assert "Traceback" not in stderr
    saved = sorted(path.name for path in checkpoints.iterdir() if path.name.startswith("step-"))
    assert saved and all((checkpoints / name / "trainer_state.json").is_file() for name in saved)


def test_when_the_environment_fails_every_sample_the_one_line_names_its_own_error(tiny_model_dir, sums_jsonl,
                                                                                  tmp_path, limits, capsys):
    from auto_research.cli import main

    def error(spec: str) -> str:
        assert main(_with(spec, _cli(tiny_model_dir, sums_jsonl, tmp_path / "out", "--eval-every", "0"))) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert not any("Traceback" in line for line in lines)
        return lines[-1][len("auto-research: error: "):]

    envs = f"{limits}/limits_envs.py"
    assert error(f"{envs}:make_reset") == (
        "no sample of step 1 could be scored: the environment failed on 8 of 8 samples (the first: ConnectionError: "
        "the simulator is down); nothing was written")
    assert error(f"{envs}:make_four") == (
        "no sample of step 1 could be scored: the environment failed on 8 of 8 samples (the first: TypeError: step() "
        "must return (observation, reward, done), got (None, 1.0, True, {})); nothing was written")
    assert error(f"{envs}:make_lots") == (
        "no sample of step 1 could be scored: the environment failed on 8 of 8 samples (the first: ValueError: "
        "step()'s reward is 'lots', not a finite number (or None)); nothing was written")
    # A factory that raises on the first training row, or whose module raises when imported: before any work.
    assert error(f"{envs}:make_first_row") == (
        f"--environment {envs}:make_first_row: making the environment for the first training row raised KeyError: "
        "'no_such_field'")
    (limits / "raises_on_import.py").write_text("raise OSError('no licence for the simulator')\n")
    assert error(f"{limits}/raises_on_import.py:make") == (
        f"--environment '{limits}/raises_on_import.py:make': importing {limits}/raises_on_import.py failed "
        "(OSError: no licence for the simulator)")
    assert not list((tmp_path / "out").glob("*/metrics.jsonl"))  # nothing was trained or written
