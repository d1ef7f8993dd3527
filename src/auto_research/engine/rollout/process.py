"""``--rollout-mode process``: the builtin sampler's rollout server (``rollout-serve --engine builtin``), started by
the run itself on cores of its own (``--rollout-cores``, default the last core) and stopped with it, so that a
CPU-only run samples while it trains without sharing its interpreter lock (docs/async.md). The child listens on
127.0.0.1 only, with a random API key only the two know; it stops with its trainer at ``close`` or, when the
trainer is SIGKILLed, by watching it (``orphans.stop_with_trainer``). When the child dies first, the trainer's line
says so, with its exit status.
"""

from __future__ import annotations

import collections
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

from auto_research.engine.machine import set_threads
from auto_research.engine.rollout.client import ServerSampler
from auto_research.engine.rollout.transfer import sweep
from auto_research.errors import RolloutEngineError, UserError
from auto_research.orphans import TRAINER_VARIABLE

START_SECONDS = 300.0


def _child_setup(cores: set[int]) -> None:
    """In the rollout process, before it runs: its cores, and Ctrl-C's SIGINT ignored (see the caller)."""
    os.sched_setaffinity(0, cores)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class RolloutProcess(ServerSampler):
    """A ``ServerSampler`` over a builtin rollout server that this run started; ``close`` stops it too."""

    def __init__(self, needs, cores: set[int]):
        import torch  # noqa: PLC0415

        self.key = secrets.token_hex(16)
        command = [sys.executable, "-m", "auto_research", "rollout-serve", "--engine", "builtin", "--host",
                   "127.0.0.1", "--port", "0", "--threads", str(len(cores)), "--offline", "--model",
                   str(needs.model_name), "--device", "cpu"]
        environment = {**os.environ, "AUTO_RESEARCH_API_KEY": self.key, "OMP_NUM_THREADS": str(len(cores)),
                       TRAINER_VARIABLE: str(os.getpid())}
        # SIGINT ignored in the child (Python keeps an inherited SIG_IGN): a Ctrl-C reaches the terminal's whole
        # process group, and the trainer, which finishes its step and saves it, needs its rollout process for that
        # step; the trainer stops the child at close (and the child stops with a SIGKILLed trainer, orphans.py).
        self.child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=environment, preexec_fn=lambda: _child_setup(cores))
        address = self._wait_for_address()
        trainer_cores = set(os.sched_getaffinity(0)) - cores
        self.before = (os.sched_getaffinity(0), torch.get_num_threads())
        """This thread's cores and torch's threads before the run: given back at ``close`` (a run started from
        Python leaves its caller as it found it)."""
        os.sched_setaffinity(0, trainer_cores)  # this thread: the trainer's work
        if not needs.threads:
            set_threads(len(trainer_cores))
        try:
            super().__init__(needs.policy, needs.tokenizer, needs.settings, address, needs.model_name, needs.world,
                             needs.run_dir, engine="builtin", chunk_prompts=needs.chunk_prompts, api_key=self.key,
                             sync=needs.rollout.rollout_sync)
        except BaseException:
            self._stop_child()
            self._give_cores_back()
            raise
        self.cores, self.trainer_cores = cores, trainer_cores

    def _wait_for_address(self) -> str:
        lines: queue.Queue = queue.Queue()
        seen: list[str] = []
        self.last_said: collections.deque = collections.deque(maxlen=1)
        """The child's last line on stderr (its cause of death, when it raised)."""

        def read() -> None:
            for line in self.child.stderr:
                lines.put(line)
                if line.strip():
                    self.last_said.append(line.strip())
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            seen.append(line.strip())
            if line.startswith("serving "):
                threading.Thread(target=lambda: [None for _ in iter(lines.get, None)], daemon=True).start()
                return line.split("http://")[1].split()[0]
        self._stop_child()
        last = next((line for line in reversed(seen) if line), "no output")
        raise UserError(f"--rollout-mode process: the rollout process did not start ({last})")

    def _answer(self, path: str, body: bytes, content_type: str = "application/json", retries: int | None = None
                ) -> bytes:
        """The server's answer; when the request failed because the child died, one line that says so (the user
        started no server to restart: ``--resume`` starts a new child)."""
        try:
            return super()._answer(path, body, content_type, retries)
        except RolloutEngineError:
            death = self._death()
            if death is None:
                raise
            raise RolloutEngineError(f"--rollout-mode process: this run's rollout process (PID {self.child.pid}) "
                                     f"{death}") from None

    def _death(self) -> str | None:
        """How the child ended ("was killed by SIGKILL", "exited with status 1 (its last line: MemoryError)"), or
        None while it runs. A request that failed for its death failed after its retries, by when it has ended; a
        second's grace covers the rest."""
        try:
            status = self.child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None
        if status < 0:  # a signal (the OOM killer's SIGKILL, ...): its last line is an ordinary log line
            try:
                return f"was killed by {signal.Signals(-status).name}"
            except ValueError:
                return f"was killed by signal {-status}"
        said = self.last_said[-1] if self.last_said else ""
        return f"exited with status {status}" + (f" (its last line: {said[:200]})" if said else "")

    def _stop_child(self) -> None:
        if self.child.poll() is None:
            self.child.terminate()
            try:
                self.child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        sweep()  # a child that could not stop cleanly (killed) left its shared buffer behind

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop_child()
            self._give_cores_back()

    def _give_cores_back(self) -> None:
        os.sched_setaffinity(0, self.before[0])
        set_threads(self.before[1])
