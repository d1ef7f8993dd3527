"""--rollout-function (the escape hatch for a user's own loop): the trained rows are exactly the ids, masks and
log-probs the function returned, the rewards and advantages are the hand-computed ones, the reward functions add
only when given, a run from the command line trains and resumes exactly with a batch in flight, and bad input
(at the start or returned at a step) is one line and exit 2."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from auto_research.config.generation import GenerationConfig
from auto_research.data.types import Example
from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.tiny import build_tokenizer
from auto_research.envs.custom import FunctionRunner
from auto_research.envs.trajectory import turn_seed
from auto_research.errors import RewardError, UserError
from auto_research.train.experience import build_experience
from auto_research.train.rollouts import agreed_scores, draw_batch, produce
from auto_research.train.trainer import Trainer
from auto_research.train.update import estimate_advantages

LOOPS = '''
from auto_research.envs.trajectory import turn_seed

SAID = "\\nok\\n"


def two_turns(rows, context):
    """Two draws from the run's sampler, the loop's own "environment" saying ok (mask 0) between them; the reward
    counts a turn that says the answer +1 and one that says "x" -0.5, and a "?" leaves the row unscored."""
    tokenizer = context.tokenizer
    said = tokenizer(SAID, add_special_tokens=False)["input_ids"]
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    first, first_logprobs = context.generate(prompts, list(context.seeds))
    second, second_logprobs = context.generate([p + a + said for p, a in zip(prompts, first)],
                                               [turn_seed(seed, 0, 1) for seed in context.seeds])
    returned = []
    for row, prompt, a, la, b, lb in zip(rows, prompts, first, first_logprobs, second, second_logprobs):
        ids = (a + said + b)[: context.max_tokens]
        mask = ([1] * len(a) + [0] * len(said) + [1] * len(b))[: len(ids)]
        logprobs = (la + [float("nan")] * len(said) + lb)[: len(ids)]  # nan where the mask is 0: ignored
        replies = [tokenizer.decode(part, skip_special_tokens=True).strip() for part in (a, b)]
        reward = None if "?" in replies else sum(1.0 if r == row["answer"] else -0.5 if r == "x" else 0.0
                                                  for r in replies)
        returned.append({"prompt_ids": prompt, "completion_ids": ids, "logprobs": logprobs, "loss_mask": mask,
                         "reward": reward, "turns": 2, "truncated": len(ids) < len(a) + len(said) + len(b)})
    return returned


def bad_mask(rows, context):
    """Well formed in the held-out evaluation (group size 1), a mask value of 2 when training."""
    returned = two_turns(rows, context)
    if context.group_size > 1:
        returned[1]["loss_mask"][0] = 2
    return returned


def raises(rows, context):
    raise RuntimeError("boom")


def checksum(prompts, completions, rows):
    # Differs between almost any two texts: every group carries a learning signal.
    return [float(sum(map(ord, c)) % 5) for c in completions]


NOT_A_FUNCTION = 3


def make_env(row):
    return None
'''


@pytest.fixture
def loops(tmp_path):
    (tmp_path / "my_loops.py").write_text(textwrap.dedent(LOOPS))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path / "my_loops.py"
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_loops", None)


def _trainer(model_dir, data, output, reward_functions=(), **overrides) -> Trainer:
    from my_loops import two_turns

    settings = dict(model=str(model_dir), dataset=str(data), output_dir=output, steps=2, prompts_per_step=1,
                    group_size=4, max_new_tokens=3, max_trajectory_tokens=12, learning_rate=1e-3,
                    evaluation_examples=4, temperature=1.0, progress=False, offline=True, seed=3, device="cpu",
                    beta=0.0)
    settings.update(overrides)
    return Trainer.build(GenerationConfig(**settings).filled().validate(), log=lambda text: None,
                         reward_functions=reward_functions, rollout_function=two_turns)


# Trajectory k's two replies; the function's rewards by hand: k0 answer, answer → 2.0; k1 answer, "x" → 0.5;
# k2 "x", "y" → −0.5; k3 "?", answer → None (unscored, out of the baseline).
SCRIPT = [lambda answer: [answer, answer], lambda answer: [answer, "x"], lambda answer: ["x", "y"],
          lambda answer: ["?", answer]]


def _scripted(trainer: Trainer):
    """Step 1's batch through the run's rollout side, the sampler's draws taken from SCRIPT (each reply ends in
    EOS, log-prob −0.5 a token) and the function's calls recorded: (drawn, example, [(rows, context, returned)])."""
    calls = []
    source = trainer.source()
    [seed], [example] = (lambda batch: (batch.seeds, batch.examples))(
        draw_batch(source, copy.deepcopy(trainer.state.rng), 1))
    # Turn 0 draws from the row's seed, turn 1 from turn_seed(that seed, 0, 1) (my_loops.two_turns).
    which = {**{turn_seed(seed, k, 0): (k, 0) for k in range(4)},
             **{turn_seed(turn_seed(seed, k, 0), 0, 1): (k, 1) for k in range(4)}}
    eos = trainer.run.tokenizer.eos_token_id

    def generate(prompt_ids, seeds, settings):
        replies = [SCRIPT[which[s][0]](example.answer)[which[s][1]] for s in seeds]
        tokens = [trainer.run.tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos] for reply in replies]
        return tokens, [[-0.5] * len(ids) for ids in tokens]

    function = trainer.drawing.episodes.function

    def recorded(rows, context):
        returned = function(rows, context)
        calls.append((rows, context, copy.deepcopy(returned)))
        return returned

    trainer.drawing.sampler.generate_ids = generate
    object.__setattr__(trainer.drawing.episodes, "function", recorded)  # (a frozen runner: the test's own patch)
    drawn = produce(trainer.source(), trainer.state.rng, 1, 0)
    return drawn, example, calls, seed


