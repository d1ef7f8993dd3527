"""A multi-turn rollout, token-in/token-out: the model's replies and the environment's messages appended to one
list of token ids, never re-tokenized (re-applying the chat template can give other ids than the model drew,
which broke PPO's convergence in verl #3720, #3960). The model's tokens go in as drawn (loss mask 1); a message
goes in as the text the template adds for it, tokenized on its own (loss mask 0), cut to fit first (``fit``).

Each turn draws one completion per live trajectory from its own seed (``turn_seed``), so which batch or process
runs a trajectory changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from auto_research.envs import Episode
from auto_research.envs.deadline import CONCURRENCY, CallTimeout, ToolTimeout, each
from auto_research.envs.tools import answer, call_format, parse_calls
from auto_research.errors import UserError, one_line

Generate = Callable[[list[list[int]], list[int], object], tuple[list[list[int]], list[list[float]]]]
"""``generate(prompt_ids, seeds, settings)``: one completion (ids) and its log-probs per prompt, from its seed."""

SENTINEL = "\u2063auto-research-turn\u2063"


def turn_seed(seed: int, index: int, turn: int) -> int:
    """A trajectory's seed at a turn: from its prompt's seed, its index in the group and the turn alone."""
    return (seed * 6364136223846793005 + index * 1442695040888963407 + turn * 2654435761) % 2**63


class Conversation:
    """Token ids of a conversation's pieces, through the tokenizer's chat template (or plain text without one)."""

    def __init__(self, tokenizer, tools: list[dict] | None, eos: tuple[int, ...]):
        self.tokenizer, self.tools, self.eos = tokenizer, tools or None, tuple(eos)
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.schemas = {schema["function"]["name"]: schema for schema in tools or ()}
        """Each tool's schema by name: a call's arguments are checked against it before the call."""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False)

    def content_ids(self, text: str) -> list[int]:
        """A text alone as ids (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self._render(messages, True) if self.templated else "\n".join(message["content"] for message in messages)
        return self.content_ids(text)

    def continuation(self, history: list[dict], new: list[dict], ended: bool) -> list[int]:
        """The ids that follow the model's last reply (``history[-1]``) when ``new`` messages answer it: the
        template's closing of that reply (less the end-of-turn token the model already drew, when it drew one),
        the new messages and the next generation prompt."""
        if not self.templated:
            return self.content_ids("\n" + "\n".join(message["content"] for message in new) + "\n")
        before, after = self._render(history, False), self._render(history + new, True)
        if not after.startswith(before):
            raise UserError("the chat template renders earlier turns differently once a message is added, so a "
                            "conversation cannot be extended token by token; use another template")
        marked = self._render(history[:-1] + [{**history[-1], "content": SENTINEL}], False)
        closing = marked[marked.rindex(SENTINEL) + len(SENTINEL):] if SENTINEL in marked else ""
        if ended:
            drawn = self.tokenizer.decode(list(self.eos[:1]))
            closing = closing[len(drawn):] if closing.startswith(drawn) else closing
        return self.content_ids(closing + after[len(before):])


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    """After the prompt: the model's tokens and the environment's, in the order they came."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the environment's and the tools'."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-probability of each of the model's tokens; 0 on the others."""
    messages: list[dict] = field(default_factory=list)
    reward: float | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    failed: str | None = None
    """The environment's error, in one line: the trajectory's reward is then None (left out of its baseline)."""
    timed_out: str | None = None
    """"environment" or "tool" when the failure is a call that ran past --env-timeout or --tool-timeout."""
    live: bool = True
    limit: str | None = None
    """The flag (and its value) that cut a truncated trajectory: --max-trajectory-tokens, --max-turns."""
    text: str | None = None
    """What the completion tables show for the whole trajectory (a rollout function's); None: its ids decoded."""

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.ids += ids
        self.loss_mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else list(logprobs)


def run_episodes(generate: Generate, conversation: Conversation, episodes: list[Episode], prompts: list[str],
                 seeds: list[int], settings, max_turns: int, max_tokens: int, concurrency: int = CONCURRENCY,
                 observation_tokens: int | None = None) -> list[Trajectory]:
    """Each episode's trajectory, all advanced together one turn at a time. ``max_tokens`` bounds what follows the
    prompt, ``observation_tokens`` (None: no bound of its own) what answers one reply. Each phase's calls (resets,
    answers, final rewards) run ``concurrency`` at a time when under a limit; tokenizing stays in this thread."""
    form = call_format(conversation.tokenizer)
    bound = concurrency if any(episode.threaded for episode in episodes) else 1
    firsts = each([partial(episode.first_message, prompt) for episode, prompt in zip(episodes, prompts)], bound)
    trajectories = [_started(conversation, prompt, outcome) for prompt, outcome in zip(prompts, firsts)]
    for turn in range(max_turns):
        live = [index for index, trajectory in enumerate(trajectories) if trajectory.live]
        if not live:
            break
        completions, logprobs = generate([trajectories[i].prompt_ids + trajectories[i].ids for i in live],
                                         [turn_seed(seeds[i], 0, turn) for i in live], settings)
        replied = [(i, reply) for i, tokens, values in zip(live, completions, logprobs)
                   if (reply := _reply(trajectories[i], conversation, list(tokens), list(values), max_tokens))]
        answers = each([partial(_answers, trajectories[i], episodes[i], conversation, form, text)
                        for i, (text, _) in replied], bound)
        for (i, (_, ended)), (answered, new) in zip(replied, answers):
            if not answered:  # the environment (or a tool) failed: this sample is unscored
                _fail(trajectories[i], new)
            else:
                _follow(trajectories[i], conversation, new, ended, turn == max_turns - 1, max_tokens,
                        observation_tokens, max_turns)
    going = [index for index, trajectory in enumerate(trajectories) if trajectory.failed is None]
    for i, (scored, value) in zip(going, each([episodes[i].final_reward for i in going], bound)):
        if scored:
            trajectories[i].reward = value
        else:  # TRL's get_reward raised, or the rewards are not numbers
            _fail(trajectories[i], value)
    return trajectories


def _fail(trajectory: Trajectory, error: Exception) -> None:
    """The sample fails: unscored, the error kept in one line (a timeout counted by its kind)."""
    trajectory.failed, trajectory.live = one_line(error), False
    if isinstance(error, CallTimeout):
        trajectory.timed_out = "tool" if isinstance(error, ToolTimeout) else "environment"


def _started(conversation: Conversation, prompt: str, outcome: tuple[bool, object]) -> Trajectory:
    """A trajectory from its first message (``outcome`` of the reset); a failed reset leaves the row's prompt and an
    unscored sample."""
    made, first = outcome
    messages = [{"role": "user", "content": first if made else prompt}]
    trajectory = Trajectory(conversation.prompt_ids(messages), messages=messages)
    if not made:  # the environment's reset raised (or hung): this sample is unscored
        _fail(trajectory, first)
    return trajectory


def _reply(trajectory: Trajectory, conversation: Conversation, tokens: list[int], logprobs: list[float],
           max_tokens: int) -> tuple[str, bool] | None:
    """The model's reply appended: its text and whether it drew its end-of-turn token; None when the trajectory's
    tokens ran out on it (truncated)."""
    room = max_tokens - len(trajectory.ids)
    tokens, logprobs = tokens[:room], logprobs[:room]
    trajectory.append(tokens, logprobs)
    trajectory.turns += 1
    ended = bool(tokens) and tokens[-1] in conversation.eos
    text = conversation.tokenizer.decode(tokens, skip_special_tokens=True)
    trajectory.messages.append({"role": "assistant", "content": text})
    if not ended and len(trajectory.ids) >= max_tokens:
        _truncate(trajectory, f"--max-trajectory-tokens {max_tokens}")
        return None
    return text, ended


def _follow(trajectory: Trajectory, conversation: Conversation, new: list[dict], ended: bool, last_turn: bool,
            max_tokens: int, observation_tokens: int | None, max_turns: int) -> None:
    """What answers the model's reply appended, cut to fit; the trajectory ends when nothing answers, at the last
    turn, or when even the template's own tokens do not fit."""
    if not new:  # the environment is done, or a tools-only (or TRL-shaped) episode's reply called no tool
        trajectory.live = False
        return
    if last_turn:
        _truncate(trajectory, f"--max-turns {max_turns}")
        return
    room = max_tokens - len(trajectory.ids)
    own = observation_tokens is not None and observation_tokens + 1 < room
    fitted = fit(conversation, trajectory.messages, new, ended, observation_tokens + 1 if own else room)
    if fitted is None:
        _truncate(trajectory, f"--max-observation-tokens {observation_tokens}" if own else
                  f"--max-trajectory-tokens {max_tokens}")
        return
    following, new = fitted
    trajectory.append(following, None)
    trajectory.messages += new


def _truncate(trajectory: Trajectory, limit: str) -> None:
    """The trajectory ends before its environment ended it: ``limit``, the flag and value that cut it."""
    trajectory.truncated, trajectory.live, trajectory.limit = True, False, limit


def _answers(trajectory: Trajectory, episode: Episode, conversation: Conversation, form: str, text: str
             ) -> list[dict]:
    """What answers the model's reply: each tool call's answer as a ``tool`` message (counted), else the
    environment's observation; none when the episode ends there."""
    calls, broken = parse_calls(text, form) if episode.tools else ([], 0)
    if not (calls or broken):
        if not episode.steps:
            return []
        observation, done = episode.step(text)
        return [] if done or observation is None else [{"role": "user", "content": observation}]
    trajectory.tool_calls += len(calls) + broken
    trajectory.tool_errors += broken
    new = []
    for call in calls:
        content, error = answer(call, episode.tools, conversation.schemas, episode.tool_timeout, episode.worker)
        trajectory.tool_errors += int(error)
        new.append({"role": "tool", "name": call.name, "content": content})
    if broken:
        new.append({"role": "tool", "content": "error: the tool call could not be read as JSON with a name and "
                                               "arguments"})
    return new


CHARACTERS_PER_TOKEN = 4
"""The byte bound before tokenizing: a message is cut to this many characters per token of room first (a
token rarely spans more), so a huge observation costs what fits, not its whole length."""
MIN_CHARACTERS = 256


def fit(conversation: Conversation, history: list[dict], new: list[dict], ended: bool, room: int
        ) -> tuple[list[int], list[dict]] | None:
    """The ids that answer the model's last reply, within ``room`` tokens with one left for the model's next
    turn, and the messages as cut to fit (by characters first, then the last message's last tokens first); None
    when even the template's own tokens do not fit."""
    limit = max(CHARACTERS_PER_TOKEN * room, MIN_CHARACTERS)
    new = [{**message, "content": str(message["content"])[:limit]} for message in new]
    following = conversation.continuation(history, new, ended)
    excess = len(following) - (room - 1)
    if excess <= 0:
        return following, new
    for message in reversed(new):
        if excess <= 0:
            break
        ids = conversation.content_ids(message["content"])
        kept = max(0, len(ids) - excess)
        excess -= len(ids) - kept
        message["content"] = conversation.tokenizer.decode(ids[:kept], skip_special_tokens=False)
    following = conversation.continuation(history, new, ended)
    return (following, new) if len(following) < room else None
