"""Environments and tools (envs/): the two environment shapes (ours and TRL's), tools described by their hints
and docstrings, tool calls parsed and answered, and multi-turn trajectories built token-in/token-out with a
loss mask on the model's tokens only. A scripted model stands in for the sampler: what it draws is known, so
the ids, masks, rewards and flags are checked exactly."""

from __future__ import annotations

import json
import os
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

    assert refused(EnvironmentFactory.load, "no_such_module_xyz:make") == (
        "--environment 'no_such_module_xyz:make': cannot import module 'no_such_module_xyz' (no no_such_module_xyz.py "
        f"in the working folder {os.getcwd()} or on the import path)")
    assert refused(EnvironmentFactory.load, f"{env_module}:make_nothing") == (
        f"--environment '{env_module}:make_nothing': {env_module} has no 'make_nothing'")
    assert refused(EnvironmentFactory.load, "make_env") == (
        "--environment 'make_env': expected module:name (found from the working folder) or path/file.py:name, e.g. "
        "my_code:my_function")
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


# --- limits: timeouts, bounds on what an environment or a tool sends back, arguments checked ----------------------

class Hangs:
    """An environment of ours whose ``where`` ("make", "reset" or "step") blocks until ``release`` is set (at most
    60 s: a test never leaves a thread behind for long), for rows whose secret is 3; the others answer at once."""

    def __init__(self, row, where, release):
        self.secret, self.where, self.release = row["secret"], where, release
        self._block("make")

    def _block(self, where):
        if where == self.where and self.secret == 3:
            self.release.wait(60)

    def reset(self):
        self._block("reset")
        return None

    def step(self, text):
        self._block("step")
        return None, 1.0, True


@pytest.fixture
def release():
    """An event every blocked call waits on; set at the end, so that the abandoned threads end with the test."""
    import threading

    event = threading.Event()
    yield event
    event.set()


