"""The engine: models and their sources, LoRA, log-probs, several processes, checkpoints, and rollout (the
Sampler seam with its builtin decoding loop)."""
