"""Starting the rollout side of a run (rollouts.py) from its components: what it needs of them, and which
queue.
"""

from __future__ import annotations

from auto_research.engine.rollout.builtin import sample
from auto_research.train.components import Components
from auto_research.train.rollouts import RolloutSource, Synchronous
from auto_research.train.state import LoopState


def rollout_source(c: Components, sampler, model, context) -> RolloutSource:
    config, world = c.config, c.world
    greedy = None
    if c.algorithm.needs_greedy:
        def greedy(prompts):
            with context():
                return sample(model, c.tokenizer, prompts, 1, config.max_new_tokens, greedy=True)
    return RolloutSource(c.train_prompts, c.task.train, config.seed, config.prompts_per_step, config.group_size,
                         lambda picks: world.share(picks, config.ppo_mini_batches), sampler, c.reward, greedy)


def start_rollouts(c: Components, state: LoopState):
    """The rollout side of a run at its current step: synchronous (the queue of depth 0)."""
    c.rollouts = Synchronous(rollout_source(c, c.sampler, c.policy, c.sampling), state.rng, state.step)
    return c.rollouts
