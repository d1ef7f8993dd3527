"""Recipes: what each command does, from settings to outputs — post-train (both levels), compare, sft,
reward-model training, preference pairs and the whole rlhf pipeline."""
