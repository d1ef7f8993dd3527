"""A multi-turn trajectory's room (issue 52, item 7): by default the environment's messages get room of their own
(--max-observation-tokens a turn) beside the model's (--max-new-tokens a turn), so an observation never eats the
model's next turn; a step whose every trajectory was cut off before its environment ended it says so, naming the
flag to raise, never "the reward returned None"."""

from __future__ import annotations

import json

import pytest

CHATML = ("{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
          "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

GAME = '''
class Guess:
    """Guess my number in three tries: a hint after a wrong one, a reward only when the game ends."""
    def __init__(self, row):
        self.secret, self.tries = int(row["answer"]), 0
    def reset(self):
        return None
    def step(self, text):
        self.tries += 1
        guess = int(text) if text.strip().isdigit() else None
        if guess == self.secret:
            return None, 1.0, True
        if self.tries == 3:
            return None, 0.0, True
        return ("No, higher." if guess is None or guess < self.secret else "No, lower."), None, False

def make_env(row):
    return Guess(row)
'''


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The embedded architecture (byte-level tokenizer, every byte a token) with a ChatML template, as text."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("chat-model")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML
    build_model(tokenizer, seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def game(tmp_path, monkeypatch):
    (tmp_path / "guess_game.py").write_text(GAME)
    rows = [{"prompt": "Guess my number, from 1 to 9.", "answer": str(n)} for n in range(1, 10)] * 4
    (tmp_path / "guesses.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(chat_model, game, capsys, *extra) -> tuple[int, str, list[dict]]:
    from auto_research.cli import main

    code = main(["post-train", "--model", str(chat_model), "--dataset", str(game / "guesses.jsonl"), "--steps", "2",
                 "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6", "--max-turns", "3",
                 "--evaluation-examples", "4", "--eval-every", "0", "--offline", "--device", "cpu", "--no-progress",
                 "--threads", "1", "--environment", "guess_game:make_env", "--output-dir", str(game / "out"), *extra])
    rows = [json.loads(line) for path in (game / "out").glob("*/metrics.jsonl") for line in path.open()]
    return code, capsys.readouterr().err.strip().splitlines()[-1], rows


def test_the_default_room_adds_the_environment_s_own_to_the_model_s():
    from auto_research.config.environment import OBSERVATION_TOKENS, TurnsSection

    turns = TurnsSection(environment="guess_game:make_env", max_turns=3)
    assert turns.trajectory_tokens(6) == 6 * 3 + OBSERVATION_TOKENS * 2
    assert turns.observation_tokens() == OBSERVATION_TOKENS
    given = TurnsSection(environment="guess_game:make_env", max_turns=3, max_trajectory_tokens=100)
    assert (given.trajectory_tokens(6), given.observation_tokens()) == (100, None)  # one room, shared, as before
    both = TurnsSection(environment="guess_game:make_env", max_turns=3, max_observation_tokens=40)
    assert (both.trajectory_tokens(6), both.observation_tokens()) == (6 * 3 + 40 * 2, 40)


def test_a_hint_in_the_chat_template_leaves_the_model_its_turns(chat_model, game, capsys):
    """--max-new-tokens 6, --max-turns 3, the byte-level tokenizer: a hint wrapped in the template is some 60
    tokens, more than the old default room of 6 × 3 = 18 for everything (every episode ended truncated after one
    turn, no reward: "the reward returned None for all 16 completions"). Now every game is played to its end."""
    code, last, rows = _run(chat_model, game, capsys)
    assert code == 0, last
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["truncated_fraction"] == 0.0 and row["unscored_samples"] == 0 for row in rows)
    assert all(row["turns_mean"] > 2 for row in rows)  # the random model rarely guesses: most games take 3 turns


@pytest.mark.parametrize("extra, cut", [
    (("--max-trajectory-tokens", "30"), "at --max-trajectory-tokens 30), so none has a reward: raise "
                                        "--max-trajectory-tokens"),
    (("--max-turns", "2"), "at --max-turns 2), so none has a reward: raise --max-turns"),
])
def test_a_step_whose_every_trajectory_was_cut_off_names_the_flag_to_raise(chat_model, game, capsys, extra, cut):
    """Cut by the room (its first hint does not fit) or by the turns (the game wants three guesses): one line
    naming the flag, not the reward."""
    code, last, _ = _run(chat_model, game, capsys, *extra)
    assert code == 2
    assert last == ("auto-research: error: no sample of step 1 could be scored: every trajectory was cut off before "
                    f"its environment ended it (16 of 16 truncated {cut}; nothing was written")
    assert "the reward returned None" not in last
