"""One record per algorithm, for both levels: everything the trainer needs to know about it.

A record names its advantage estimator and policy loss by their registered keys (verl's pattern: the
functions register themselves in ``estimators.py`` and ``losses.py``), says where the KL penalty goes,
what it needs (a critic, a greedy baseline), how its advantages are normalised, and holds its
candidate-level NumPy twin. The trainer reads these fields and never asks for an algorithm's name, so
adding a variant is one estimator function and one record here.

This module imports neither NumPy nor torch: ``--help`` lists the names, and configs validate
against the records, before anything heavy is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.errors import UserError


@dataclass(frozen=True)
class CandidateTwin:
    """The algorithm at the candidate level: a linear softmax policy over 6 candidates
    (docs/candidate-protocol.md), its advantage a NumPy function in ``candidate.py``."""

    advantage: str
    """Key in ``algorithms.candidate.ADVANTAGES``."""
    objective: str
    """policy-gradient: A_i · ∇log π(y_i); clipped: PPO's clipped surrogate of ρ_i · A_i."""
    kl: str
    """reward: −β·log-ratio shapes the reward; loss: the exact KL gradient over the 6 candidates; none."""
    samples_from: str
    """policy: the current weights sample; rollout: a copy refreshed every 16 updates (PPO-style)."""
    reduction: str = "mean"
    """How per-sample terms of a group combine: mean (1/K Σ_i) or sum (best-of-K)."""
    reference_checked: bool = True
    """Whether the published table has figures for it."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: str
    """Key in ``algorithms.estimators.ADVANTAGE_ESTIMATORS``: per-token rewards → per-token advantages."""
    policy_loss: str
    """vanilla: −A·log π; clipped: PPO's clipped surrogate (also used whenever a batch serves several updates)."""
    kl: str
    """Where the KL penalty goes at the generation level by default (--kl-in): reward shapes the reward
    (only these algorithms may take it there), loss adds β·KL to the loss, none (a reference may still
    measure it)."""
    formula: str
    """One line for the docs."""
    citation: str
    needs_critic: bool = False
    """A learned value model V(s_t) (PPO): loaded, trained and checkpointed beside the policy."""
    needs_greedy: bool = False
    """The reward of each prompt's greedy completion (ReMax's baseline)."""
    reduction: str = "mean"
    """mean: the loss is averaged over completions; sum: summed within each group (RAFT's best of K)."""
    whiten: bool = False
    """Advantages whitened over the whole global batch, every rank's tokens together (--no-whiten-advantages
    keeps them as they are)."""
    moving_average: float | None = None
    """Decay of a baseline kept by the loop across steps (REINFORCE): passed to the estimator, then updated
    from this step's globally reduced mean score."""
    min_group_size: int = 1
    rollout_correction: str = "sequence-tis"
    """The default --rollout-correction when another engine samples (--sampler vllm): sequence-tis for an
    estimator whose action is the whole completion (one weight π/μ of the completion, as its gradient
    A_i · ∇log π(y_i|x) is a per-sequence expectation), token-tis for token-level estimators (PPO's per-token
    ratios and GAE)."""
    """Smallest K the estimator is defined for (2 when the baseline uses the other samples)."""
    candidate: CandidateTwin | None = None


REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is registered twice")
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown algorithm {name!r}; choose one of: {', '.join(REGISTRY)}") from None


def candidate_algorithms() -> list[str]:
    return [name for name, algorithm in REGISTRY.items() if algorithm.candidate is not None]


def check_group_size(algorithm: Algorithm, group_size: int) -> None:
    if group_size < algorithm.min_group_size:
        raise UserError(
            f"--group-size {group_size} is too small for {algorithm.name}: its baseline comes from the "
            f"other samples of the group, so it needs K >= {algorithm.min_group_size}"
            " (leave-one-out is undefined for K = 1)"
        )


# --- the records ---------------------------------------------------------------------------------------

