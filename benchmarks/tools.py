"""Multi-turn environments, measured: a guess-the-number game whose turns to solve should fall under RLOO.

    python benchmarks/tools.py [--seed 42] [--steps 150]

The game: a secret in 1…9; each reply is a guess, answered "higher" or "lower" with the range still open
("higher 6-9", reward −0.1) until it is right (reward +1), for at most 9 turns. A policy that ignores the feedback
and never repeats a guess needs 5 turns on average; binary search needs 25/9 ≈ 2.8.

1. The embedded tiny model (a 160-position context for the longer trajectories) is warm-started by supervised
   fine-tuning on demonstrations that ignore the feedback: distinct random guesses until the secret comes up,
   trained on the model's tokens only (the trajectories are built by the same code as the rollouts).
2. RLOO with ``environment=make_env`` (the Python API; the command line's ``--environment``) from that start.

Goal (issue 24): the held-out mean turns to solve (one greedy game per held-out secret) falls by at least 30%
within 10 minutes of training on 2 cores. Prints the start, the end and the curve of training turns_mean.

Measured (seed 42, 2 shared cores; python benchmarks/tools.py --steps 600): held-out greedy turns to solve
6.33 -> 4.22 (-33%), solved 0.56 -> 0.78, in 843 s of training on a loaded machine (0.6-0.8 s a step when the
cores were free, about 7 minutes for 600 steps); the held-out curve is noisy (120: 5.78, 240: 6.22, 360: 4.44,
480: 6.33, 600: 4.22: nine distinct greedy games), the sampled training turns_mean falls 5.48 -> 4.45 (means of
steps 1-100 and 501-600, -19%). At 200 steps (learning rate 2e-3) it was 6.33 -> 5.56 (-12%). One seed: the goal
of -30% is met at the end of this run, not shown to hold over seeds.

The issue's other example, a calculator tool on sums and products, is not built yet.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "guess 1-9:"


class GuessTheNumber:
    """Higher or lower, with the range still open: "higher 6-9"."""

    def __init__(self, row):
        self.secret, self.low, self.high = int(row["answer"]), 1, 9

    def reset(self):
        return None

    def step(self, text: str):
        guess = int(text.strip()) if text.strip().isdigit() else None
        if guess == self.secret:
            return None, 1.0, True
        if guess is None:
            return f"? {self.low}-{self.high}", -0.1, False
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return f"higher {self.low}-{self.high}", -0.1, False
        self.high = min(self.high, guess - 1)
        return f"lower {self.low}-{self.high}", -0.1, False


def make_env(row):
    return GuessTheNumber(row)


def rows(count: int, seed: int) -> list[dict]:
    generator = random.Random(seed)
    return [{"prompt": PROMPT, "answer": str(generator.randint(1, 9))} for _ in range(count)]


def demonstration_trajectories(tokenizer, count: int, seed: int):
    """Trajectories of feedback-blind play (distinct random guesses), laid out token for token as rollouts are
    (``run_episodes`` with a scripted model that knows each game by its turn's seed)."""
    from auto_research.engine.rollout import SamplingSettings
    from auto_research.envs import EnvironmentFactory
    from auto_research.envs.trajectory import Conversation, run_episodes, turn_seed

    generator = random.Random(seed)
    games = [(row, generator.sample(range(1, 10), 9)) for row in rows(count, seed)]
    which = {turn_seed(game, 0, turn): (game, turn) for game in range(count) for turn in range(9)}

    def generate(prompt_ids, seeds, settings):
        replies = [str(games[which[s][0]][1][which[s][1]]) for s in seeds]
        tokens = [tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for reply in replies]
        return tokens, [[0.0] * len(ids) for ids in tokens]

    factory = EnvironmentFactory(make_env, "make_env")
    conversation = Conversation(tokenizer, None, (tokenizer.eos_token_id,))
    return run_episodes(generate, conversation, [factory.episode(row) for row, _ in games], [PROMPT] * count,
                        list(range(count)), SamplingSettings(2), 9, 125)


def warm_start(seed: int, folder: Path, demonstrations: int = 2000, steps: int = 150, batch_size: int = 32) -> dict:
    """The tiny model, fine-tuned on feedback-blind games (loss on the model's tokens only)."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, max_position_embeddings=160)
    trajectories = demonstration_trajectories(tokenizer, demonstrations, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = random.Random(seed)
    started = time.perf_counter()
    for _ in range(steps):
        batch = generator.sample(trajectories, batch_size)
        width = max(len(t.prompt_ids) + len(t.ids) for t in batch)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros(batch_size, width, dtype=torch.long)
        for row, t in enumerate(batch):
            sequence = t.prompt_ids + t.ids
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
            owned = [0] * len(t.prompt_ids) + t.loss_mask
            labels[row, : len(sequence)] = torch.tensor([token if keep else -100 for token, keep in zip(sequence, owned)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"seconds": time.perf_counter() - started, "loss": float(loss.detach())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--keep", default=None, help="a folder to copy the run folder into")
    arguments = parser.parse_args()
    from auto_research import GenerationConfig, post_train

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        record = warm_start(arguments.seed, scratch / "start")
        print(f"warm start: {record['seconds']:.0f} s, final loss {record['loss']:.3f}", flush=True)
        data = rows(600, arguments.seed + 1) + [{"prompt": PROMPT, "answer": str(s)} for s in range(1, 10)] * 5
        config = GenerationConfig(model=str(scratch / "start"), output_dir=str(scratch / "runs"), steps=arguments.steps,
                                  prompts_per_step=4, group_size=16, max_new_tokens=2, max_turns=9,
                                  max_trajectory_tokens=125, learning_rate=1e-3, temperature=1.0, beta=0.0,
                                  evaluation_examples=45, eval_every=max(arguments.steps // 5, 1), progress=False,
                                  offline=True, seed=arguments.seed, device="cpu", threads=2, warmup_steps=10)
        started = time.perf_counter()
        metrics = post_train(data, config=config, name="guess", environment=make_env, log=lambda text: None)
        shutil.copytree(scratch / "runs", Path(arguments.keep) / "runs", dirs_exist_ok=True) if arguments.keep else None
        wall = time.perf_counter() - started
        run = scratch / "runs" / f"rloo-guess-seed{arguments.seed}"
        curve = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        every = max(len(curve) // 10, 1)
        before, after = metrics["baseline"]["turns_mean"], metrics["final"]["turns_mean"]
        print(f"RLOO {arguments.steps} steps in {metrics['training']['training_seconds']:.0f} s ({wall:.0f} s with "
              f"evaluations): held-out greedy turns to solve {before:.2f} -> {after:.2f} "
              f"({100 * (after - before) / before:+.0f}%), solved {metrics['baseline']['accuracy']:.2f} -> "
              f"{metrics['final']['accuracy']:.2f}")
        print("held-out turns_mean: " + ", ".join(f"{int(row['step'])}: {row['turns_mean']:.2f}"
                                                  for row in metrics["history"]))
        print("training turns_mean: " + ", ".join(f"{row['step']}: {row['turns_mean']:.2f}" for row in curve[::every]))


if __name__ == "__main__":
    main()
