"""A checkpoint's batches in flight (``--max-staleness``), to and from its files: each ``Drawn``'s tensors keyed
``i/name`` and its plain values (safetensors and JSON: nothing unpickled), and back."""

from __future__ import annotations

from auto_research.engine.rollout import Rollout
from auto_research.rewards.combine import Scored
from auto_research.train.rollouts import Drawn, RolloutSource, batch_of
from auto_research.train.signals import RowScores


_TENSORS = ("sequences", "prompt_mask", "completion_mask", "sampler_logprobs", "sampler_entropy", "policy_versions",
            "loss_mask", "token_versions")


def to_files(batches: list[Drawn]) -> tuple[dict, list]:
    """This rank's batches in flight as tensors (keyed ``i/name``) and plain values."""
    tensors, plain = {}, []
    for index, drawn in enumerate(batches):
        for name in _TENSORS:
            value = getattr(drawn.rollout, name)
            if value is not None:
                tensors[f"{index}/{name}"] = value.detach().clone().contiguous()
        if drawn.reference_logprobs is not None:
            tensors[f"{index}/reference_logprobs"] = drawn.reference_logprobs.detach().clone().contiguous()
        for name, outside in drawn.outside.items():  # a resumed run asks no teacher (nothing outside) again
            tensors[f"{index}/outside/{name}"] = outside.values.detach().clone().contiguous()
        plain.append({"step": drawn.step, "indices": drawn.batch.indices, "seeds": drawn.batch.seeds,
                      "completions": drawn.rollout.completions, "group_size": drawn.rollout.group_size,
                      "trained_distribution": drawn.rollout.trained_distribution, "rewards": drawn.rewards,
                      "reward_parts": getattr(drawn.rewards, "parts", None),
                      "reward_causes": getattr(drawn.rewards, "causes", None),
                      "greedy_rewards": drawn.greedy_rewards, "failure": drawn.failure,
                      "numpy_after": drawn.numpy_after, "seconds": drawn.seconds, "counts": drawn.counts,
                      "episodes": drawn.rollout.episodes,
                      "outside": {name: {"failures": outside.failures, "counts": outside.counts}
                                  for name, outside in drawn.outside.items()}})
    return tensors, plain


def from_files(source: RolloutSource, tensors: dict, plain: list) -> list[Drawn]:
    batches = []
    for index, saved in enumerate(plain):
        parts = {name: tensors.get(f"{index}/{name}") for name in _TENSORS}
        rollout = Rollout(parts["sequences"], parts["prompt_mask"], parts["completion_mask"], saved["completions"],
                          saved["group_size"], parts["sampler_logprobs"], parts["sampler_entropy"],
                          saved["trained_distribution"], parts["policy_versions"], parts["loss_mask"],
                          saved.get("episodes"), parts["token_versions"])
        rewards = saved["rewards"] if saved["rewards"] is None else Scored(
            saved["rewards"], saved.get("reward_parts"), saved.get("reward_causes"))
        batches.append(Drawn(saved["step"], batch_of(source, saved["indices"], saved["seeds"]), rollout,
                             rewards, saved["greedy_rewards"], saved["failure"], saved["numpy_after"],
                             saved["seconds"], tensors.get(f"{index}/reference_logprobs"), saved.get("counts"),
                             {name: RowScores(tensors[f"{index}/outside/{name}"], kept["failures"], kept["counts"])
                              for name, kept in saved.get("outside", {}).items()}))
    return batches
