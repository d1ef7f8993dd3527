"""MKL's products on one thread (what every run does: ``engine/machine.py`` ``one_blas_thread``) against MKL on
torch's threads, side by side in one process:

    python benchmarks/blas_threads.py                           # the embedded model and SmolLM2-135M-Instruct
    python benchmarks/blas_threads.py --model none              # the embedded model alone

For each model (``embedded``: the main job's shipped starting point), the update's forward and backward on a fixed batch (8 prompts × 4 completions of up to 32
tokens; ``benchmarks/onednn.py``'s), MKL on one thread and on all of torch's in turn (A B A B …), printing the
seconds' medians and ranges. (Whether repeats are identical is a property of whole runs, and of their history in
a process: ``tests/test_shipped_model.py`` checks it on copies of the main job.) The models' large
layers compute through oneDNN in both (``engine/onednn.py``), so what moves is MKL's share: the small layers, the
output layer's gradients and anything else MKL computes.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from onednn import rotate, spread, update_step  # noqa: E402


def compare(model_name: str, repeats: int, set_local) -> None:
    import torch

    from auto_research.engine.models import load_policy
    from auto_research.train.components import checkpoint_layers
    from auto_research.train.warm_start import shipped_path

    source = str(shipped_path("arithmetic-generate")) if model_name == "embedded" else model_name
    model, tokenizer = load_policy(source, "cpu", torch.float32, offline=True, log=lambda line: None)
    model.eval()
    if model_name != "embedded":
        checkpoint_layers(model)
    results = {}
    step, tokens = update_step(tokenizer, results, min(10000, model.config.vocab_size))

    def run(threads: int, name: str):
        def call():
            set_local(ctypes.byref(ctypes.c_int(threads)))  # 0: MKL's process-wide count (torch's threads)
            try:
                step(model, name)()
            finally:
                set_local(ctypes.byref(ctypes.c_int(1)))
        return call

    times = rotate({"one": run(1, "one"), "all": run(0, "all")}, repeats)
    ratios = [a / b for a, b in zip(times["all"], times["one"])]
    print(f"{model_name} ({tokens} tokens, {torch.get_num_threads()} threads), seconds (medians of {repeats}):")
    print(f"  MKL on one thread {spread(times['one'])} s, on {torch.get_num_threads()} {spread(times['all'])} s: "
          f"one thread {spread(ratios)}× as fast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a packaged name or folder; none: skip")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    import torch

    from auto_research.engine.machine import _mkl_set_local, describe, machine_record

    set_local = _mkl_set_local()
    if set_local is None:
        raise SystemExit("this torch build has no MKL: nothing to compare")
    torch.set_num_threads(options.threads)
    print(describe(machine_record("float32")))
    for name in ("embedded", *(() if options.model == "none" else (options.model,))):
        compare(name, options.repeats, set_local)


if __name__ == "__main__":
    main()
