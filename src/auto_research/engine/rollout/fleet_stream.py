"""A fleet's draws across batches (--max-staleness K ≥ 1 in one process): no server waits for the batch's slowest.

With one version of the weights on every server, a batch's units end unevenly (lengths have a long tail): a server
that finished its share idles until the slowest has finished and the next version has reached every server. Here
each server holds a version of its own and takes the queued units in the order of the versions they need:

    stream = fleet.stream(version, policy)                  # every server holds ``version`` (pushed as it joined)
    stream.publish(version + 1, policy)                     # a copy of the weights: no push, the trainer goes on
    ticket = stream.sample(prompts, K, seeds, version)      # a batch's units, for servers holding ``version``
    rollout = ticket.rollout()                              # waits; the Rollout, rows in order

A server takes the unit of the oldest version in the queue. When it holds another version, that version's copy is
pushed to it first, in its own thread: pushes to different servers overlap each other and the draws. So a server
moves on to version v + 1 as soon as no unit of v is left in the queue, while the others finish theirs. Each unit
is drawn by the weights of its own version, whichever server draws it: the draws are those of the whole-batch path
(``Fleet.generate``). A unit whose server fails (its request, its push, or its heartbeat) goes back to the front of
the queue and is drawn again with the same seeds; when every server left has moved on, its version's copy is pushed
back to one. A copy is dropped once a newer version's batch is queued and no unit of its own is queued or drawn: at
most K + 2 are held, each the policy's size, where the policy lives.
"""

from __future__ import annotations

import bisect
import copy
import threading
from dataclasses import dataclass, field

import torch

from auto_research.engine.rollout.remote import build_rollout
from auto_research.errors import RolloutEngineError

POLL_SECONDS = 0.5
"""How often a draw looks at its servers' heartbeats while it waits for their answers."""


@dataclass(eq=False)
class _Unit:
    """Some of a batch's prompts (``rows``: their positions in the batch), drawn by weights ``version``."""

    ticket: "Ticket"
    index: int
    rows: list[int]
    version: int

    @property
    def order(self) -> tuple[int, int, int]:
        return self.version, self.ticket.number, self.index


@dataclass(eq=False)
class Ticket:
    """One batch in the stream: its units' answers as they come, or the error that ends the run."""

    stream: "Stream"
    number: int
    prompt_ids: list[list[int]]
    group_size: int
    seeds: list[int]
    units: list[list[int]]
    answers: dict = field(default_factory=dict)
    error: BaseException | None = None

    def rollout(self):
        """Wait for every unit (watching the servers' heartbeats), then the Rollout of the batch, rows in order."""
        completions, logprobs = self.stream._wait(self)
        fleet = self.stream.fleet
        return build_rollout(self.stream.tokenizer, fleet.eos, fleet.pad, self.prompt_ids, completions, logprobs,
                             self.group_size)


