"""The generation level: RLOO on Hugging Face causal language models.

Everything here imports torch and transformers; nothing outside this package
imports it at module level, so candidate-level runs never pay for them.
"""
