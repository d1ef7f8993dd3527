"""Run settings as dataclasses with the paper's names, validated once, and the command-line flags made from them.
Nothing here imports NumPy or torch, so ``--help`` and every check of the settings run before anything heavy.
"""
