"""``preference-generate``: the paper's RLHF pipeline on a laptop CPU, with no download.

The prompts are the embedded arithmetic task's (``47+38=``); the policy is the
embedded tiny model after its warm start, whose answers are mostly 2–3
characters long. A hidden **gold scorer** defines what is better: an
annotator who likes answers of ``GOLD_LENGTH`` (4) characters, 1 − |length − 4| / 4
(at least 0). It is a property a tiny reward model can learn, and one it
learns the wrong way outside the data: the warm start's pairs are nearly all
shorter than 4, so "longer is better" fits them, and a policy pushed far
enough overshoots into answers the gold scorer likes less (the length bias of
learned reward models, Singhal et al., 2023). The learner never sees the
scorer. Instead:

1. pairs of completions are sampled from the warm-started policy, two per
   prompt, at the RL sampling temperature;
2. each pair is labelled by the gold scorer with Bradley–Terry noise: y₁ ≻ y₂
   with probability σ((g(y₁) − g(y₂)) / τ), τ = ``LABEL_TEMPERATURE`` (a
   simulated annotator who is right more often the clearer the difference);
3. a proxy reward model (a scalar head on the warm-started model) is fitted
   to those labels (``reward_model.py``);
4. RLOO (or any algorithm) optimises the proxy, with the KL penalty to the
   warm start;
5. the gold judge compares the trained policy's greedy answers with the
   starting policy's (win rate), and every evaluation logs the proxy and gold
   rewards against the KL, where over-optimisation shows (Gao et al., 2022).

The labels' own ceiling, how often a noisy label agrees with the gold order,
is computed exactly from the noise model and reported next to the proxy's
held-out accuracy.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from auto_research.errors import UserError

LABEL_TEMPERATURE = 0.15
GOLD_LENGTH = 4
# Pairs are sampled at temperature 1: the warm start's own answers, which are rarely longer than
# 3 characters, so what the proxy says beyond that is extrapolation.
PAIR_TEMPERATURE = 1.0
PREFERENCE_PROMPTS = 3000  # the first training prompts; pairs are sampled on these


def gold_scores(prompts, completions, examples) -> list[float]:
    """The hidden gold scorer: 1 − |characters − GOLD_LENGTH| / GOLD_LENGTH, at least 0."""
    return [max(0.0, 1.0 - abs(len(text.strip()) - GOLD_LENGTH) / GOLD_LENGTH) for text in completions]


def arithmetic_gold(prompts, completions, examples) -> list[float]:
    """preference-arithmetic's gold scorer: the arithmetic partial credit (rewards.arithmetic_reward).
    Hard for a tiny reward model to learn from pairs, so its proxy is easily fooled: the task on which
    over-optimisation shows (the gold reward falls while the proxy climbs)."""
    from auto_research.post_training.lm.rewards import arithmetic_reward

    return arithmetic_reward(prompts, completions, examples)


# Embedded preference datasets → their hidden gold scorer.
GOLD_SCORERS = {"preference-generate": gold_scores, "preference-arithmetic": arithmetic_gold}


def judge_of(scorer):
    """The noise-free pairwise judge of a gold scorer: P(A is better) is 1, 0, or ½ on a tie."""
    def judge(prompt: str, response_a: str, response_b: str, example) -> float:
        a, b = scorer([prompt, prompt], [response_a, response_b], [example, example])
        return 1.0 if a > b else 0.0 if a < b else 0.5

    return judge


gold_judge = judge_of(gold_scores)


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
    statistics = {
        "pairs": len(rows),
        "identical_pairs_dropped": identical,
        "gold_ties": ties,
        # Over pairs the gold scorer orders: how often the noisy label agrees with it.
        "label_agreement": sum(agreement) / len(agreement) if agreement else float("nan"),
        "label_ceiling": sum(ceiling) / len(ceiling) if ceiling else float("nan"),
        "label_temperature": LABEL_TEMPERATURE,
    }
    return rows, statistics


def make_preferences(model_dir: Path, task, output: Path, pairs: int, seed: int, temperature: float,
                     max_new_tokens: int, log=print) -> dict:
    """Sample completions from the warm-started policy (two distinct ones per prompt where its four
    draws allow), label them, write JSONL."""
    import torch

    from auto_research.post_training.lm.models import load_policy
    from auto_research.post_training.lm.rollout import prompt_seed, sample

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
    log(f"labelled {statistics['pairs']} preference pairs with the gold scorer and Bradley–Terry noise "
        f"(τ = {LABEL_TEMPERATURE}): labels agree with the gold order on {statistics['label_agreement']:.3f} of the "
        f"pairs it orders (expected {statistics['label_ceiling']:.3f}) -> {output}")
    return statistics


def gold_accuracy_of_reward_model(reward_model_dir: Path, rows: list[dict]) -> float:
    """On pairs the gold scorer orders: how often the proxy orders them the same way."""
    from auto_research.post_training.lm.rewards import RewardModel

    ordered = [row for row in rows if row["gold_chosen"] != row["gold_rejected"]]
    if not ordered:
        return float("nan")
    reward = RewardModel(str(reward_model_dir), "cpu", offline=True)  # as the RL runs will score
    prompts = [r["prompt"] for r in ordered]
    better = reward(prompts, [r["chosen"] if r["gold_chosen"] > r["gold_rejected"] else r["rejected"] for r in ordered], None)
    worse = reward(prompts, [r["rejected"] if r["gold_chosen"] > r["gold_rejected"] else r["chosen"] for r in ordered], None)
    return sum(b > w for b, w in zip(better, worse)) / len(ordered)


# --- judges: win rate against the starting policy -------------------------------------------------


def load_judge(spec: str, task):
    """``gold`` (the task's own, when it has one) or ``module:function`` called as
    (prompt, response_a, response_b) → probability that A is better."""
    if spec == "gold":
        if getattr(task, "gold_judge", None) is None:
            raise UserError(f"--judge gold: {task.name} has no gold judge (preference-generate has one); "
                            "give --judge module:function")
        return task.gold_judge
    from auto_research.post_training.lm.rewards import load_callable

    function = load_callable(spec, "--judge")
    return lambda prompt, a, b, example: function(prompt, a, b)


def judge_probability(judge, spec: str, prompt: str, a: str, b: str, example) -> float:
    """One call of the judge, checked: a judge that raises or returns no probability is one line."""
    from auto_research.errors import one_line
    from auto_research.post_training.lm.rewards import RewardError

    try:
        value = judge(prompt, a, b, example)
    except Exception as error:  # noqa: BLE001 - the user's code
        raise RewardError(f"--judge {spec}: raised {one_line(error)}") from None
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"--judge {spec}: returned {value!r}, not a probability") from None
    if not (0.0 <= value <= 1.0):
        raise RewardError(f"--judge {spec}: returned {value}, not a probability in [0, 1]")
    return value


def win_rate(judge, spec: str, prompts, examples, new, old) -> tuple[float, float]:
    """(sum, count) of ½ [J(x, new, old) + 1 − J(x, old, new)]: both orders, which cancels a judge's
    preference for a position (a judge that always prefers A gives exactly ½)."""
    total = 0.0
    for prompt, example, a, b in zip(prompts, examples, new, old):
        forward = judge_probability(judge, spec, prompt, a, b, example)
        backward = judge_probability(judge, spec, prompt, b, a, example)
        total += 0.5 * (forward + 1.0 - backward)
    return total, float(len(prompts))
