"""Hidden gold scorers and judges: what a preference task is really scored by (never trained on), and the
held-out win rate against the starting policy.
"""

from __future__ import annotations

from auto_research.errors import RewardError, UserError, one_line
from auto_research.rewards.verifiers import arithmetic_reward
from auto_research.user_code import FORMS, load_user_object, where_raised

GOLD_LENGTH = 4


def gold_scores(prompts, completions, examples) -> list[float]:
    """preference-generate's gold: 1 − |characters − GOLD_LENGTH| / GOLD_LENGTH, at least 0: a property a tiny
    reward model can learn, and learns the wrong way outside the data (recipes/preferences.py)."""
    return [max(0.0, 1.0 - abs(len(text.strip()) - GOLD_LENGTH) / GOLD_LENGTH) for text in completions]


def arithmetic_gold(prompts, completions, examples) -> list[float]:
    """preference-arithmetic's gold: the arithmetic partial credit, which a tiny reward model learns poorly from
    pairs, so over-optimisation shows (the gold reward falls while the proxy climbs)."""
    return arithmetic_reward(prompts, completions, examples)


def judge_of(scorer):
    """The noise-free pairwise judge of a gold scorer: P(A is better) is 1, 0, or ½ on a tie."""
    def judge(prompt: str, response_a: str, response_b: str, example) -> float:
        a, b = scorer([prompt, prompt], [response_a, response_b], [example, example])
        return 1.0 if a > b else 0.0 if a < b else 0.5

    return judge


def load_judge(spec: str, task):
    """``gold`` (the task's own, when it has one) or ``module:function`` called as
    (prompt, response_a, response_b) → probability that A is better."""
    if spec == "gold":
        if getattr(task, "gold_judge", None) is None:
            raise UserError(f"--judge gold: {task.name} has no gold judge (preference-generate has one); "
                            "give --judge module:function")
        return task.gold_judge
    function = load_user_object(spec, "--judge", "a judge: fn(prompt, response_a, response_b) -> probability",
                                f"gold or {FORMS}")
    return lambda prompt, a, b, example: function(prompt, a, b)


def judge_probability(judge, spec: str, prompt: str, a: str, b: str, example) -> float:
    """One call of the judge, checked: a judge that raises or returns no probability is one line."""
    try:
        value = judge(prompt, a, b, example)
    except Exception as error:  # noqa: BLE001 - the user's code
        raise RewardError(f"--judge {spec}: raised {one_line(error)}{where_raised(error)}") from None
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