def test_the_trained_rows_are_what_the_function_returned_with_the_hand_computed_rewards_and_advantages(
        tiny_model_dir, sums_jsonl, tmp_path, loops):
    trainer = _trainer(tiny_model_dir, sums_jsonl, tmp_path)
    drawn, example, calls, seed = _scripted(trainer)
    [(rows, context, returned)] = calls
    assert rows == [{"prompt": example.prompt, "answer": example.answer}] * 4
    assert context.group_size == 4 and context.max_tokens == 12
    assert context.seeds == tuple(turn_seed(seed, k, 0) for k in range(4))
    assert context.settings == SamplingSettings(3, 1.0, 1.0, 0)
    rollout, tokenizer = drawn.rollout, trainer.run.tokenizer
    for i, item in enumerate(returned):
        prompt = rollout.sequences[i, : rollout.prompt_length][rollout.prompt_mask[i].bool()].tolist()
        span = rollout.completion_mask[i].bool()
        assert prompt == item["prompt_ids"] == tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        assert rollout.completion_ids[i][span].tolist() == item["completion_ids"]
        assert rollout.loss_mask[i][span].tolist() == item["loss_mask"]
        owned = torch.tensor(item["loss_mask"], dtype=torch.bool)
        logprobs = rollout.sampler_logprobs[i][span]
        assert logprobs[owned].tolist() == [-0.5] * int(owned.sum()) and logprobs[~owned].tolist() == [0.0] * 4
        assert rollout.completions[i] == tokenizer.decode(item["completion_ids"], skip_special_tokens=True)
    # Row 1: the answer and EOS (the model's), "\nok\n" (the loop's), "x" and EOS (the model's).
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    assert returned[1]["completion_ids"] == ids(example.answer) + [eos] + ids("\nok\n") + ids("x") + [eos]
    assert [(row["turns"], row["tool_calls"], row["failed"]) for row in rollout.episodes] == [(2, 0, None)] * 4
    assert drawn.rewards[:3] == [2.0, 0.5, -0.5] and drawn.rewards[3] is None  # the verifier adds nothing
    run = trainer.run
    scores = agreed_scores(run.world, drawn, 1, 4)
    advantages = estimate_advantages(run, build_experience(run, trainer.models, rollout, scores, 0)).advantages
    # Leave-one-out over the three scored: 2 − (0.5 − 0.5)/2, 0.5 − (2 − 0.5)/2, −0.5 − (2 + 0.5)/2; 0 unscored.
    by_hand = torch.tensor([2.0, -0.25, -1.75, 0.0])
    owned = rollout.loss_mask.bool()
    for index in range(4):
        assert torch.allclose(advantages[index][owned[index]], by_hand[index].expand(int(owned[index].sum())))
    assert float(advantages[~owned].abs().max()) == 0.0  # the loop's own tokens carry nothing


