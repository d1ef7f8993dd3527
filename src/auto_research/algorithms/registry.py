"""One record per algorithm, for both levels: everything the trainer needs to know about it.

A record names its advantage estimator, policy loss and aggregation by the keys they register under
(``estimators.py``, ``losses.py``; verl's pattern), says where the KL goes, what it needs, its defaults, and holds its
candidate-level NumPy twin. The trainer never asks for an algorithm's name: a variant is one function and one record.
No NumPy or torch here (``--help`` and config checks stay light); the lists of choices below are the only ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.errors import UserError

# --- the choices, each listed once -----------------------------------------------------------------------

POLICY_LOSSES = {
    "vanilla": "−A·log π, REINFORCE (the gradient at ratio 1 only: one update per batch)",
    "clipped-token": "PPO's clipped surrogate, a ratio per token (PPO, GRPO, DAPO, TRL)",
    "clipped-sequence": "the clipped surrogate of the completion's ratio π(y|x)/π_old(y|x)",
    "gspo": "the clipped surrogate of the length-normalised ratio (π(y|x)/π_old(y|x))^(1/|y|) (GSPO)",
    "cispo": "sg(clip(ρ_t))·A·log π per token: clipped tokens keep their gradient (CISPO)",
}
RATIO_FREE_LOSSES = ("vanilla",)
"""Losses that are the policy gradient only at ratio 1: a batch reused for several updates needs a ratio."""
AGGREGATIONS = {
    "sequence": "Σ over tokens / completions (each completion one action; the paper's)",
    "token-mean": "/ all tokens of the batch (DAPO)",
    "sequence-mean-token-mean": "each completion's token mean, averaged (GRPO's paper, GSPO)",
    "constant": "Σ over tokens / (completions × --max-new-tokens) (Dr. GRPO)",
}
KL_PLACEMENTS = {
    "reward": "−β·KL shapes the reward",
    "loss": "β·KL added to the loss",
    "none": "no penalty; a reference, if β > 0, still measures the KL",
}


def kl_shapes_reward(placement: str) -> bool:
    """The KL placement ``reward``: −β·KL is part of the per-token reward the advantage estimator sees."""
    return placement == "reward"


def kl_in_loss(placement: str) -> bool:
    """The KL placement ``loss``: β·KL is a term of the loss (so the gradient of its estimator counts: not k1's)."""
    return placement == "loss"


SIGNALS = ("task", "kl", "teacher")
"""The per-token streams of a step's experience, each made by its source (``train/experience.py``): the task reward on
the last token, the KL to the reference, a teacher's d_t = log π_T(y_t) − log π_old(y_t)."""
DISTILL_BASELINES = {"loo": "b_i = the mean over the group's other samples of their mean d", "none": "b_i = 0"}
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("none", "token-tis", "sequence-tis", "sequence-mask")
STANDARD_DEVIATIONS = {
    "population": "divide by K, this project's default",
    "unbiased": "divide by K − 1, as verl, OpenRLHF and TRL: advantages 1/1.155 as large at K = 4",
    "none": "no division, A_i = r_i − mean r (Dr. GRPO's advantage; TRL's scale_rewards none)",
}


def described(choices: dict) -> str:
    """``a (what a does), b (…)``: a help text made from a list of choices."""
    return ", ".join(f"{name} ({text})" for name, text in choices.items())


@dataclass(frozen=True)
class CandidateTwin:
    """The algorithm at the candidate level (docs/candidate-protocol.md); its advantage is in ``candidate.py``."""

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
    """Key in ``POLICY_LOSSES`` (registered in ``algorithms/losses.py``): the default of --policy-loss."""
    kl: str
    """The default --kl-in (``KL_PLACEMENTS``) at the generation level."""
    formula: str
    """One line for the docs."""
    citation: str
    kl_estimator: str = "k1"
    """The default --kl-estimator where the record puts the KL (``kl_estimator_for``)."""
    aggregation: str = "sequence"
    """Key in ``AGGREGATIONS``: the default --loss-aggregation."""
    reused_batch_loss: str = "clipped-token"
    """The loss when a batch serves several updates and the record's own is ratio-free (``RATIO_FREE_LOSSES``)."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 − ε_low (the default of --clip-low)."""
    clip_high: float = 0.2
    """ε_high: clipped above at 1 + ε_high (--clip-high)."""
    std: str | None = None
    """The default --std (``STANDARD_DEVIATIONS``) of the GRPO family; None: no division, and --std is refused."""
    needs_critic: bool = False
    """A learned value model V(s_t) (PPO): loaded, trained and checkpointed beside the policy."""
    needs_greedy: bool = False
    """The reward of each prompt's greedy completion (ReMax's baseline)."""
    reduction: str = "mean"
    """mean: the loss is averaged over completions; sum: summed within each group (RAFT's best of K)."""
    whiten: bool = False
    """Advantages whitened over the global batch, every rank's tokens together (--no-whiten-advantages: not)."""
    moving_average: float | None = None
    """Decay of the loop's baseline across steps (REINFORCE), updated after the estimator used it."""
    min_group_size: int = 1
    """Smallest K the estimator is defined for (2 when the baseline uses the other samples)."""
    rollout_correction: str = "sequence-tis"
    """The default --rollout-correction when another engine samples: sequence-tis where the action is the whole
    completion (A_i · ∇log π(y_i|x)), token-tis for token-level estimators and losses (PPO, GAE, the GRPO family)."""
    overlong_buffer_fraction: float = 0.0
    """DAPO's soft overlong buffer L by default, a fraction of --max-new-tokens rounded down (DAPO: 0.2); 0: off."""
    dynamic_sampling: bool = False
    """The default of --dynamic-sampling (DAPO; train/dynamic.py)."""
    rewards: tuple[str, ...] = ("task",)
    """The streams (``SIGNALS``) summed into the estimator's per-token reward (the KL joins where --kl-in puts it);
    without ``task`` a run needs no task reward."""
    dense: tuple[str, ...] = ("teacher",)
    """The streams added per token to the estimator's advantage, λ·(s_t − b_i), when the run has them (a teacher's)."""
    candidate: CandidateTwin | None = None

    def kl_estimator_for(self, placement: str) -> str:
        """The default KL estimator for a placement: the record's own where it puts the KL itself; else k3 in the
        loss (k1's expected gradient as a loss term is zero), k1 elsewhere."""
        if placement == self.kl:
            return self.kl_estimator
        return "k3" if kl_in_loss(placement) else "k1"

    def loss_for(self, several_updates: bool) -> str:
        """The record's policy loss, or ``reused_batch_loss`` when a batch serves several updates and it needs
        ratio 1."""
        return self.reused_batch_loss if several_updates and self.policy_loss in RATIO_FREE_LOSSES else self.policy_loss


REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in REGISTRY:
        raise ValueError(f"algorithm {algorithm.name!r} is registered twice")
    for key, choices in ((algorithm.policy_loss, POLICY_LOSSES), (algorithm.reused_batch_loss, POLICY_LOSSES),
                         (algorithm.aggregation, AGGREGATIONS), (algorithm.kl, KL_PLACEMENTS),
                         (algorithm.kl_estimator, KL_ESTIMATORS), (algorithm.rollout_correction, ROLLOUT_CORRECTIONS),
                         (algorithm.std, (None, *STANDARD_DEVIATIONS)),
                         *((stream, SIGNALS) for stream in algorithm.rewards + algorithm.dense)):
        if key not in choices:
            raise ValueError(f"algorithm {algorithm.name!r} names {key!r}, which is not one of {', '.join(map(str, choices))}")
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown algorithm {name!r}; choose one of: {', '.join(REGISTRY)}") from None


def names_by(attribute: str) -> dict:
    """value of a record field → the algorithms that have it, in registry order (for help texts and docs)."""
    grouped: dict = {}
    for name, algorithm in REGISTRY.items():
        grouped.setdefault(getattr(algorithm, attribute), []).append(name)
    return grouped


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
    name="ppo-rlhf", advantage="gae", policy_loss="clipped-token", kl="reward", needs_critic=True, whiten=True,
    rollout_correction="token-tis", min_group_size=2,
    formula="GAE per token on r_t = score·[t = last] − β·kl_t, V a learned critic; advantages whitened over the "
            "batch; clipped surrogate of ρ_t A_t",
    citation="Schulman et al., 2017; Ouyang et al., 2022",
    candidate=CandidateTwin("ppo", "clipped", "loss", "rollout"),
))
register(Algorithm(
    name="grpo", advantage="grpo", policy_loss="clipped-token", kl="loss", kl_estimator="k3", std="population",
    min_group_size=2, rollout_correction="token-tis",
    formula="A_i = (r_i − mean r) / (std r + 1e−6); clipped surrogate of ρ_t A_i; KL penalty in the loss (k3)",
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
    name="reinforce-pp", advantage="reinforce-pp", policy_loss="clipped-token", kl="reward", whiten=True,
    rollout_correction="token-tis",
    formula="A_t = whiten(G_t) over the global batch, G_t = Σ_{s≥t} r_s, r_s = score·[s = last] − β·kl_s; "
            "clipped surrogate",
    citation="Hu et al., 2025 (arXiv 2501.03262)",
))
register(Algorithm(
    name="reinforce-pp-baseline", advantage="reinforce-pp-baseline", policy_loss="clipped-token", kl="reward", whiten=True,
    rollout_correction="token-tis", min_group_size=2,
    formula="as reinforce-pp, with the group's mean score subtracted from each score first",
    citation="Hu et al., 2025 (arXiv 2501.03262); OpenRLHF's reinforce_baseline",
))

