"""The candidate-level loop: π = softmax(Φ·w) over 6 candidates, w ∈ R^8 from zero, the reference the initial w.
Each step samples K candidates of one problem, asks the registered algorithm for advantages, and takes
w ← w + lr · clip(g, −5, 5). Random draws follow docs/candidate-protocol.md exactly: figures reproduce to the digit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from auto_research.algorithms.candidate import (ADVANTAGES, LOG_EPSILON, AdvantageInputs, clipped_surrogate,
                                                update_moving_average)
from auto_research.algorithms.registry import get_algorithm, kl_in_loss
from auto_research.candidate.groups import CandidateGroups, arithmetic_groups, gsm8k_groups
from auto_research.config.candidate import CandidateConfig
from auto_research.data.gsm8k import ensure_gsm8k, read_gsm8k
from auto_research.data.registry import TaskRecord, task_record
from auto_research.errors import UserError

EPS = LOG_EPSILON


@dataclass(frozen=True)
class CandidateData:
    train: CandidateGroups
    validation: CandidateGroups
    source: str


def load_data(config: CandidateConfig) -> CandidateData:
    """Train and validation groups for the configured dataset (its record's loader), drawn in protocol order."""
    return task_record(config.dataset, "candidate").load(config)


def arithmetic_data(record: TaskRecord, config: CandidateConfig) -> CandidateData:
    """``arithmetic-smoke``: problems generated from the run's seed."""
    n = config.maximum_examples
    rng = np.random.default_rng(config.seed)
    train = arithmetic_groups(n, rng)
    validation = arithmetic_groups(max(64, n // 4), rng)
    return CandidateData(train, validation, f"embedded {record.name} (generated from seed {config.seed})")


def gsm8k_data(record: TaskRecord, config: CandidateConfig) -> CandidateData:
    """``gsm8k-candidate``: GSM8K's first problems, their distractors drawn from the seed."""
    n = config.maximum_examples
    directory = ensure_gsm8k(config.dataset_dir, config.offline)
    train_rows = read_gsm8k(directory / "train.jsonl", n)
    validation_rows = read_gsm8k(directory / "test.jsonl", max(32, n // 4))
    source = (f"GSM8K {directory.resolve()} (train.jsonl first {len(train_rows)} rows, "
              f"test.jsonl first {len(validation_rows)} rows)")
    return CandidateData(gsm8k_groups([row.gold for row in train_rows], config.seed),
                         gsm8k_groups([row.gold for row in validation_rows], config.seed + 1), source)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exponentials = np.exp(shifted)
    return exponentials / exponentials.sum(axis=-1, keepdims=True)


def draw_without_replacement(rng: np.random.Generator, logits: np.ndarray, probabilities: np.ndarray, K: int) -> np.ndarray:
    """K distinct candidates drawn one after another, each in proportion to π over those left: numpy's
    ``choice(replace=False)`` (every ordinary run: the protocol's draws), or, where the softmax has underflowed to
    fewer than K non-zero entries (a very large learning rate), one by one from the remaining logits' softmax."""
    if np.count_nonzero(probabilities) >= K:
        return rng.choice(len(probabilities), size=K, replace=False, p=probabilities)
    remaining = list(range(len(logits)))
    chosen = []
    for _ in range(K):
        pick = remaining[rng.choice(len(remaining), p=softmax(logits[remaining]))]
        chosen.append(pick)
        remaining.remove(pick)
    return np.array(chosen)


def evaluate(groups: CandidateGroups, weights: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Greedy accuracy and reward, entropy and KL(π ‖ π_ref), averaged over the groups."""
    policy = softmax(groups.features @ weights)
    reference_policy = softmax(groups.features @ reference)
    greedy = policy.argmax(axis=-1)  # first index on ties
    return {
        "accuracy": float(np.mean(greedy == groups.gold)),
        "mean_reward": float(np.mean(groups.rewards[np.arange(len(greedy)), greedy])),
        "entropy": float(np.mean(-(policy * np.log(policy + EPS)).sum(axis=-1))),
        "kl_from_reference": float(np.mean((policy * np.log((policy + EPS) / (reference_policy + EPS))).sum(axis=-1))),
    }


@dataclass
class _State:
    """What the loop carries from one step to the next. The reference is the initial w, frozen; ``rollout`` is the
    sampler's copy of w for algorithms that sample from a stale policy (refreshed every --rollout-refresh steps);
    ``moving_average`` is the loop's baseline for an algorithm with a moving_average decay (REINFORCE)."""

    weights: np.ndarray
    reference: np.ndarray
    rollout: np.ndarray
    critic: np.ndarray
    moving_average: float = 0.0
    critic_updates: int = 0
    rollout_refreshes: int = 0


@dataclass(frozen=True)
class _Drawn:
    """One step's K sampled candidates and the three distributions over the group they were judged under."""

    sampled: np.ndarray
    policy: np.ndarray
    reference_policy: np.ndarray
    sampler: np.ndarray


def train(config: CandidateConfig, data: CandidateData) -> dict:
    """Draw a problem → sample K → advantages → step the policy (and critic), ``config.steps`` times; validation
    figures at step 1 and every tenth of the run. Returns the metrics.json payload."""
    algorithm = get_algorithm(config.algorithm)
    rng = np.random.default_rng(config.seed)
    weights = np.zeros(data.train.features.shape[-1])
    state = _State(weights, weights.copy(), weights.copy(), np.zeros(weights.shape[0]))
    every = max(1, config.steps // 10)
    history = []
    # A diverging run (a huge learning rate) is reported in one line by _check_finite, not by NumPy's warnings.
    with np.errstate(over="ignore", invalid="ignore"):
        baseline = evaluate(data.validation, state.weights, state.reference)
        for step in range(1, config.steps + 1):
            loss = _step(config, algorithm, data.train, state, rng)
            _check_finite(config, state, step)
            if algorithm.candidate.samples_from == "rollout" and step % config.rollout_refresh == 0:
                state.rollout = state.weights.copy()
                state.rollout_refreshes += 1
            if step == 1 or step % every == 0:
                history.append({"step": float(step), "loss": loss, **evaluate(data.validation, state.weights,
                                                                                state.reference)})
        return _payload(config, data, algorithm, state, baseline, history)


def _step(config: CandidateConfig, algorithm, train: CandidateGroups, state: _State, rng: np.random.Generator) -> float:
    """One group: a random problem, K candidates drawn, their advantages, then the critic's and the policy's
    steps; the step's loss. The random draws come in the protocol's order (problem, then candidates)."""
    index = rng.integers(0, len(train))
    phi, group_rewards = train.features[index], train.rewards[index]
    drawn = _draw(rng, algorithm.candidate, phi, state, config.group_size)
    values = phi[drawn.sampled] @ state.critic if algorithm.needs_critic else None
    inputs = AdvantageInputs(
        rewards=group_rewards[drawn.sampled], beta=config.beta, values=values, baseline=state.moving_average,
        log_ratio=np.log((drawn.policy[drawn.sampled] + EPS) / (drawn.reference_policy[drawn.sampled] + EPS)),
        greedy_rewards=group_rewards[int(np.argmax(drawn.policy))] if algorithm.needs_greedy else None)
    advantages = ADVANTAGES[algorithm.candidate.advantage](inputs)
    if algorithm.moving_average is not None:
        # The baseline moves after it has been used, so b never contains this step's rewards.
        state.moving_average = update_moving_average(state.moving_average, inputs.shaped(), algorithm.moving_average,
                                                     inputs.mask)
    gradient, loss = _policy_gradient(config, algorithm.candidate, phi, drawn, advantages)
    if algorithm.needs_critic:
        state.critic = state.critic + config.learning_rate * np.mean((inputs.rewards - values)[:, None]
                                                                      * phi[drawn.sampled], axis=0)
        state.critic_updates += 1
    state.weights = state.weights + config.learning_rate * np.clip(gradient, -config.gradient_clip,
                                                                   config.gradient_clip)
    return loss


def _draw(rng: np.random.Generator, twin, phi: np.ndarray, state: _State, K: int) -> _Drawn:
    """K distinct candidates from the sampler: the current policy, or the stale rollout copy."""
    policy = softmax(phi @ state.weights)
    reference_policy = softmax(phi @ state.reference)
    sampler_logits = phi @ state.rollout if twin.samples_from == "rollout" else phi @ state.weights
    sampler = softmax(phi @ state.rollout) if twin.samples_from == "rollout" else policy
    return _Drawn(draw_without_replacement(rng, sampler_logits, sampler, K), policy, reference_policy, sampler)


def _policy_gradient(config: CandidateConfig, twin, phi: np.ndarray, drawn: _Drawn,
                     advantages: np.ndarray) -> tuple[np.ndarray, float]:
    """The gradient of the twin's objective in w, and its loss: a plain or clipped policy gradient, averaged or
    summed over the K samples, with the KL term's own gradient when the KL sits in the loss."""
    sampled, policy = drawn.sampled, drawn.policy
    # ∇_w log π(i) = φ_i − E_π[φ] for a linear softmax.
    score = phi[sampled] - policy @ phi
    if twin.objective == "clipped":
        ratio = policy[sampled] / (drawn.sampler[sampled] + EPS)
        surrogate = clipped_surrogate(ratio, advantages, config.clip_range)
        # Where the clip binds, the surrogate is flat in w and contributes nothing.
        active = np.isclose(surrogate, ratio * advantages)
        weight = advantages * ratio * active
        loss = -float(np.mean(surrogate))
    else:
        weight = advantages
        loss_terms = advantages * np.log(policy[sampled] + EPS)
        loss = -float(np.mean(loss_terms) if twin.reduction == "mean" else np.sum(loss_terms))
    gradient = (weight[:, None] * score).sum(axis=0)
    if twin.reduction == "mean":
        gradient = gradient / config.group_size
    if kl_in_loss(twin.kl):
        # Exact gradient of the forward KL(π_ref ‖ π) over all 6 candidates (a protocol quirk).
        gradient = gradient - config.beta * phi.T @ (policy - drawn.reference_policy)
    return gradient, loss


def _check_finite(config: CandidateConfig, state: _State, step: int) -> None:
    """A diverged run (weights no longer finite) stops in one line that names the step size to lower."""
    if np.isfinite(state.weights).all() and np.isfinite(state.critic).all():
        return
    part = "critic's weights (it takes the same step size)" if not np.isfinite(state.critic).all() else "policy weights"
    raise UserError(f"{config.algorithm} diverged at step {step}: the {part} are no longer finite at "
                    f"--learning-rate {config.learning_rate:g}; lower it (default {CandidateConfig.learning_rate})")


def _payload(config: CandidateConfig, data: CandidateData, algorithm, state: _State, baseline: dict,
             history: list) -> dict:
    """metrics.json: the untrained and final validation figures, the run's settings and counters, the history."""
    final = evaluate(data.validation, state.weights, state.reference)
    diagnostics = {"critic_updates": state.critic_updates, "rollout_refreshes": state.rollout_refreshes}
    if algorithm.moving_average is not None:
        diagnostics["final_moving_average_baseline"] = state.moving_average
    return {
        "algorithm": config.algorithm, "dataset": config.dataset, "level": "candidate", "seed": config.seed,
        "baseline": baseline, "final": final,
        "relative_accuracy": (final["accuracy"] - baseline["accuracy"]) / max(baseline["accuracy"], 1e-12),
        "training": {
            "steps": config.steps, "learning_rate": config.learning_rate, "group_size": config.group_size,
            "beta": config.beta, "train_examples": len(data.train), "validation_examples": len(data.validation),
            "data_source": data.source, "policy": "linear softmax over 6 candidates, 8 features",
            "final_weights": [float(value) for value in state.weights], **diagnostics,
        },
        "history": history,
    }
