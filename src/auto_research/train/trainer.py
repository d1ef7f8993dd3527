"""A run's components and loop state together, for Python and for tests: build once, then step and
evaluate. One wiring path: the command line and ``post_train()`` open a run with the same ``open_run``, then put
the run folder's lock and the loop (``RunLoop``, whose steps are ``rl_step``, as ``Trainer.step``'s) around it
(recipes/post_train.py, recipes/generation_run.py); this class writes nothing but the model cache and, in server
mode, the lease's secret in the run folder (it checks the run folder as a run does: an earlier run there is
refused unless resume or overwrite is set)."""

from __future__ import annotations

from auto_research.config.generation import GenerationConfig
from auto_research.engine.distributed import World
from auto_research.engine.rollout import Rollout
from auto_research.errors import UserError
from auto_research.train.components import Components, build_components
from auto_research.train.evaluation import held_out
from auto_research.train.schedule import open_side, rollout_source
from auto_research.train.loop import restore
from auto_research.train.prepare import Prepared, prepare
from auto_research.train.rollouts import draw_batch, sample_batch
from auto_research.train.state import LoopState
from auto_research.train.step import rl_step
from auto_research.train.warm_start import model_for


def open_run(prepared: Prepared, world: World, log=print) -> tuple[Components, LoopState]:
    """A prepared run's components and loop state: the models built (from the task's warm start where it has one)
    and, on --resume, the checkpoint's weights, optimizer states and loop state restored; then the run's rollout
    side, built once (``schedule.open_side``; it draws from the first step on). The command line and
    ``post_train`` (``recipes/generation_run.py``) and ``Trainer`` all open a run here. (The side travels in
    ``Components.rollouts`` to the loop that owns it, until the run's values replace that bag.)"""
    config = prepared.config
    model = model_for(config.policy.model, config.data.offline, config.logging.progress, prepared.task, world, log)
    components = build_components(prepared, model, world, log)
    state = LoopState.fresh(config.run.seed)
    try:
        saved = restore(components, state, prepared.resume_from, log) if prepared.resume_from is not None else ()
        components.rollouts = open_side(components, state, *saved)
    except BaseException:
        components.sampler.close()  # a server's lease is given back
        raise
    return components, state


class Trainer:
    def __init__(self, components: Components, state: LoopState, log=print):
        self.components, self.state, self.log = components, state, log
        self.side = components.rollouts

    @classmethod
    def build(cls, config: GenerationConfig, log=print, rows: list[dict] | None = None, reward_functions=(),
              world: World | None = None, environment=None, tools=(), rollout_function=None) -> "Trainer":
        """``environment``/``tools``: a factory and functions from Python (as --environment and --tools);
        ``rollout_function``: ``fn(rows, context)``, as --rollout-function (envs.custom)."""
        config = config.filled()
        world = world or World.from_environment(config.policy.fsdp)
        prepared = prepare(config, log, rows, reward_functions, world.size, environment, tools, rollout_function)
        return cls(*open_run(prepared, world, log), log)

    def sample(self, step: int) -> Rollout:
        """The rollout a step would train on: its prompts drawn from the loop's generator, then sampled (with
        --max-staleness 0; in flight, the rollout side's thread owns the generator)."""
        c = self.components
        if self.side.started and c.config.rollout.max_staleness:
            raise UserError("Trainer.sample draws as a synchronous step does (--max-staleness 0): with rollouts in "
                            "flight the rollout side's thread owns the prompt generator and the sampler (over several "
                            "servers, each holds its own version); call it before the first step")
        source = rollout_source(c, c.sampler, c.policy, c.sampling)
        return sample_batch(source, draw_batch(source, self.state.rng, step))

    def step(self, step: int) -> dict:
        return rl_step(self.components, self.state, step, self.side, self.log)

    def evaluate(self, completions: dict | None = None) -> dict:
        return held_out(self.components, completions)

    def close(self) -> None:
        """Stop the rollout side's thread (--max-staleness ≥ 1) and close the sampler (a rollout server's lease
        is given back: another run may use the server at once)."""
        try:
            self.side.close()
        finally:
            self.components.sampler.close()
