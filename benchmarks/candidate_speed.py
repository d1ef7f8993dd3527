"""Wall time of the published seed command and of ``auto-research --help``, as whole processes.

    AUTO_RESEARCH_DATA=../shared/data python benchmarks/candidate_speed.py [--repeats 7]

Goals (issue 2): the seed command under 1 s on 2 cores (the original
implementation took about 2.2 s) and ``--help`` under 0.3 s. Each command is
run several times, alternating, and the median is printed with its ratio to
the goal, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED_COMMAND = ["post-train", "--algorithm", "rloo", "--dataset", "gsm8k-candidate", "--maximum-examples", "512",
                "--steps", "300", "--group-size", "4", "--seed", "42", "--offline"]


def _command() -> list[str]:
    script = shutil.which("auto-research")
    return [script] if script else [sys.executable, "-m", "auto_research"]


def _time(argv: list[str], cwd: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    env = dict(os.environ)
    env.setdefault("AUTO_RESEARCH_DATA", str(ROOT.parent / "shared" / "data"))
    # The runs happen in a scratch folder: a relative path given by the user is made absolute first.
    env["AUTO_RESEARCH_DATA"] = str(Path(env["AUTO_RESEARCH_DATA"]).resolve())
    base = _command()
    seed_times, help_times = [], []
    with tempfile.TemporaryDirectory() as workdir:
        _time(base + SEED_COMMAND, workdir, env)  # warm the page cache and .pyc files
        for _ in range(args.repeats):
            seed_times.append(_time(base + SEED_COMMAND, workdir, env))
            help_times.append(_time(base + ["--help"], workdir, env))
    seed, help_ = statistics.median(seed_times), statistics.median(help_times)
    print(f"command: {' '.join(base)} ... ({args.repeats} runs each, alternating; median)")
    print(f"seed command  {seed:6.3f} s   goal 1.0 s: ratio {seed / 1.0:.2f}   original implementation (quoted, not run here) 2.2 s")
    print(f"--help        {help_:6.3f} s   goal 0.3 s: ratio {help_ / 0.3:.2f}")
    print(f"min/max seed command {min(seed_times):.3f}/{max(seed_times):.3f} s; --help {min(help_times):.3f}/{max(help_times):.3f} s")


if __name__ == "__main__":
    main()