def test_reward_functions_given_explicitly_add_to_the_function_s_reward_on_its_text(tiny_model_dir, sums_jsonl,
                                                                                     tmp_path, loops):
    def length(prompts, completions, rows):
        return [float(len(text)) for text in completions]

    trainer = _trainer(tiny_model_dir, sums_jsonl, tmp_path, reward_functions=[("length", length)])
    drawn, example, _, _ = _scripted(trainer)
    n = len(example.answer)  # each text: reply, "\nok\n", reply (EOS removed)
    # Row 3's function left it unscored: the reward function's value alone counts, as with an environment.
    assert drawn.rewards == [2.0 + 2 * n + 4, 0.5 + n + 5, -0.5 + 6, n + 5]


def _cli(model, data, output, *extra):
    return ["post-train", "--model", str(model), "--dataset", str(data), "--steps", "3", "--prompts-per-step", "1",
            "--group-size", "2", "--max-new-tokens", "2", "--max-trajectory-tokens", "8", "--learning-rate", "1e-2",
            "--evaluation-examples", "2", "--eval-every", "3", "--temperature", "1.0", "--offline", "--device",
            "cpu", "--no-progress", "--threads", "1", "--output-dir", str(output), *extra]


def _rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time_") and k not in
             ("tokens_per_second", "step_seconds")} for row in rows]