register(Algorithm(
    name="rloo", advantage="rloo", policy_loss="vanilla", kl="reward", min_group_size=2,
    formula="A_i = r̃_i − 1/(K−1) Σ_{j≠i} r̃_j with r̃_i = r_i − β log π(y_i)/π_ref(y_i); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Ahmadian et al., 2024 (arXiv 2402.14740); Kool et al., 2019",
    candidate=CandidateTwin("rloo", "policy-gradient", "reward", "policy"),
))
register(Algorithm(
    name="ppo-rlhf", advantage="gae", policy_loss="clipped", kl="reward", needs_critic=True, whiten=True,
    rollout_correction="token-tis",
    min_group_size=2,
    formula="GAE per token on r_t = score·[t = last] − β·kl_t, V a learned critic; advantages whitened over the "
            "batch; clipped surrogate of ρ_t A_t",
    citation="Schulman et al., 2017; Ouyang et al., 2022",
    candidate=CandidateTwin("ppo", "clipped", "loss", "rollout"),
))
register(Algorithm(
    name="grpo", advantage="grpo", policy_loss="clipped", kl="loss", min_group_size=2,
    rollout_correction="token-tis",
    formula="A_i = (r_i − mean r) / (std r + 1e−6); clipped surrogate of ρ_i A_i; KL penalty in the loss",
    citation="Shao et al., 2024 (arXiv 2402.03300)",
    candidate=CandidateTwin("grpo", "clipped", "loss", "rollout"),
))
register(Algorithm(
    name="remax", advantage="remax", policy_loss="vanilla", kl="none", needs_greedy=True,
    formula="A_i = r_i − r(greedy response); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Li et al., 2023 (arXiv 2310.10505)",
    candidate=CandidateTwin("remax", "policy-gradient", "none", "policy"),
))
register(Algorithm(
    name="reinforce", advantage="reinforce", policy_loss="vanilla", kl="reward", moving_average=0.9,
    formula="A_i = r̃_i − b, b ← 0.9 b + 0.1 mean r̃ after each step; g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Williams, 1992; the paper's 'REINFORCE with baseline'",
    candidate=CandidateTwin("reinforce", "policy-gradient", "reward", "policy", reference_checked=False),
))
register(Algorithm(
    name="vanilla-pg", advantage="vanilla-pg", policy_loss="vanilla", kl="reward",
    formula="A_i = r̃_i (no baseline); g = 1/K Σ_i A_i ∇log π(y_i)",
    citation="Williams, 1992; the paper's 'vanilla policy gradient'",
    candidate=CandidateTwin("vanilla-pg", "policy-gradient", "reward", "policy", reference_checked=False),
))
register(Algorithm(
    name="raft", advantage="raft", policy_loss="vanilla", kl="none", reduction="sum", min_group_size=2,
    formula="train on the best of K samples (first drawn on ties): g = ∇log π(y_best)",
    citation="Dong et al., 2023 (arXiv 2304.06767)",
    candidate=CandidateTwin("raft", "policy-gradient", "none", "policy", reduction="sum"),
))
register(Algorithm(
    name="reinforce-pp", advantage="reinforce-pp", policy_loss="clipped", kl="reward", whiten=True,
    rollout_correction="token-tis",
    formula="A_t = whiten(G_t) over the global batch, G_t = Σ_{s≥t} r_s, r_s = score·[s = last] − β·kl_s; "
            "clipped surrogate",
    citation="Hu et al., 2025 (arXiv 2501.03262)",
))
register(Algorithm(
    name="reinforce-pp-baseline", advantage="reinforce-pp-baseline", policy_loss="clipped", kl="reward", whiten=True,
    rollout_correction="token-tis",
    min_group_size=2,
    formula="as reinforce-pp, with the group's mean score subtracted from each score first",
    citation="Hu et al., 2025 (arXiv 2501.03262); OpenRLHF's reinforce_baseline",
))
