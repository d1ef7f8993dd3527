"""The sampler/trainer mismatch, measured and corrected: another engine samples y ~ μ while the trainer takes the
gradient of π, so each sample's term is weighted by π/μ truncated at a cap C (truncated importance sampling, Yao et
al., 2025), by the modes of docs/vllm.md's table. Weights are constants in the loss (no gradient). Shapes: (B, T),
``mask`` 1 on the completion's tokens.
"""

from __future__ import annotations

import math

import torch

from auto_research.errors import RewardError

VANISHED = 1e-6
"""Below this, every correction weight of a step means the sampler's log-probs do not describe the policy."""


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """(B, T) weights of each token's loss term (see the module docstring), 0 where masked."""
    log_ratio = (log_ratio * mask).detach().double()
    if mode == "none":
        weights = torch.ones_like(log_ratio)
    elif mode == "token-tis":
        weights = log_ratio.exp().clamp(max=cap)
    elif mode == "sequence-tis":
        weights = log_ratio.sum(-1, keepdim=True).clamp(max=math.log(cap)).exp().expand_as(log_ratio)
    elif mode == "sequence-mask":
        weights = (log_ratio.sum(-1, keepdim=True).abs() <= math.log(cap)).double().expand_as(log_ratio)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    return (weights * mask).float()


def mismatch(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Sums over this process's tokens (reduce over ranks, then divide by ``tokens``): |log π − log μ| and its
    maximum, and k3 = r − 1 − log r with r = π/μ per token, an unbiased estimate of KL(μ ‖ π) from μ's samples."""
    log_ratio = ((trainer_logprobs - sampler_logprobs) * mask).double()
    difference = log_ratio.abs()
    k3 = (log_ratio.exp() - 1 - log_ratio) * mask
    return {"absolute": difference.sum(), "maximum": difference.max() if difference.numel() else difference.sum(),
            "k3": k3.sum(), "tokens": mask.double().sum()}


def drops_samples(mode: str) -> bool:
    """Whether a correction's weight of 0 drops a sample on purpose (sequence-mask) rather than vanishing."""
    return mode == "sequence-mask"


def check_weights(world, weights: torch.Tensor, mask: torch.Tensor) -> None:
    """A ``RewardError`` on every rank when every weight of a step is below ``VANISHED`` on every rank's trained
    tokens: the sampler's log-probs are far from the policy's, and the run would go on learning nothing."""
    trained = mask.bool()
    counts = world.total(torch.tensor([float((weights[trained] >= VANISHED).sum()), float(trained.sum())],
                                      dtype=torch.float64))
    kept, tokens = counts.tolist()
    if tokens and not kept:
        largest = float(weights[trained].max()) if bool(trained.any()) else 0.0
        raise RewardError(f"every rollout-correction weight of this step is below {VANISHED:g} (the largest here "
                          f"{largest:.3g}): the sampler's log-probs do not match the policy's, a mismatch, not "
                          "learning (check the log-probs the sampler or the --rollout-function returns; "
                          "--rollout-correction sequence-tis multiplies a whole completion's ratios, where "
                          "token-tis truncates each token's)")