# --- the loss variants of 2025 (generation level only) -------------------------------------------------------

register(Algorithm(
    name="dr-grpo", advantage="dr-grpo", policy_loss="clipped-token", kl="none", aggregation="constant",
    min_group_size=2, rollout_correction="token-tis",
    formula="A_i = r_i − mean r (no std); clipped surrogate of ρ_t A_i summed over tokens / (completions × "
            "max-new-tokens), a constant normaliser (no length bias); no KL, as the paper's objective",
    citation="Liu et al., 2025, Understanding R1-Zero-Like Training: A Critical Perspective (arXiv 2503.20783)",
))
register(Algorithm(
    name="dapo", advantage="grpo", policy_loss="clipped-token", kl="none", std="population",
    aggregation="token-mean", clip_low=0.2, clip_high=0.28, overlong_buffer_fraction=0.2, dynamic_sampling=True,
    min_group_size=2, rollout_correction="token-tis",
    formula="A_i = (r_i − mean r) / (std r + 1e−6) on r plus the soft overlong penalty; clipped surrogate with "
            "clip-higher (ε_low 0.2, ε_high 0.28), token-mean; no KL; dynamic sampling",
    citation="Yu et al., 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale (arXiv 2503.14476)",
))
register(Algorithm(
    name="gspo", advantage="grpo", policy_loss="gspo", kl="none", std="population",
    aggregation="sequence-mean-token-mean", clip_low=3e-4, clip_high=4e-4, min_group_size=2,
    formula="s_i = (π(y_i|x)/π_old(y_i|x))^(1/|y_i|); 1/G Σ_i min(s_i A_i, clip(s_i, 1 − 3e−4, 1 + 4e−4) A_i), "
            "A_i as grpo; no KL",
    citation="Zheng et al., 2025, Group Sequence Policy Optimization (arXiv 2507.18071)",
))
register(Algorithm(
    name="cispo", advantage="grpo", policy_loss="cispo", kl="none", std="population", aggregation="token-mean",
    clip_low=1.0, clip_high=0.28, min_group_size=2, rollout_correction="token-tis",
    formula="Σ_i Σ_t sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) A_i log π(y_t) / Σ_i |y_i|, A_i as grpo; no lower "
            "bound (ε_low 1), ε_high 0.28; no KL",
    citation="MiniMax, 2025, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention "
             "(arXiv 2506.13585)",
))
register(Algorithm(
    name="opd", advantage="rloo", policy_loss="vanilla", kl="none", rewards=(), min_group_size=2,
    formula="Â_{i,t} = λ (d_{i,t} − b_i), d = sg(log π_T − log π_old) at each sampled token, b_i = mean_{j≠i} "
            "mean_t d_{j,t}; no task reward (needs --teacher-model)",
    citation="on-policy distillation: Agarwal et al., 2024 (GKD, arXiv 2306.13649); Qwen3 (arXiv 2505.09388)",
))
