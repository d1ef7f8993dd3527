"""Per-token log-probabilities of completions: the one function that the
policy, the frozen reference and PPO's old policy all go through.

A batch row is ``[left-padded prompt | completion]``: ``sequences`` has shape
(B, P + C), the prompt occupies the first P columns, and ``completion_mask``
(B, C) marks the completion tokens that count (up to and including the first
EOS). Position ids are derived from the attention mask, so left padding and
anything after EOS change nothing, and the numbers match what ``generate``
sampled from.
"""

from __future__ import annotations

import inspect

import torch


def attention_for(sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mask and position ids for ``[prompt | completion]`` rows."""
    attention = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return attention, positions


def completion_logits(model, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """(B, C, V) float logits, divided by the temperature, that predict each completion token."""
    completion_length = completion_mask.shape[1]
    attention, positions = attention_for(sequences, prompt_mask, completion_mask)
    # The logit at position t predicts token t + 1: only the last C + 1 positions are needed (the
    # very last predicts past the end), so the output layer skips every prompt position.
    keep = {"logits_to_keep": completion_length + 1} if accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions, use_cache=False, **keep).logits
    logits = logits[:, -(completion_length + 1) : -1].float()
    return logits / temperature if temperature != 1.0 else logits


def accepts(model, argument: str) -> bool:
    """Whether the model under any wrappers (DDP, PEFT, a LoRA reference) takes ``argument`` in forward."""
    inner = model
    for _ in range(6):
        forward = getattr(inner, "forward", None)
        if forward is not None:
            parameters = inspect.signature(forward).parameters
            if argument in parameters:
                return True
            if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
                return False
        inner = next((getattr(inner, name) for name in ("module", "model", "base_model") if hasattr(inner, name)), None)
        if inner is None:
            return False
    return False


def completion_values(critic, sequences: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) the critic's value V(s_t) of the state before each completion token; 0 where masked.

    The critic is a token-classification model with one label: its output at
    position t reads the prompt and y_<t+1… so, as for log-probs, the output one
    position earlier is the value of the state in which y_t is chosen.
    """
    prompt_length = prompt_mask.shape[1]
    attention, positions = attention_for(sequences, prompt_mask, completion_mask)
    scores = critic(input_ids=sequences, attention_mask=attention, position_ids=positions).logits[..., 0]
    return scores[:, prompt_length - 1 : -1].float() * completion_mask.to(torch.float32)


def token_logprobs(
    model,
    sequences: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """log π(y_t | x, y_<t) for each completion token, shape (B, C); 0 where masked.

    Logits are divided by the sampling temperature, so the policy trained is the
    one that sampled. With ``with_entropy`` also returns the per-token entropy
    of that distribution (no gradient).
    """
    logits = completion_logits(model, sequences, prompt_mask, completion_mask, temperature)
    targets = sequences[:, prompt_mask.shape[1] :]
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    mask = completion_mask.to(chosen.dtype)
    chosen = chosen * mask
    if not with_entropy:
        return chosen
    with torch.no_grad():
        log_p = logits - normaliser.unsqueeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) * mask
    return chosen, entropy


def kl_per_token(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Sampled estimators of KL(π ‖ π_ref) per token (Schulman, 2020, "Approximating KL divergence").

    With log r = log π_ref − log π on a token sampled from π:
    k1 = −log r (unbiased, the paper's shaping), k2 = ½ (log r)² and
    k3 = (r − 1) − log r (unbiased and non-negative, the GRPO choice).
    """
    log_ratio = reference_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return log_ratio.exp() - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")
