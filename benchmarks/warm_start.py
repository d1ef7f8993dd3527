"""Rebuild arithmetic-generate's shipped warm-started model by its recipe, and compare it with the packaged one.

    python benchmarks/warm_start.py [--out DIR] [--ship]

The main job starts from the model the package ships (``src/auto_research/train/shipped/``), so that it starts from
the same weights on every machine. This is the command that made it: it trains the embedded 0.39M-parameter Qwen2 by
supervised fine-tuning on 300 of the task's demonstrations (``train/warm_start.py``'s ``WARM_START``), prints the
held-out accuracy along the way, then the new model's accuracy against the shipped one's and the largest weight
difference. The outcome depends on the CPU's rounding (docs/benchmarks.md, "The same starting point everywhere"):
run it under ``ATEN_CPU_CAPABILITY=avx2`` or ``MKL_ENABLE_INSTRUCTIONS=AVX2`` to see how far. ``--ship`` replaces
the packaged model with the new one (and its ``warm-start.json``, which records the machine that made it).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to write the rebuilt model (default: a temp dir)")
    parser.add_argument("--ship", action="store_true", help="replace the packaged model with the rebuilt one")
    args = parser.parse_args()

    from safetensors.torch import load_file

    from auto_research.data.tasks import arithmetic_task
    from auto_research.engine.machine import describe, machine_record
    from auto_research.engine.models import load_policy
    from auto_research.train import warm_start
    from auto_research.train.evaluation import greedy_accuracy

    task = arithmetic_task()
    print(f"machine: {describe(machine_record('float32'))}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        target = (args.out or Path(scratch)) / warm_start.folder_name(task.name)
        if target.exists():
            raise SystemExit(f"{target} exists: give another --out")
        record = warm_start.build_warm_start(task, target, progress=True)
        shipped = warm_start.shipped_path(task.name)
        if shipped is not None:
            model, tokenizer = load_policy(str(shipped), "cpu", None, offline=True)
            ours = load_file(str(target / "model.safetensors"))
            theirs = load_file(str(shipped / "model.safetensors"))
            largest = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
            print(f"rebuilt: held-out accuracy {record['history'][-1]['held_out_accuracy']:.3f}; shipped (made on "
                  f"{warm_start.warm_start_record(shipped)['made_on']['cpu']}): {greedy_accuracy(model, tokenizer, task):.3f} "
                  f"under these kernels; largest weight difference {largest:.3g}")
        if args.ship:
            destination = warm_start.SHIPPED / target.name
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(target, destination)
            print(f"shipped: {destination}")
        elif args.out:
            print(f"wrote {target}")


if __name__ == "__main__":
    main()