@pytest.mark.parametrize("where, what", [("make", "make_env(row)"), ("reset", "reset()"), ("step", "step()")])
def test_a_call_into_the_environment_past_the_env_timeout_fails_its_sample_and_the_others_go_on(tokenizer, release,
                                                                                               where, what):
    from auto_research.envs.rollout import EpisodeRunner, episode_figures
    from auto_research.engine.distributed import World
    from auto_research.data.types import Example

    factory = EnvironmentFactory(lambda row: Hangs(row, where, release), "hangs", timeout=1.0)
    model = ScriptedModel(tokenizer, lambda last: "5")
    runner = EpisodeRunner(model, tokenizer, factory, {}, SETTINGS, 3, 200,
                           (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    examples = [Example("Guess.", "3", fields={"secret": 3}), Example("Guess.", "4", fields={"secret": 4})]
    hung, answered = runner.trajectories(examples, 1, [1, 2])
    assert hung.failed == f"EnvironmentTimeout: {what} ran past --env-timeout 1 s (its thread is left running)"
    assert (hung.timed_out, hung.reward, hung.live) == ("environment", None, False)
    assert (answered.failed, answered.timed_out, answered.reward, answered.turns) == (None, None, 1.0, 1)
    figures = episode_figures(World(), runner.sample(examples, 1, [1, 2]))
    assert (figures["env_timeouts"], figures["tool_timeouts"], figures["environment_errors"]) == (1, 0, 1)


def test_a_tool_call_past_the_tool_timeout_fails_its_sample(tokenizer, release):
    def slow(x: int) -> int:
        """Blocks.

        Args:
            x: anything
        """
        release.wait(60)
        return x

    conversation = Conversation(tokenizer, [tool_schema(slow)], (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    model = ScriptedModel(tokenizer, lambda last: '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>')
    episode = Episode(None, {}, {"slow": slow}, tool_timeout=1.0)
    [trajectory] = run_episodes(model, conversation, [episode], ["go"], [1], SETTINGS, 3, 500)
    assert trajectory.failed == "ToolTimeout: tool slow ran past --tool-timeout 1 s (its thread is left running)"
    assert (trajectory.timed_out, trajectory.reward, trajectory.tool_calls) == ("tool", None, 1)


class BoundToItsThread:
    """An environment whose object works only on the thread that made it (as an SQLite connection does), with a
    tool of its own (TRL's shape: a bound method)."""

    def __init__(self):
        import threading

        self.made_on = threading.get_ident()

    def _here(self):
        import threading

        if threading.get_ident() != self.made_on:
            raise RuntimeError("objects made in a thread can only be used in that same thread")

    def reset(self, **row):
        self._here()
        return None

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: first
            b: second
        """
        self._here()
        return a + b


def test_a_trajectorys_calls_run_on_one_thread_which_ends_with_it(tokenizer):
    """Under the timeouts every call of a trajectory (making its environment, reset, its tools) runs on the
    trajectory's own thread, as an object bound to its thread needs; the thread ends when the trajectory does."""
    import gc
    import threading

    factory = EnvironmentFactory(BoundToItsThread, "bound", timeout=30.0)
    factory.trl = True
    episode = factory.episode({"prompt": "go"}, tool_timeout=30.0)
    conversation = Conversation(tokenizer, [tool_schema(episode.environment.add)],
                                (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    model = ScriptedModel(tokenizer, lambda last: '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
                          if "5" not in last else "5")
    [trajectory] = run_episodes(model, conversation, [episode], ["go"], [1], SETTINGS, 3, 500)
    assert trajectory.failed is None and trajectory.tool_calls == 1
    worker = episode.worker.thread
    del episode, trajectory
    gc.collect()
    worker.join(30)
    assert not worker.is_alive() and worker not in threading.enumerate()


def test_abandoned_calls_are_bounded_and_a_stop_request_gives_the_step_up(release, monkeypatch):
    from auto_research.envs import deadline

    with pytest.raises(deadline.EnvironmentTimeout):  # below the bound: this sample's failure only
        deadline.bounded(lambda: release.wait(60), 0.5, deadline.EnvironmentTimeout, "step()")
    assert deadline.abandoned() >= 1
    monkeypatch.setattr(deadline, "MAX_ABANDONED", 0)  # past it: the run stops
    with pytest.raises(deadline.StuckCalls, match=r"calls into the environment or tools are still running past their "
                                                  r"timeouts \(the last: step\(\), past --env-timeout\)"):
        deadline.bounded(lambda: release.wait(60), 0.5, deadline.EnvironmentTimeout, "step()")
    monkeypatch.setattr(deadline, "MAX_ABANDONED", 10**6)
    deadline.request_stop()
    try:
        with pytest.raises(deadline.Stopped, match=r"^the run was asked to stop while tool f ran, and it ran past "
                                                   r"--tool-timeout 0.5 s: this step is given up$"):
            deadline.bounded(lambda: release.wait(60), 0.5, deadline.ToolTimeout, "tool f")
        assert deadline.bounded(lambda: 7, 0.5, deadline.ToolTimeout, "tool f") == 7  # a call in time is answered
    finally:
        deadline.clear_stop()
    with pytest.raises(ValueError, match="its own"):  # the call's own exception, raised in the caller
        deadline.bounded(lambda: (_ for _ in ()).throw(ValueError("its own")), 5, deadline.ToolTimeout, "tool f")


class CountingTokenizer:
    """The tokenizer, counting the characters it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.inner, self.characters = tokenizer, 0

    def __call__(self, text, **options):
        self.characters += len(text)
        return self.inner(text, **options)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_10_mb_observation_is_cut_to_the_trajectory_s_room_before_it_is_tokenized(tokenizer):
    class Flood:
        def reset(self):
            return None

        def step(self, text):
            return "x" * 10_000_000, 0.0, False

    counting = CountingTokenizer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    conversation = Conversation(counting, None, (end,))
    model = ScriptedModel(tokenizer, lambda last: "5")
    budget = 60
    [trajectory] = run_episodes(model, conversation, [Episode(Flood(), {})], ["Guess."], [1], SETTINGS, 3, budget)
    first_reply = len(tokenizer("5", add_special_tokens=False)["input_ids"]) + 1
    assert len(trajectory.ids) <= budget and trajectory.truncated
    observation = trajectory.messages[2]["content"]
    assert observation == "x" * len(observation) and 0 < len(observation) < budget  # cut by tokens to fit
    # The environment's message took at most the room left after the model's first reply, one token kept for the
    # model's next turn, which it took.
    environment_tokens = len(trajectory.loss_mask) - sum(trajectory.loss_mask)
    assert environment_tokens <= budget - first_reply - 1 and trajectory.turns == 2
    # What was tokenized: a few times the room (the characters' bound, then the cut), never the 10 MB.
    assert counting.characters < 20 * budget + 1000


def test_tool_arguments_that_do_not_fit_the_hints_are_answered_as_errors_without_calling_the_tool(tokenizer):
    from auto_research.envs.tools import ToolCall, answer

    called = []

    def mul(a: int, b: int) -> str:
        """Repeat.

        Args:
            a: a count
            b: another
        """
        called.append((a, b))
        return "ok"

    def mean(values: list[float], label: str = "m", exact: bool = False) -> float:
        """Mean.

        Args:
            values: numbers
            label: a name
            exact: whether exact
        """
        called.append(values)
        return sum(values) / len(values)

    tools = {"mul": mul, "mean": mean}
    schemas = {name: tool_schema(function) for name, function in tools.items()}

    def answered(name, **arguments):
        return answer(ToolCall(name, arguments), tools, schemas)

    assert answered("mul", a="xy", b=5000000) == ('error: mul: argument \'a\' must be an integer, got "xy"', True)
    assert answered("mul", a=2, b=2.5) == ("error: mul: argument 'b' must be an integer, got 2.5", True)
    assert answered("mul", a=True, b=2) == ("error: mul: argument 'a' must be an integer, got true", True)
    assert answered("mul", a=2) == ("error: mul: missing argument 'b'", True)
    assert answered("mul", a=2, b=3, c=4) == ("error: mul: unknown argument 'c' (arguments: a, b)", True)
    assert answered("mean", values=[1, "2"]) == ("error: mean: argument 'values'[1] must be a number, got \"2\"", True)
    assert answered("mean", values=[1.0, 2], exact="yes") == (
        "error: mean: argument 'exact' must be true or false, got \"yes\"", True)
    assert called == []  # none of them was called
    assert answered("mul", a=2, b=3) == ("ok", False) and answered("mean", values=[1, 2.0]) == ("1.5", False)
    assert called == [(2, 3), [1, 2.0]]


@pytest.mark.parametrize("returned, failure", [
    ((None, 1.0, True, {}), "TypeError: step() must return (observation, reward, done), got (None, 1.0, True, {})"),
    ((None, "lots", True), "ValueError: step()'s reward is 'lots', not a finite number (or None)"),
    ((None, [1.0], True), "ValueError: step()'s reward is [1.0], not a finite number (or None)"),
    ((None, float("nan"), True), "ValueError: step()'s reward is nan, not a finite number (or None)"),
    (("go on", 1e308, False), "ValueError: the sum of step()'s rewards is inf, not a finite number (or None)"),
])
def test_an_environment_that_returns_the_wrong_thing_fails_its_sample_in_its_own_words(tokenizer, returned, failure):
    class Wrong:
        def reset(self):
            return None

        def step(self, text):
            return returned

    conversation = Conversation(tokenizer, None, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    model = ScriptedModel(tokenizer, lambda last: "5")
    [trajectory] = run_episodes(model, conversation, [Episode(Wrong(), {})], ["Guess."], [1], SETTINGS, 2, 500)
    assert (trajectory.failed, trajectory.reward, trajectory.timed_out) == (failure, None, None)


def test_a_factory_that_raises_on_the_first_row_is_one_line(env_module):
    with pytest.raises(UserError) as caught:
        EnvironmentFactory.load(f"{env_module}:make_guess", {"no_secret": 1})
    assert str(caught.value) == (f"--environment {env_module}:make_guess: making the environment for the first "
                                 "training row raised KeyError: 'secret'")
