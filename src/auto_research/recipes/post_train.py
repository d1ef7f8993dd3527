"""``post-train`` at the generation level (and ``post_train()`` in Python): check, lock, prepare, then train. The run
folder is locked before anything in it is read or written (under torchrun rank 0 holds it, and every rank learns
the outcome); in one process torch is imported only once every check without it has passed.
"""

from __future__ import annotations

from auto_research import user_code
from auto_research.config.generation import GenerationConfig
from auto_research.engine.launch import environment_rank, environment_world_size
from auto_research.engine.run_folder import run_outputs
from auto_research.errors import UserError
from auto_research.locks import FolderLock
from auto_research.train.prepare import check_settings, prepare


def _silent(text: str) -> None:
    pass


def post_train_generation(config: GenerationConfig, log=print, rows: list[dict] | None = None,
                          reward_functions=(), environment=None, tools=(), rollout_function=None) -> dict:
    """One generation-level run: checks, train, metrics, report and plot. Returns ``{"runs": [metrics],
    "paths": [...], "summary": None}``."""
    config = config.filled()
    user_code.last_traceback = None  # an earlier run's in this process (--verbose prints this run's)
    size, main = environment_world_size(), environment_rank() == 0
    if not main:  # under torchrun every rank runs this; rank 0 alone speaks and writes
        log = _silent
    check_settings(config, size)
    world = None
    if size > 1:
        # torch now, not later: every rank joins the process group before rank 0 takes the lock, so that all
        # of them learn whether it got it.
        from auto_research.recipes.generation_run import started_world

        world = started_world(config)
    lock = None
    try:
        failure = None
        if main:
            try:
                lock = FolderLock(config.run_dir).acquire()
            except UserError as error:
                failure = error
        if world is not None:
            world.agree(failure)
        elif failure is not None:
            raise failure
        prepared = prepare(config, log, rows, reward_functions, size, environment, tools, rollout_function)
        # torch and transformers only now: every check that can be made without them has passed.
        from auto_research.recipes.generation_run import train_and_report

        return train_and_report(prepared, world, lock, log)
    except BaseException as error:
        # A run that fails before it wrote anything leaves no folder it created behind; one that wrote figures or
        # checkpoints keeps them, whatever the failure.
        if lock is not None and not run_outputs(config.run_dir):
            lock.remove_created()
        if isinstance(error, UserError) and config.verbose and user_code.last_traceback:
            log(f"--verbose: the traceback of the error in your code\n{user_code.last_traceback}")
        raise
    finally:
        if lock is not None:
            lock.release()
        if world is not None:
            world.stop()


def evaluate_generation(config: GenerationConfig, log=print, rows: list[dict] | None = None, reward_functions=(),
                        environment=None, tools=(), rollout_function=None) -> dict:
    """The held-out evaluation of the model a run would start from (``Trainer.build``); nothing trained or written."""
    from auto_research.train.trainer import Trainer

    trainer = Trainer.build(config, log, rows, reward_functions, environment=environment, tools=tools,
                            rollout_function=rollout_function)
    try:
        return trainer.evaluate()
    finally:
        trainer.close()
