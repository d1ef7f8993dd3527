"""Several rollout servers behind one trainer (``--rollout-server h1:p1,h2:p2`` or a file of addresses): the
step's groups spread over them, the weights pushed to each, a server that fails left behind and its groups drawn
again by the others (docs/scaling-out.md). Each member is a ``ServerSampler`` (``client.py``) with its own lease,
weight path and check that every answer came from the weights this run pushed to it. What the fleet adds:

- **Units and routing.** A unit is whole groups (``chunk_prompts`` for the builtin engine, else a share of the
  batch), taken by the next idle server; a group's draw depends only on its seeds, never on which server drew it.
  A multi-turn history that extends one this fleet drew goes back to the server that drew it (its caches).
- **A failing server** (a failed request, an answer from another life or version, or ``SILENT_BEATS`` silent
  heartbeats) leaves the pool with one log line, and its units are drawn again by the others with the same seeds.
- **Rejoining.** At each push the addresses that left are asked again (at most every ``REJOIN_SECONDS``); one that
  answers joins once it holds this run's lease and the current weights. With no server left: ``RolloutEngineError``.
- **Across batches** (``stream``, ``fleet_stream.py``): each server holds a version of its own.

Under torchrun every rank holds a fleet of its own; the pushes go to the servers every rank still has, one after
the other, and a rejoin is rank 0's decision, shared with all.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable

from auto_research.engine.rollout import Rollout, SamplingSettings
from auto_research.engine.rollout.fleet_stream import POLL_SECONDS, Stream
from auto_research.engine.rollout.remote import sample_by_ids
from auto_research.errors import RolloutEngineError, UserError

REJOIN_SECONDS = 10.0
"""A server that left the pool is asked again at the next push at most this often."""


class Fleet:
    """The Sampler seam over several rollout servers (see the module docstring)."""

    streams, partial = True, False

    def __init__(self, connect: Callable[[str, object], object], addresses: list[str], model, world, log=print,
                 chunk_prompts: int | None = None):
        self.connect, self.addresses, self.world, self.log = connect, list(addresses), world, log
        self.chunk_prompts = chunk_prompts
        self.members: dict[str, object] = {}
        """The pool: address → its ``ServerSampler``, for the servers that serve this run now."""
        self.left: dict[str, tuple[str, float]] = {}
        """address → (why it left, when it was last asked to rejoin)."""
        self.departed: list[tuple[object, str | None]] = []
        """The clients of servers that left the pool, with the lease each held (given back at ``close``)."""
        self.sticky: dict[int, dict[tuple, str]] = {}
        """The last multi-turn draw: history length → {history (prompt and completion ids): its server}."""
        self.lock = threading.RLock()
        """Guards the pool (``members``, ``left``) where threads other than the caller's change it (``stream``)."""
        self.streaming = None
        """The ``fleet_stream.Stream`` once ``stream`` started one (--max-staleness K ≥ 1 in one process)."""
        try:
            for address in self.addresses:  # all of them at the start: an address with no server is a typo
                self.members[address] = connect(address, model)
        except BaseException:
            self.close()
            raise
        first = self.members[self.addresses[0]]
        self.eos, self.pad, self.tokenizer = first.eos, first.pad, first.tokenizer
        self.weight_sync_seconds = max(member.weight_sync_seconds for member in self.members.values())
        self.pushed_bytes = sum(member.pushed_bytes for member in self.members.values())

    # --- the pool --------------------------------------------------------------------------------------------

    @property
    def transfer(self) -> str:
        """Each server's weight path, for the log ("127.0.0.1:8000 shared memory, 10.0.0.2:8000 HTTP")."""
        return ", ".join(f"{address} {member.transfer}" for address, member in self.members.items())

    def _leave(self, address: str, why: str) -> None:
        with self.lock:
            member = self.members.pop(address, None)
            if member is None:
                return
            self.departed.append((member, member.abandon()))
            self.left[address] = (why, time.monotonic())
        self.log(f"rollout server {address} left the pool ({why}); {len(self.members)} of {len(self.addresses)} "
                 "serve on")

    def _none_left(self) -> RolloutEngineError:
        reasons = "; ".join(f"{address}: {self.left[address][0]}" for address in self.addresses if address in self.left)
        return RolloutEngineError(f"--rollout-server: every rollout server of this run has left the pool ({reasons})")

    def reconnect(self, model) -> list[tuple[str, object]]:
        """Rank 0 asks the addresses that left (at most every ``REJOIN_SECONDS``); each that answered is connected by
        a new client, taking this run's lease and ``model``'s weights. The new clients by address, for the pool."""
        now = time.monotonic()
        with self.lock:
            due = [address for address, (_, asked) in self.left.items() if now - asked >= REJOIN_SECONDS]
        answered = [address for address in due if self.world.main and _answers(address)]
        joined = []
        for address in self.world.gather_objects(answered)[0]:
            why, _ = self.left[address]
            try:
                member = self.connect(address, model)  # takes the lease and pushes the current weights
            except (UserError, RolloutEngineError) as error:
                with self.lock:
                    self.left[address] = (str(error), now)
                continue
            with self.lock:
                del self.left[address]
            joined.append((address, member))
            self.log(f"rollout server {address} joined the pool again with the current weights through "
                     f"{member.transfer} (it had left: {why})")
        with self.lock:
            for address in due:
                if address in self.left:
                    self.left[address] = (self.left[address][0], now)
        return joined

    def stream(self, version: int, policy):
        """Draws across batches from here on (``fleet_stream.Stream``); the servers hold ``version`` now."""
        self.streaming = Stream(self, version, policy)
        return self.streaming

    # --- weights -----------------------------------------------------------------------------------------------

    def load_weights(self, model) -> None:
        """The weights to every server of the pool (concurrently in one process, in turn under torchrun, where each
        push is collective); a server whose push fails leaves the pool."""
        started = time.perf_counter()
        pool = self._agreed_pool()
        failures = each_server({address: (lambda member=self.members[address]: member.load_weights(model))
                               for address in pool}, concurrently=not self.world.distributed)
        for address, why in failures.items():
            self._leave(address, why)
        if self.left:  # the servers that left and answer again rejoin with the current weights
            self.members.update(self.reconnect(model))
        if not self.members:
            raise self._none_left()
        self.weight_sync_seconds = time.perf_counter() - started
        self.pushed_bytes = sum(self.members[address].pushed_bytes for address in pool if address in self.members)

    def _agreed_pool(self) -> list[str]:
        """The servers every rank still has, in the order given (each rank's pushes go to the same servers)."""
        pools = self.world.gather_objects([address for address in self.addresses if address in self.members])
        agreed = [address for address in pools[0] if all(address in pool for pool in pools)]
        for address in list(self.members):
            if address not in agreed:
                self._leave(address, "another rank's draw from it failed")
        return agreed

    # --- draws -------------------------------------------------------------------------------------------------

    def sample(self, prompts: list[str], group_size: int, seeds: list[int]) -> Rollout:
        return sample_by_ids(self, prompts, group_size, seeds)

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int]
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """``group_size`` completions of each prompt, the prompts' groups in units spread over the pool."""
        units = self.units(len(prompt_ids))
        completions, logprobs, _ = self._draw(units, [None] * len(units), lambda member, rows: member.generate(
            [prompt_ids[row] for row in rows], group_size, [seeds[row] for row in rows]), group_size)
        return completions, logprobs

    def generate_ids(self, prompt_ids: list[list[int]], seeds: list[int], settings: SamplingSettings | None = None
                     ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per history (``envs.trajectory``): one that extends a history this fleet drew goes to the
        same server; new ones go in units of equal prompts (a group's first turns together)."""
        histories = [[int(token) for token in ids] for ids in prompt_ids]
        homes = [self._home(ids) for ids in histories]
        families: dict[tuple, list[int]] = {}
        for row, (ids, home) in enumerate(zip(histories, homes)):
            families.setdefault(("server", home) if home is not None else ("prompt", tuple(ids)), []).append(row)
        units = list(families.values())  # whole: a server splits its own unit into requests of chunk_prompts
        affinity = [key[1] if key[0] == "server" else None for key in families]
        completions, logprobs, drawn_by = self._draw(units, affinity, lambda member, rows: member.generate(
            [histories[row] for row in rows], 1, [seeds[row] for row in rows]), 1)
        self._remember(histories, completions, drawn_by)
        return completions, logprobs

    def units(self, prompts: int) -> list[list[int]]:
        """A batch's prompt positions in units: the builtin engine's chunks, else two units per server."""
        size = self.chunk_prompts or max(1, math.ceil(prompts / (2 * len(self.addresses))))
        return [list(range(start, min(start + size, prompts))) for start in range(0, prompts, size)]

    def _home(self, history: list[int]) -> str | None:
        """The server that drew the turn this history extends, when it is still in the pool."""
        for length in sorted(self.sticky, reverse=True):
            if length <= len(history):
                home = self.sticky[length].get(tuple(history[:length]))
                if home is not None:
                    return home if home in self.members else None
        return None

    def _remember(self, histories, completions, drawn_by: list[str]) -> None:
        """This draw's histories, each with its completion, by the server that drew it (``_home``'s next lookups)."""
        self.sticky = {}
        for history, completion, home in zip(histories, completions, drawn_by):
            ids = tuple(history) + tuple(completion)
            self.sticky.setdefault(len(ids), {})[ids] = home

    def _draw(self, units: list[list[int]], affinity: list, draw: Callable, per_row: int
              ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Each unit drawn by a server of the pool, one in flight per server, a failed one again by another
        (``affinity``: the server a unit should go to; ``per_row``: completions a row's answer holds). The completions
        and log-probs in the rows' order, and the server that drew each row."""
        rows = sum(len(unit) for unit in units)
        todo, answers, in_flight = list(range(len(units))), {}, {}
        done: queue.Queue = queue.Queue()
        drawn_by = [None] * rows
        while todo or in_flight:
            for address in [address for address in self.members if address not in in_flight.values()]:
                index = _next_unit(todo, affinity, address, self.members)
                if index is None:
                    continue
                todo.remove(index)
                in_flight[index] = address
                threading.Thread(target=_run, args=(done, index, address, draw, self.members[address], units[index]),
                                 name=f"draw-{address}", daemon=True).start()
            if not in_flight:
                raise self._none_left()
            try:
                index, address, answer, error = done.get(timeout=POLL_SECONDS)
            except queue.Empty:
                index = None
            if index is not None and in_flight.get(index) == address:
                del in_flight[index]
                if error is None:
                    answers[index] = answer
                    for row in units[index]:
                        drawn_by[row] = address
                else:
                    self._leave(address, error)
                    todo.insert(0, index)
            for index, address in list(in_flight.items()):  # a server that stopped answering its heartbeat
                if address not in self.members or not self.members[address].answering:
                    del in_flight[index]
                    self._leave(address, "it stopped answering (no heartbeat)")
                    todo.insert(0, index)
        completions, logprobs = [None] * (rows * per_row), [None] * (rows * per_row)
        for index, unit in enumerate(units):
            for offset, row in enumerate(unit):
                for j in range(per_row):
                    completions[row * per_row + j] = answers[index][0][offset * per_row + j]
                    logprobs[row * per_row + j] = answers[index][1][offset * per_row + j]
        return completions, logprobs, drawn_by

    def close(self) -> None:
        if self.streaming is not None:
            self.streaming.close()
        for member in list(self.members.values()):
            member.close()
        for member, lease in self.departed:  # servers that left: their leases too, if they answer
            member.give_back(lease)


def _next_unit(todo: list[int], affinity: list, address: str, members: dict) -> int | None:
    """The next unit for an idle server: one that should go to it, else one bound to no server in the pool."""
    preferred = [index for index in todo if affinity[index] == address]
    return (preferred or [index for index in todo if affinity[index] not in members] or [None])[0]


def _run(done: queue.Queue, index: int, address: str, draw: Callable, member, rows: list[int]) -> None:
    try:
        completions, logprobs = draw(member, rows)
        done.put((index, address, (completions, logprobs), None))
    except RolloutEngineError as error:
        done.put((index, address, None, str(error)))
    except Exception as error:  # noqa: BLE001 - any other fault of a draw is that server's failure too
        done.put((index, address, None, f"{type(error).__name__}: {error}"))


def each_server(calls: dict[str, Callable], concurrently: bool) -> dict[str, str]:
    """Run each server's call (a push, a round; each in a thread of its own when ``concurrently``); the servers'
    failures by address. Any other error (a tensor the run cannot send, a bug) is raised here, as a call in this
    thread would."""
    failures: dict[str, str] = {}
    raised: list[BaseException] = []

    def run(address: str, call: Callable) -> None:
        try:
            call()
        except RolloutEngineError as error:
            failures[address] = str(error)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread below
            raised.append(error)

    if concurrently:
        threads = [threading.Thread(target=run, args=item, name=f"call-{item[0]}", daemon=True)
                   for item in calls.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for item in calls.items():
            run(*item)
            if raised:
                break
    if raised:
        raise raised[0]
    return failures


def _answers(address: str) -> bool:
    """Whether a server answers ``/health`` at ``address`` now (one quick try)."""
    from auto_research.http import RequestFailed, request, split_address  # noqa: PLC0415

    host, port = split_address(address)
    try:
        request(f"http://{host}:{port}/health", None, "application/json", 2.0, 0, 0.0)
    except RequestFailed as failed:
        return failed.status == 401  # it answers, and wants the key the client sends
    return True
