"""Preference pairs for ``preference-generate`` (docs/rlhf.md): the paper's RLHF pipeline on a laptop CPU. Pairs
sampled from the warm-started tiny model are labelled by a hidden gold scorer (answers of 4 characters) with
Bradley–Terry noise, y₁ ≻ y₂ with probability σ((g(y₁) − g(y₂)) / τ); a proxy reward model learns "longer is better"
from them, which RL against it overshoots (over-optimisation, Gao et al., 2022). The labels' own ceiling (how often
a noisy label agrees with the gold order) is computed from the noise model.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch

from auto_research.engine.models import load_policy
from auto_research.engine.rollout import prompt_seed
from auto_research.engine.rollout.builtin import sample
from auto_research.rewards.gold import gold_scores
from auto_research.report.tables import figure
from auto_research.rewards.reward_model import RewardModel

LABEL_TEMPERATURE = 0.15
# Pairs are sampled at temperature 1: the warm start's own answers, which are rarely longer than
# 3 characters, so what the proxy says beyond that is extrapolation.
PAIR_TEMPERATURE = 1.0
PREFERENCE_PROMPTS = 3000  # the first training prompts; pairs are sampled on these


def label_pairs(prompts, examples, first, second, seed: int, scorer=gold_scores) -> tuple[list[dict], dict]:
    """Noisy Bradley–Terry labels of (first, second) completions; returns rows and label statistics."""
    generator = random.Random(seed)
    rows, agreement, ceiling, ties, identical = [], [], [], 0, 0
    for prompt, example, a, b in zip(prompts, examples, first, second):
        if a == b:
            identical += 1  # the same text twice teaches nothing; not a pair
            continue
        g_a, g_b = scorer([prompt, prompt], [a, b], [example, example])
        p_a = 1.0 / (1.0 + math.exp(-(g_a - g_b) / LABEL_TEMPERATURE))
        a_wins = generator.random() < p_a
        chosen, rejected = (a, b) if a_wins else (b, a)
        g_chosen, g_rejected = (g_a, g_b) if a_wins else (g_b, g_a)
        if g_a == g_b:
            ties += 1
        else:
            agreement.append(float(g_chosen > g_rejected))
            ceiling.append(max(p_a, 1 - p_a))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                     "gold_chosen": g_chosen, "gold_rejected": g_rejected})
    # Over pairs the gold scorer orders: how often the noisy label agrees with it (None when it orders none:
    # a small --pairs of answers the gold scorer ties, as a warm start's often are).
    statistics = {"pairs": len(rows), "identical_pairs_dropped": identical, "gold_ties": ties,
                  "label_agreement": sum(agreement) / len(agreement) if agreement else None,
                  "label_ceiling": sum(ceiling) / len(ceiling) if ceiling else None,
                  "label_temperature": LABEL_TEMPERATURE}
    return rows, statistics


def make_preferences(model_dir: Path, task, output: Path, pairs: int, seed: int, temperature: float,
                     max_new_tokens: int, log=print) -> dict:
    """Sample two distinct completions per prompt where four draws allow, label them, write JSONL."""
    model, tokenizer = load_policy(str(model_dir), "cpu", torch.float32, offline=True)
    examples = task.train[:min(pairs, PREFERENCE_PROMPTS, len(task.train))]
    prompts = [example.prompt for example in examples]
    first, second = [], []
    draws = 4  # per prompt; the pair is the first two that differ (a confident policy often repeats itself)
    for start in range(0, len(prompts), 256):
        chunk = prompts[start: start + 256]
        rollout = sample(model, tokenizer, chunk, draws, max_new_tokens, temperature,
                         seeds=[prompt_seed(seed, 0, start + i) for i in range(len(chunk))])
        for group in range(len(chunk)):
            texts = rollout.completions[group * draws: (group + 1) * draws]
            other = next((text for text in texts[1:] if text != texts[0]), texts[0])
            first.append(texts[0])
            second.append(other)
    rows, statistics = label_pairs(prompts, examples, first, second, seed, task.gold)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(row) + "\n" for row in rows))
    agreement, ceiling = figure(statistics["label_agreement"], 3), figure(statistics["label_ceiling"], 3)
    log(f"labelled {statistics['pairs']} preference pairs with the gold scorer and Bradley–Terry noise "
        f"(τ = {LABEL_TEMPERATURE}): labels agree with the gold order on {agreement} of the "
        f"{len(rows) - statistics['gold_ties']} pairs it orders (expected {ceiling}) -> {output}")
    return statistics


def gold_accuracy_of_reward_model(reward_model_dir: Path, rows: list[dict]) -> float | None:
    """On pairs the gold scorer orders: how often the proxy orders them the same way; None when it orders none
    of ``rows`` (there is nothing to measure: written as null, shown as n/a)."""
    ordered = [row for row in rows if row["gold_chosen"] != row["gold_rejected"]]
    if not ordered:
        return None
    reward = RewardModel(str(reward_model_dir), "cpu", offline=True)  # as the RL runs will score
    prompts = [r["prompt"] for r in ordered]
    better = reward(prompts, [r["chosen"] if r["gold_chosen"] > r["gold_rejected"] else r["rejected"] for r in ordered], None)
    worse = reward(prompts, [r["rejected"] if r["gold_chosen"] > r["gold_rejected"] else r["chosen"] for r in ordered], None)
    return sum(b > w for b, w in zip(better, worse)) / len(ordered)
