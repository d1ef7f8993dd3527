"""The torch half of a generation-level run: its frozen values and rollout side, the loop, the reports."""

from __future__ import annotations

from auto_research.engine.distributed import World
from auto_research.engine.lora import save_merged
from auto_research.engine.machine import machine_record
from auto_research.engine.models import resolve_device
from auto_research.errors import UserError
from auto_research.report import plots, tables
from auto_research.train.loop import RunLoop
from auto_research.train.memory import MemoryMeter
from auto_research.train.prepare import Prepared
from auto_research.train.trainer import open_run


def started_world(config) -> World:
    """Under torchrun: this rank's World, its process group joined."""
    world = World.from_environment(config.fsdp)
    world.start(world.device(resolve_device(config.device)))
    return world


def train_and_report(prepared: Prepared, world: World | None, lock, log) -> dict:
    config = prepared.config
    world = world or World.from_environment(config.fsdp)
    memory = MemoryMeter(config.device)
    run, models, drawing, side, state = open_run(prepared, world, log)
    try:
        metrics = RunLoop(run, models, drawing, side, state, lock, log, resumed=prepared.resume_from is not None).run()
    finally:
        drawing.sampler.close()  # a server's lease is given back, whichever way the run ended
    if config.merge_lora:
        folder = config.run_dir / "merged"
        if world.main:
            save_merged(models.policy, run.tokenizer, folder)
            log(f"wrote the merged model to {folder}")
        world.barrier()
    # Every rank is done with collectives, together, before rank 0 writes the reports and the others leave
    # (gloo aborts a rank whose peer tears its connections down while it is still busy).
    world.barrier()
    metrics["training"].update(memory.read())
    metrics["training"]["processes"] = world.size
    metrics["machine"] = machine_record(str(run.compute_dtype).removeprefix("torch."), run.device)
    if not world.main:
        return {"runs": [metrics], "paths": [], "summary": None}
    lock.check()
    rows = tables.read_jsonl(config.run_dir / "metrics.jsonl")
    try:
        paths = tables.write_run(config.run_dir, metrics)
        paths.append(plots.training_curves_plot(config.run_dir / "curves.png", rows, metrics))
    except OSError as error:
        raise UserError(f"cannot write the results to {config.run_dir}: {error.strerror or error}; the last "
                        f"checkpoint in {config.run_dir / 'checkpoints'} holds the trained model") from None
    return {"runs": [metrics], "paths": paths, "summary": None}
