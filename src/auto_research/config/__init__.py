"""Run settings as dataclasses with the paper's names, validated once, and the command-line flags made from them.

One module a kind: ``candidate`` and ``generation`` (a run at either level), ``options`` (post-train's and
compare's options across runs), ``recipes`` (data, sft, reward-model, rlhf), ``fields`` (what they are made
of, and the checks they share), ``files`` (``--config``). Light by design: nothing here imports NumPy or
torch, so ``--help`` and every check of the settings run before anything heavy is loaded.
"""
