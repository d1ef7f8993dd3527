"""auto-research: RL post-training of language models, centred on RLOO.

RLOO is REINFORCE with a leave-one-out baseline and a KL-shaped reward
(Ahmadian et al., 2024, "Back to Basics", arXiv 2402.14740).
"""

__version__ = "0.1.0"
__all__ = ["GenerationConfig", "Trainer", "post_train"]
_MODULES = {"post_train": "auto_research.api", "Trainer": "auto_research.api",
            "GenerationConfig": "auto_research.config.generation"}


def __getattr__(name: str):
    """``from auto_research import post_train, Trainer, GenerationConfig``, imported on first use: the command line
    (``--help`` above all) imports this package and must not pay for what the Python API needs."""
    if name not in _MODULES:
        raise AttributeError(f"module 'auto_research' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_MODULES[name]), name)
