"""A run's frozen values, rollout side and loop state together, for Python and for tests: build once, then step and
evaluate. The command line and ``post_train()`` open a run with the same ``open_run``; ``Trainer`` writes nothing but
the model cache and, in server mode, the lease's secret in the run folder."""

from __future__ import annotations

from auto_research.config.generation import GenerationConfig
from auto_research.engine.distributed import World
from auto_research.engine.rollout import Rollout
from auto_research.errors import UserError
from auto_research.train.components import Drawing, Models, RunContext, build_components
from auto_research.train.evaluation import held_out
from auto_research.train.schedule import open_side, rollout_source
from auto_research.train.loop import restore
from auto_research.train.prepare import Prepared, prepare
from auto_research.train.rollouts import RolloutSource, draw_batch, sample_batch
from auto_research.train.state import LoopState
from auto_research.train.step import rl_step
from auto_research.train.warm_start import model_for


def open_run(prepared: Prepared, world: World, log=print):
    """A prepared run's frozen values (on --resume with the checkpoint's weights, optimizer and loop states), its
    rollout side, built once for the loop that owns it, and the loop's state."""
    config = prepared.config
    model = model_for(config.policy.model, config.data.offline, config.logging.progress, prepared.task, world, log)
    run, models, drawing = build_components(prepared, model, world, log)
    state = LoopState.fresh(config.run.seed)
    try:
        saved = restore(run, models, drawing, state, prepared.resume_from, log) if prepared.resume_from else ()
        side = open_side(run, models, drawing, state, *saved)
    except BaseException:
        drawing.sampler.close()  # a server's lease is given back
        raise
    return run, models, drawing, side, state


class Trainer:
    """The run's frozen values (``run``, ``models``, ``drawing``), its rollout side and the loop's state."""

    def __init__(self, run: RunContext, models: Models, drawing: Drawing, side, state: LoopState, log=print):
        self.run, self.models, self.drawing, self.side, self.state, self.log = run, models, drawing, side, state, log

    components = property(lambda self: self.models, doc="The trainer side (``models``), by its earlier name.")

    @classmethod
    def build(cls, config: GenerationConfig, log=print, rows: list[dict] | None = None, reward_functions=(),
              world: World | None = None, environment=None, tools=(), rollout_function=None) -> "Trainer":
        """``environment``/``tools``: a factory and functions from Python (as --environment and --tools);
        ``rollout_function``: ``fn(rows, context)``, as --rollout-function (envs.custom)."""
        config = config.filled()
        world = world or World.from_environment(config.policy.fsdp)
        prepared = prepare(config, log, rows, reward_functions, world.size, environment, tools, rollout_function)
        return cls(*open_run(prepared, world, log), log)

    def source(self) -> RolloutSource:
        """What a synchronous step draws from: the run's sampler, on the trainer's policy."""
        policy = self.models.policy
        return rollout_source(self.run, self.drawing, self.drawing.sampler, policy, self.run.sampling(policy))

    def sample(self, step: int) -> Rollout:
        """The rollout a step would train on (--max-staleness 0: in flight, the side's thread owns the generator)."""
        if self.side.started and self.run.config.rollout.max_staleness:
            raise UserError("Trainer.sample draws as a synchronous step does (--max-staleness 0): with rollouts in "
                            "flight the rollout side's thread owns the prompt generator and the sampler (over several "
                            "servers, each holds its own version); call it before the first step")
        source = self.source()
        return sample_batch(source, draw_batch(source, self.state.rng, step))

    def step(self, step: int) -> dict:
        return rl_step(self.run, self.models, self.drawing, self.state, step, self.side, self.log)

    def evaluate(self, completions: dict | None = None) -> dict:
        return held_out(self.run, self.models, self.drawing, completions)

    def close(self) -> None:
        """Stop the rollout side's thread and close the sampler (a rollout server's lease is given back)."""
        try:
            self.side.close()
        finally:
            self.drawing.sampler.close()