def test_a_run_from_the_command_line_trains_and_resumes_exactly_with_a_batch_in_flight(tiny_model_dir, sums_jsonl,
                                                                                       tmp_path, loops, capsys):
    from auto_research.cli import main

    common = ("--rollout-function", f"{loops}:two_turns", "--reward", "my_loops:checksum", "--checkpoint-every", "2",
              "--max-staleness", "1", "--rollout-correction", "none")
    assert main(_cli(tiny_model_dir, sums_jsonl, tmp_path / "whole", *common)) == 0, capsys.readouterr().err
    run_dir = tmp_path / "whole" / "rloo-sums-seed42"
    rows = _rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["turns_mean"] == 2.0 and row["tool_calls_mean"] == 0.0 for row in rows)
    assert json.loads((run_dir / "metrics.json").read_text())["final"]["turns_mean"] == 2.0
    # The same run stopped after its step-2 checkpoint, which holds step 3's batch (drawn in flight).
    stopped = tmp_path / "stopped" / "rloo-sums-seed42"
    shutil.copytree(run_dir, stopped)
    state = json.loads((stopped / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert [batch["step"] for batch in state["in_flight"][0]] == [3]
    shutil.rmtree(stopped / "checkpoints" / "step-000003")
    assert main(_cli(tiny_model_dir, sums_jsonl, tmp_path / "stopped", *common, "--resume")) == 0
    final = lambda folder: load_file(str(folder / "checkpoints" / "step-000003" / "model.safetensors"))  # noqa: E731
    expected, got = final(run_dir), final(stopped)
    start = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((expected[name] - start[name]).abs().max()) for name in start) > 1e-4  # it trained
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert _rows(stopped) == rows


def test_bad_rollout_functions_are_one_line_and_exit_2(tiny_model_dir, sums_jsonl, tmp_path, loops, capsys):
    from auto_research.cli import main

    def error(*flags) -> str:
        assert main(_cli(tiny_model_dir, sums_jsonl, tmp_path / "out", *flags)) == 2
        lines = capsys.readouterr().err.strip().splitlines()  # the run's progress lines, then the error alone
        assert lines[-1].startswith("auto-research: error: ") and not any("Traceback" in line for line in lines), lines
        return lines[-1][len("auto-research: error: "):]

    assert error("--rollout-function", "no_such_module_xyz:fn") == (
        "--rollout-function 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz' (no "
        f"no_such_module_xyz.py in the working folder {os.getcwd()} or on the import path)")
    assert error("--rollout-function", f"{loops}:missing") == (
        f"--rollout-function '{loops}:missing': {loops} has no 'missing'")
    assert error("--rollout-function", "my_loops:NOT_A_FUNCTION") == (
        "--rollout-function 'my_loops:NOT_A_FUNCTION': NOT_A_FUNCTION is int, not callable (a function: "
        "fn(rows, context) -> a list of dicts)")
    assert error("--rollout-function", "my_loops:two_turns", "--environment", "my_loops:make_env") == (
        "--rollout-function runs its own loop: give it without --environment and --tools")
    assert error("--rollout-function", "my_loops:two_turns", "--algorithm", "remax") == (
        "--rollout-function with remax is not built (its greedy baseline is one single-turn completion)")
    assert not (tmp_path / "out").exists()  # refused before any work
    assert error("--rollout-function", "my_loops:raises") == (
        "--rollout-function my_loops:raises raised RuntimeError: boom (evaluation before training)")
    assert error("--rollout-function", "my_loops:bad_mask") == (
        "--rollout-function my_loops:bad_mask: row 1: 'loss_mask' holds 2 at position 0 (1 on the model's own "
        "tokens, 0 on the others); nothing was written")
    assert not list((tmp_path / "out").glob("*/metrics.jsonl"))
    with pytest.raises(UserError, match="^--rollout-function runs its own loop"):  # from Python, the same rule
        from my_loops import make_env, two_turns

        Trainer.build(GenerationConfig(model=str(tiny_model_dir), dataset=str(sums_jsonl), output_dir=tmp_path,
                                       offline=True, device="cpu"), environment=make_env, rollout_function=two_turns)


def _runner(returned) -> FunctionRunner:
    """A runner over the tiny tokenizer (260 ids, a context of 16) whose function returns ``returned(rows)``."""
    tokenizer = build_tokenizer()
    return FunctionRunner(lambda ids, seeds, settings: ([], []), tokenizer, lambda rows, context: returned(rows),
                          "my_loops:fn", SamplingSettings(4), 8, len(tokenizer), 16)


def _good(rows) -> list[dict]:
    return [{"prompt_ids": [10, 11], "completion_ids": [12, 13, 14], "logprobs": [-0.1, float("nan"), -0.3],
             "loss_mask": [1, 0, 1], "reward": 1.0} for _ in rows]


def _changed(row: int = 1, drop: str | None = None, **changes):
    """The well-formed return with row ``row``'s keys changed (or ``drop`` removed)."""
    def returned(rows):
        items = _good(rows)
        items[row] = {key: value for key, value in {**items[row], **changes}.items() if key != drop}
        return items
    return returned


FUNCTION = "--rollout-function my_loops:fn"


@pytest.mark.parametrize("returned, message", [
    (lambda rows: _good(rows)[:-1], f"{FUNCTION} returned 3 items for 4 rows (one dict per row, in the rows' order)"),
    (lambda rows: None, f"{FUNCTION} returned NoneType for 4 rows (one dict per row, in the rows' order)"),
    (lambda rows: [None] * 4, f"{FUNCTION}: row 0 is NoneType, not a dict"),
    (_changed(drop="reward"), f"{FUNCTION}: row 1 has no 'reward' (each row has prompt_ids, completion_ids, "
                              "logprobs, loss_mask, reward)"),
    (_changed(logprobs=[-0.1, -0.2]), f"{FUNCTION}: row 1: 'logprobs' has 2 values for 3 'completion_ids'"),
    (_changed(loss_mask=[1, 1]), f"{FUNCTION}: row 1: 'loss_mask' has 2 values for 3 'completion_ids'"),
    (_changed(loss_mask=[1, 0.5, 1]), f"{FUNCTION}: row 1: 'loss_mask' holds 0.5 at position 1 (1 on the model's "
                                      "own tokens, 0 on the others)"),
    (_changed(completion_ids=[12, 260, 14]), f"{FUNCTION}: row 1: 'completion_ids' holds 260 at position 1, not a "
                                             "token id of the model (0 … 259)"),
    (_changed(row=0, prompt_ids=[-1]), f"{FUNCTION}: row 0: 'prompt_ids' holds -1 at position 0, not a token id of "
                                       "the model (0 … 259)"),
    (_changed(prompt_ids=[]), f"{FUNCTION}: row 1: 'prompt_ids' is empty"),
    (_changed(logprobs=[-0.1, 0.0, math.inf]), f"{FUNCTION}: row 1: 'logprobs' is inf at position 2, not a finite "
                                               "number"),
    (_changed(reward=math.nan), f"{FUNCTION}: row 1: 'reward' is nan, not a finite number"),
    (_changed(logprobs=[-0.1, 0.0, 50.0]), f"{FUNCTION}: row 1: 'logprobs' is 50 at position 2 (token 14), above 0: a "
                                           "log-probability is at most 0 (give the sampler's log-probs of the tokens "
                                           "it drew, as context.generate returns them)"),
    (_changed(completion_ids=list(range(12, 21)), logprobs=[0.0] * 9, loss_mask=[1] * 9),
     f"{FUNCTION}: row 1: 'completion_ids' holds 9 tokens, more than context.max_tokens 8 (--max-trajectory-tokens)"),
    (_changed(prompt_ids=list(range(10, 24))), f"{FUNCTION}: row 1: 'prompt_ids' and 'completion_ids' hold 17 "
                                               "tokens, more than the model's context of 16"),
])
def test_a_malformed_return_names_the_row_and_the_key(returned, message):
    examples = [Example("1+1=", "2"), Example("2+2=", "4")]
    with pytest.raises(RewardError) as raised:
        _runner(returned).sample(examples, 2, [5, 6])
    assert str(raised.value) == message


def test_a_log_prob_above_zero_by_rounding_is_taken():
    rollout = _runner(_changed(logprobs=[5e-5, 0.0, 0.0])).sample([Example("1+1=", "2")], 2, [5])
    assert rollout.sampler_logprobs[1, 0].item() == pytest.approx(5e-5)


def test_a_well_formed_return_ignores_log_probs_off_the_mask_and_takes_tensors():
    rollout = _runner(lambda rows: [{**item, "completion_ids": torch.tensor(item["completion_ids"]), "reward": None,
                                     "truncated": True, "text": "shown"} for item in _good(rows)]).sample(
        [Example("1+1=", "2")], 2, [5])
    assert rollout.sampler_logprobs.tolist() == [[pytest.approx(-0.1), 0.0, pytest.approx(-0.3)]] * 2
    assert rollout.loss_mask.tolist() == [[1, 0, 1]] * 2 and rollout.completions == ["shown", "shown"]
    assert [(row["truncated"], row["environment_reward"], row["reply"]) for row in rollout.episodes] == [
        (True, None, "shown")] * 2


LIES = """
def certain(rows, context):
    \"\"\"The sampler's tokens reported as if each had probability 1 (log-prob 0): a policy it is not.\"\"\"
    prompts = [context.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    ids, _ = context.generate(prompts, list(context.seeds))
    return [{"prompt_ids": p, "completion_ids": c, "logprobs": [0.0] * len(c), "loss_mask": [1] * len(c),
             "reward": float(len(c) + k % 2)} for k, (p, c) in enumerate(zip(prompts, ids))]
"""


def test_a_step_whose_correction_weights_all_vanish_stops_the_run_as_a_mismatch(tiny_model_dir, sums_jsonl, tmp_path,
                                                                                 capsys):
    """The tiny random model gives each token about 1/260: log-probs of 0 put every sequence's weight
    π/μ ≈ 260^-2 per two tokens, below 1e-6 for any completion of 3 tokens (--max-new-tokens 3, no EOS). Its
    5.6 nats a token are far above --max-rollout-mismatch's default, which stops such a step first
    (tests/test_weight_integrity.py): the bound is raised here to reach the weights' own check."""
    from auto_research.cli import main

    (tmp_path / "lies.py").write_text(LIES)
    args = _cli(tiny_model_dir, sums_jsonl, tmp_path / "out", "--rollout-function", f"{tmp_path}/lies.py:certain",
                "--max-staleness", "1", "--rollout-correction", "sequence-tis", "--max-new-tokens", "3",
                "--eval-every", "0", "--max-rollout-mismatch", "100")
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in lines)
    assert lines[-1].startswith("auto-research: error: every rollout-correction weight of this step is below 1e-06 "
                                "(the largest here "), lines[-1]
    assert ("the sampler's log-probs do not match the policy's, a mismatch, not learning (check the log-probs the "
            "sampler or the --rollout-function returns; --rollout-correction sequence-tis multiplies a whole completion's "
            "ratios, where token-tis truncates each token's)") in lines[-1]


def test_the_weights_check_counts_the_trained_tokens_only():
    from auto_research.algorithms.correction import check_weights, importance_weights
    from auto_research.engine.distributed import World

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    vanished = importance_weights(torch.tensor([[-8.0, -8.0, 50.0], [-14.0, 50.0, 50.0]]), mask, "sequence-tis", 2.0)
    assert vanished.max().item() == pytest.approx(math.exp(-14))  # e^-16 and e^-14, the masked 50s left out
    with pytest.raises(RewardError, match=r"^every rollout-correction weight of this step is below 1e-06 \(the "
                                          r"largest here 8.32e-07\)"):
        check_weights(World(), vanished, mask)
    one_kept = importance_weights(torch.tensor([[-8.0, -8.0, 0.0], [-1.0, 0.0, 0.0]]), mask, "sequence-tis", 2.0)
    check_weights(World(), one_kept, mask)  # one sequence's weight e^-1: the step learns from it
