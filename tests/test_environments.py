"""Environments and tools (envs/): the two environment shapes (ours and TRL's), tools described by their hints
and docstrings, tool calls parsed and answered, and multi-turn trajectories built token-in/token-out with a
loss mask on the model's tokens only. A scripted model stands in for the sampler: what it draws is known, so
the ids, masks, rewards and flags are checked exactly."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from auto_research.engine.rollout import SamplingSettings
from auto_research.engine.tiny import build_tokenizer
from auto_research.envs import EnvironmentFactory, Episode
from auto_research.envs.tools import check_template_takes_tools, load_tools, parse_calls, tool_schema
from auto_research.envs.trajectory import Conversation, run_episodes, turn_seed
from auto_research.errors import UserError

CHATML_WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\nTools, called as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>:"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_WITH_TOOLS
    return tokenizer


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    """A module of environments and tools on sys.path, as a user's would be."""
    folder = tmp_path_factory.mktemp("user-code")
    (folder / "user_envs.py").write_text(textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first
                b: the second
            """
            return a + b

        def divide(a: int, b: int) -> float:
            """Divide a by b.

            Args:
                a: the numerator
                b: the denominator
            """
            return a / b

        def unhinted(a, b):
            """No hints."""
            return a

        class Guess:
            """Guess the number: 'higher' or 'lower' until it is found."""
            def __init__(self, row):
                self.secret = row["secret"]
            def reset(self):
                return None
            def step(self, text):
                guess = int(text.strip()) if text.strip().lstrip("-").isdigit() else None
                if guess == self.secret:
                    return "correct", 1.0, True
                if guess is None:
                    raise ValueError(f"not a number: {text!r}")
                return ("higher" if guess < self.secret else "lower"), -0.1, False

        def make_guess(row):
            return Guess(row)

        class NoStep:
            def reset(self):
                return None

        def make_nostep(row):
            return NoStep()

        class Counter:
            """TRL's shape: tools are its public methods."""
            def reset(self, **row):
                self.calls = 0
                return f" (count to {row['target']})"
            def increment(self, by: int) -> int:
                """Add to the counter.

                Args:
                    by: how much
                """
                self.calls += by
                return self.calls
            def get_reward(self):
                return float(self.calls)

        def make_counter():
            return Counter()
    '''))
    sys.path.insert(0, str(folder))
    yield "user_envs"
    sys.path.remove(str(folder))
    sys.modules.pop("user_envs", None)


class ScriptedModel:
    """Replies by what the conversation's last message says; every reply ends with <|im_end|>. Records the
    seeds it was asked with. Log-probs −0.01·(position + 1), so each token's value is known."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.seeds = tokenizer, replies, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompt_ids, seeds, settings):
        self.seeds.append(list(seeds))
        completions, logprobs = [], []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            last = text.rsplit("<|im_start|>", 2)[-2].split("\n", 1)[1].removesuffix("<|im_end|>\n")
            reply = self.replies(last) if callable(self.replies) else self.replies[last]
            tokens = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.end]
            tokens = tokens[: settings.max_new_tokens]
            completions.append(tokens)
            logprobs.append([-0.01 * (k + 1) for k in range(len(tokens))])
        return completions, logprobs


SETTINGS = SamplingSettings(max_new_tokens=200)


def _render(tokenizer, messages, tools=None, generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def test_a_tool_call_is_answered_and_the_trajectory_is_the_model_s_own_ids_with_the_tool_s_masked(tokenizer, env_module):
    tools = load_tools(f"{env_module}:add,{env_module}:divide")
    schemas = [tool_schema(function) for function in tools.values()]
    conversation = Conversation(tokenizer, schemas, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    call = '<tool_call>{"name": "add", "arguments": {"a": 17, "b": 25}}</tool_call>'
    model = ScriptedModel(tokenizer, {"What is 17 + 25?": call, "42": "The answer is 42."})
    [trajectory] = run_episodes(model, conversation, [Episode(None, {}, tools)], ["What is 17 + 25?"], [7], SETTINGS,
                                max_turns=4, max_tokens=500)
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[2] == {"role": "tool", "name": "add", "content": "42"}
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.truncated) == (2, 1, 0, False)
    # Token-in/token-out: the model's two replies sit in the ids exactly as drawn, mask 1, with their log-probs;
    # between them only the tool's message, mask 0.
    end = model.end
    first = tokenizer(call, add_special_tokens=False)["input_ids"] + [end]
    second = tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"] + [end]
    middle = tokenizer("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert trajectory.ids == first + middle + second
    assert trajectory.loss_mask == [1] * len(first) + [0] * len(middle) + [1] * len(second)
    assert trajectory.logprobs == ([-0.01 * (k + 1) for k in range(len(first))] + [0.0] * len(middle)
                                   + [-0.01 * (k + 1) for k in range(len(second))])
    # The whole conversation is the template's rendering of it (nothing re-tokenized differently), up to the
    # newline the template puts after the last end-of-turn token.
    assert tokenizer.decode(trajectory.prompt_ids + trajectory.ids) + "\n" == _render(tokenizer, trajectory.messages,
                                                                                      schemas)
    assert trajectory.prompt_ids == tokenizer(_render(tokenizer, trajectory.messages[:1], schemas, True),
                                              add_special_tokens=False)["input_ids"]


def test_a_tool_that_raises_an_unknown_tool_and_an_unreadable_call_are_answered_as_errors(tokenizer, env_module):
    tools = load_tools(f"{env_module}:add,{env_module}:divide")
    conversation = Conversation(tokenizer, [tool_schema(f) for f in tools.values()], (tokenizer.eos_token_id,))
    replies = {"go": '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
                     '<tool_call>{"name": "sqrt", "arguments": {"x": 2}}</tool_call>',
               "error: no tool named 'sqrt' (tools: add, divide)": "<tool_call>{not json}</tool_call>"}
    model = ScriptedModel(tokenizer, lambda last: replies.get(last, "done"))
    [trajectory] = run_episodes(model, conversation, [Episode(None, {}, tools)], ["go"], [1], SETTINGS, 5, 800)
    tool_messages = [m for m in trajectory.messages if m["role"] == "tool"]
    assert tool_messages[:2] == [{"role": "tool", "name": "divide", "content": "error: ZeroDivisionError: division by zero"},
                                 {"role": "tool", "name": "sqrt", "content": "error: no tool named 'sqrt' (tools: add, divide)"}]
    assert (trajectory.tool_calls, trajectory.tool_errors) == (3, 3)


def test_an_environment_s_rewards_sum_and_a_game_ends_when_solved_or_when_turns_run_out(tokenizer, env_module):
    factory = EnvironmentFactory.load(f"{env_module}:make_guess", {"secret": 3})
    conversation = Conversation(tokenizer, None, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    guesses = {"Guess my number (1-9).": "5", "lower": "3", "higher": "4"}
    model = ScriptedModel(tokenizer, guesses)
    episodes = [factory.episode({"secret": 3}), factory.episode({"secret": 4}), factory.episode({"secret": 7})]
    solved, late, unsolved = run_episodes(model, conversation, episodes, ["Guess my number (1-9)."] * 3, [1, 2, 3],
                                          SETTINGS, max_turns=3, max_tokens=500)
    assert (solved.turns, solved.reward, solved.truncated) == (2, pytest.approx(0.9), False)  # -0.1 + 1
    assert [m["content"] for m in solved.messages] == ["Guess my number (1-9).", "5", "lower", "3"]
    assert (late.turns, late.reward, late.truncated) == (3, pytest.approx(0.8), False)  # 5 lower, 3 higher, 4
    assert (unsolved.turns, unsolved.reward, unsolved.truncated) == (3, pytest.approx(-0.3), True)
    # Each turn asks the model with each live trajectory's own seed, whatever else is in the batch.
    assert model.seeds[0] == [turn_seed(seed, 0, 0) for seed in (1, 2, 3)]
    assert model.seeds[2] == [turn_seed(seed, 0, 2) for seed in (2, 3)]
    alone = ScriptedModel(tokenizer, guesses)
    [again] = run_episodes(alone, conversation, [factory.episode({"secret": 7})], ["Guess my number (1-9)."], [3],
                           SETTINGS, 3, 500)
    assert (again.ids, again.loss_mask, again.reward) == (unsolved.ids, unsolved.loss_mask, unsolved.reward)
    assert alone.seeds == [[turn_seed(3, 0, t)] for t in range(3)]


def test_an_environment_that_raises_leaves_its_sample_unscored_and_the_length_limit_truncates(tokenizer, env_module):
    factory = EnvironmentFactory.load(f"{env_module}:make_guess", {"secret": 3})
    conversation = Conversation(tokenizer, None, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    model = ScriptedModel(tokenizer, {"Guess.": "five", "Long.": "5", "lower": "4" * 60})
    broken, cut = run_episodes(model, conversation, [factory.episode({"secret": 3})] * 2, ["Guess.", "Long."],
                               [1, 2], SETTINGS, max_turns=5, max_tokens=40)
    assert broken.reward is None and broken.failed == "ValueError: not a number: 'five'" and broken.turns == 1
    assert cut.truncated and cut.reward == pytest.approx(-0.1) and len(cut.ids) == 40 and cut.loss_mask[-1] == 1


def test_trl_shaped_environments_run_unchanged(tokenizer, env_module):
    factory = EnvironmentFactory.load(f"{env_module}:make_counter")
    assert factory.trl
    episode = factory.episode({"target": 5})
    assert set(episode.tools) == {"increment"}
    schemas = [tool_schema(f) for f in episode.tools.values()]
    conversation = Conversation(tokenizer, schemas, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    replies = {"Count. (count to 5)": '<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>',
               "2": '<tool_call>{"name": "increment", "arguments": {"by": 3}}</tool_call>', "5": "Done."}
    [trajectory] = run_episodes(ScriptedModel(tokenizer, replies), conversation, [episode], ["Count."], [0],
                                SETTINGS, 6, 800)
    assert trajectory.messages[0]["content"] == "Count. (count to 5)"  # reset(**row) appended to the prompt
    assert (trajectory.tool_calls, trajectory.turns, trajectory.reward) == (2, 3, 5.0)  # get_reward()


def test_tool_calls_are_read_in_each_template_s_format():
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert parse_calls(f"sure <tool_call>\n{json.dumps(call)}\n</tool_call>", "hermes")[0][0].arguments == {"a": 1, "b": 2}
    assert parse_calls(f"[TOOL_CALLS] [{json.dumps(call)}]", "mistral")[0][0].name == "add"
    llama = {"name": "add", "parameters": {"a": 1, "b": 2}}
    assert parse_calls(json.dumps(llama), "json")[0][0].arguments == {"a": 1, "b": 2}
    as_string = {"name": "add", "arguments": json.dumps({"a": 1})}
    assert parse_calls(f"<tool_call>{json.dumps(as_string)}</tool_call>", "hermes")[0][0].arguments == {"a": 1}
    assert parse_calls("no call here", "hermes") == ([], 0)
    assert parse_calls("<tool_call>{\"arguments\": {}}</tool_call>", "hermes") == ([], 1)


def test_bad_environments_and_tools_are_refused_in_one_line(tokenizer, env_module):
    def refused(call, *args) -> str:
        with pytest.raises(UserError) as caught:
            call(*args)
        return str(caught.value)

    assert refused(EnvironmentFactory.load, "no_such_module_xyz:make") .startswith(
        "--environment 'no_such_module_xyz:make': cannot import no_such_module_xyz (")
    assert refused(EnvironmentFactory.load, f"{env_module}:make_nothing") == (
        f"--environment '{env_module}:make_nothing': {env_module} has no 'make_nothing'")
    assert refused(EnvironmentFactory.load, "make_env") == "--environment 'make_env': expected module:name, e.g. my_envs:make_env"
    assert refused(EnvironmentFactory.load, f"{env_module}:make_nostep", {}) == (
        f"--environment {env_module}:make_nostep: the object it returns has no reset/step methods (an environment "
        "has reset() and step(text); got NoStep)")
    assert refused(load_tools, f"{env_module}:unhinted") == (
        "--tools: tool 'unhinted' cannot be described to the model: Argument a is missing a type hint in function "
        "unhinted")
    plain = build_tokenizer()
    plain.chat_template = "{% for message in messages %}{{ message.content }}\n{% endfor %}"
    schemas = [tool_schema(f) for f in load_tools(f"{env_module}:add").values()]
    assert refused(check_template_takes_tools, plain, schemas, "tiny") == (
        "--tools: tiny's chat template has no tool support (it does not show the tools passed to it); use a model "
        "whose template takes tools=")
    assert refused(check_template_takes_tools, build_tokenizer(), schemas, "tiny") == (
        "--tools: tiny's tokenizer has no chat template, so the model cannot be shown tools")
    check_template_takes_tools(tokenizer, schemas, "tiny-chatml")  # takes tools: no error
