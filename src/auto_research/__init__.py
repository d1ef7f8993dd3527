"""auto-research: RL post-training of language models, centred on RLOO.

RLOO is REINFORCE with a leave-one-out baseline and a KL-shaped reward
(Ahmadian et al., 2024, "Back to Basics", arXiv 2402.14740).
"""

__version__ = "0.1.0"
