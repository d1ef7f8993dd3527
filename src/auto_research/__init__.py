"""auto-research: RL post-training of language models, centred on RLOO.

RLOO is REINFORCE with a leave-one-out baseline and a KL-shaped reward
(Ahmadian et al., 2024, "Back to Basics", arXiv 2402.14740).
"""

__version__ = "0.1.0"
__all__ = ["GenerationConfig", "Trainer", "post_train"]


def __getattr__(name: str):
    """``from auto_research import post_train, Trainer, GenerationConfig``, imported on first use: the command line
    (``--help`` above all) imports this package and must not pay for what the Python API needs."""
    if name == "post_train":
        from auto_research.api import post_train

        return post_train
    if name == "Trainer":
        from auto_research.api import Trainer

        return Trainer
    if name == "GenerationConfig":
        from auto_research.config.generation import GenerationConfig

        return GenerationConfig
    raise AttributeError(f"module 'auto_research' has no attribute {name!r}")