class Stream:
    """The fleet's servers, each in a thread of its own, drawing the queued units (see the module docstring)."""

    def __init__(self, fleet, version: int, policy):
        self.fleet = fleet
        self.tokenizer = copy.deepcopy(fleet.tokenizer)  # a fast tokenizer's state is not shared between threads
        self.condition = threading.Condition(fleet.lock)
        self.queue: list[_Unit] = []
        """Units to draw, in the order of their versions, then batches, then places in the batch."""
        self.drawing: dict[str, _Unit] = {}
        """address → the unit its server is drawing (pushing first, when it needs another version)."""
        self.held = {address: version for address in fleet.members}
        """address → the version of the weights its server holds."""
        self.copies: dict[int, torch.nn.Module] = {}
        self.spare: list[torch.nn.Module] = []
        self.tickets, self.stopping, self.pushed_bytes = 0, False, 0
        self.submitted = version
        """The version of the last batch queued: batches come in the order of their versions, so an older copy that
        no unit needs is needed no more (a newer one may be published before its batch is queued)."""
        self.publish(version, policy)
        for address in list(fleet.members):
            self._start(address)

    # --- the trainer's side -------------------------------------------------------------------------------------

    def publish(self, version: int, policy) -> None:
        """A copy of ``version``'s weights, for the servers that will need it; then the servers that left and
        answer again join with them (``Fleet.reconnect``)."""
        with self.condition:
            target = self.spare.pop() if self.spare else None
        if target is None:
            target = copy.deepcopy(policy).requires_grad_(False)
        else:
            with torch.no_grad():
                for mine, theirs in zip(target.parameters(), policy.parameters()):
                    mine.copy_(theirs)
        with self.condition:
            self.copies[version] = target
            self._drop_copies()
            # the bytes the servers were pushed since the last version: the step's weight_sync_bytes
            self.fleet.pushed_bytes, self.pushed_bytes = self.pushed_bytes, 0
            self.condition.notify_all()
        for address, member in self.fleet.reconnect(policy):
            with self.condition:
                self.fleet.members[address] = member
                self.held[address] = version
                self._start(address)

    def sample(self, prompts: list[str], group_size: int, seeds: list[int], version: int) -> Ticket:
        """The batch's units queued for servers holding ``version`` (published before); its ticket."""
        prompt_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        size = self.fleet.unit_size(len(prompt_ids))
        units = [list(range(start, min(start + size, len(prompt_ids)))) for start in range(0, len(prompt_ids), size)]
        with self.condition:
            if version not in self.copies:
                raise ValueError(f"version {version} was not published to the stream")
            self.tickets, self.submitted = self.tickets + 1, version
            ticket = Ticket(self, self.tickets, prompt_ids, group_size, [int(seed) for seed in seeds], units)
            for index, rows in enumerate(units):
                bisect.insort(self.queue, _Unit(ticket, index, rows, version), key=lambda unit: unit.order)
            self.condition.notify_all()
        return ticket

    def _wait(self, ticket: Ticket) -> tuple[list, list]:
        with self.condition:
            while len(ticket.answers) < len(ticket.units) and ticket.error is None:
                self.condition.wait(POLL_SECONDS)
                self._watch_heartbeats()
                if not self.fleet.members and ticket.error is None:
                    ticket.error = self.fleet._none_left()
            if ticket.error is not None:
                raise ticket.error
        completions, logprobs = [], []
        for index in range(len(ticket.units)):
            completions += ticket.answers[index][0]
            logprobs += ticket.answers[index][1]
        return completions, logprobs

    def close(self) -> None:
        with self.condition:
            self.stopping = True
            for unit in self.queue + list(self.drawing.values()):
                unit.ticket.error = unit.ticket.error or RolloutEngineError("the run closed its rollout servers")
            self.condition.notify_all()

    # --- each server's thread -----------------------------------------------------------------------------------

    def _start(self, address: str) -> None:
        threading.Thread(target=self._serve, args=(address,), name=f"stream-{address}", daemon=True).start()

    def _serve(self, address: str) -> None:
        """Take the oldest unit, bring this server to its version, draw it; until the server leaves or the run
        closes."""
        while True:
            with self.condition:
                while not self.stopping and address in self.fleet.members and not self.queue:
                    self.condition.wait()
                if self.stopping or address not in self.fleet.members:
                    return
                unit = self.queue.pop(0)
                self.drawing[address] = unit
                member = self.fleet.members[address]
                weights = None if self.held[address] == unit.version else self.copies[unit.version]
            answer, error, pushed = None, None, 0
            try:
                if weights is not None:
                    member.load_weights(weights)
                    pushed = member.pushed_bytes
                ticket = unit.ticket
                answer = member.generate([ticket.prompt_ids[row] for row in unit.rows], ticket.group_size,
                                         [ticket.seeds[row] for row in unit.rows])
            except RolloutEngineError as failure:
                error = str(failure)
            except Exception as failure:  # noqa: BLE001 - any other fault of a draw is that server's failure too
                error = f"{type(failure).__name__}: {failure}"
            with self.condition:
                if self.drawing.get(address) is not unit:  # left meanwhile (its heartbeat): the unit is queued again
                    return
                del self.drawing[address]
                self.pushed_bytes += pushed
                if error is None:
                    self.held[address] = unit.version
                    unit.ticket.answers[unit.index] = answer
                else:
                    self._lose(address, error, unit)
                self._drop_copies()
                self.condition.notify_all()
            if error is not None:
                return

    # --- under the lock -----------------------------------------------------------------------------------------

    def _lose(self, address: str, why: str, unit: _Unit) -> None:
        """The server leaves the pool; its unit goes back to the queue; with no server left, every batch fails."""
        self.fleet._leave(address, why)
        self.held.pop(address, None)
        bisect.insort(self.queue, unit, key=lambda queued: queued.order)
        if not self.fleet.members:
            error = self.fleet._none_left()
            for queued in self.queue + list(self.drawing.values()):
                queued.ticket.error = queued.ticket.error or error

    def _watch_heartbeats(self) -> None:
        for address, unit in list(self.drawing.items()):
            member = self.fleet.members.get(address)
            if member is None or not member.answering:
                del self.drawing[address]
                self._lose(address, "it stopped answering (no heartbeat)", unit)
        self.condition.notify_all()

    def _drop_copies(self) -> None:
        """A version's copy goes to the spares once a newer version's batch is queued and no unit needs it."""
        needed = {unit.version for unit in self.queue} | {unit.version for unit in self.drawing.values()}
        for version in [version for version in self.copies if version < self.submitted and version not in needed]:
            self.spare.append(self.copies.pop(version))
