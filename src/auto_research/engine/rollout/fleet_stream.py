"""A fleet's draws across batches (--max-staleness K ≥ 1 in one process): no server waits for the batch's slowest
(lengths have a long tail). Each server holds a version of its own and takes the queued unit of the oldest version,
its thread pushing that version's copy first when it holds another:

    stream = fleet.stream(version, policy)                  # every server holds ``version`` (pushed as it joined)
    stream.publish(version + 1, policy)                     # a copy of the weights: no push, the trainer goes on
    ticket = stream.sample(prompts, K, seeds, version)      # a batch's units, for servers holding ``version``
    rollout = ticket.rollout()                              # waits; the Rollout, rows in order

Each unit is drawn by its own version's weights, whichever server draws it: the draws are ``Fleet.generate``'s. A
unit whose server fails goes back to the front of the queue, drawn again with the same seeds. A copy is dropped
once a newer version's batch is queued and no unit needs it: at most K + 2 are held, in host memory.
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
    weights: object = None
    """The copy to push first (its server holds another version), while it is drawn."""

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

    def rollout(self, first: int = 0, last: int | None = None):
        """Wait for the units holding prompts up to ``last`` − 1 (None: all), then their Rollout from ``first``."""
        last = len(self.prompt_ids) if last is None else last
        units = sum(1 for unit in self.units if unit[0] < last)
        completions, logprobs = self.stream._wait(self, units)
        K, fleet = self.group_size, self.stream.fleet
        return build_rollout(self.stream.tokenizer, fleet.eos, fleet.pad, self.prompt_ids[first:last],
                             completions[first * K: last * K], logprobs[first * K: last * K], K)


class Stream:
    """The fleet's servers, each in a thread of its own, drawing the queued units (see the module docstring)."""

    def __init__(self, fleet, version: int, policy):
        self.fleet = fleet
        # a tokenizer of its own, not the trainer's (whose padded batches set its state); encoding on the drawer's
        # thread and decoding on the scorer's set no padding
        self.tokenizer = copy.deepcopy(fleet.tokenizer)
        self.condition = threading.Condition(fleet.lock)
        self.queue: list[_Unit] = []
        """Units to draw, in the order of their versions, then batches, then places in the batch."""
        self.drawing: dict[str, _Unit] = {}
        """address → the unit its server is drawing (pushing first, when it needs another version)."""
        self.held = {address: version for address in fleet.members}
        """address → the version of the weights its server holds."""
        self.copies: dict[int, torch.nn.Module] = {}
        self.spare: list[torch.nn.Module] = []
        self.tickets, self.stopping, self.pushed_bytes, self.failure = 0, False, 0, None
        self.submitted = version
        """The last batch's version: batches come in version order, so an older copy no unit needs is done with."""
        for address, member in list(fleet.members.items()):
            self._start(address, member)
        self.publish(version, policy)

    # --- the trainer's side -------------------------------------------------------------------------------------

    def publish(self, version: int, policy) -> None:
        """A copy of ``version``'s weights for the servers that will need it; servers that left rejoin with them."""
        with self.condition:
            target = self.spare.pop() if self.spare else None
        if target is None:
            target = _copy_in_host_memory(policy)
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
                self._start(address, member)

    def sample(self, prompts: list[str], group_size: int, seeds: list[int], version: int) -> Ticket:
        """The batch's units queued for servers holding ``version`` (published before); its ticket."""
        prompt_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        units = self.fleet.units(len(prompt_ids))
        with self.condition:
            if self.failure is not None:
                raise self.failure
            if version not in self.copies:
                raise ValueError(f"version {version} was not published to the stream")
            self.tickets, self.submitted = self.tickets + 1, version
            ticket = Ticket(self, self.tickets, prompt_ids, group_size, [int(seed) for seed in seeds], units)
            for index, rows in enumerate(units):
                bisect.insort(self.queue, _Unit(ticket, index, rows, version), key=lambda unit: unit.order)
            self.condition.notify_all()
        return ticket

    def _wait(self, ticket: Ticket, units: int) -> tuple[list, list]:
        """The completions and log-probs of the ticket's first ``units`` units, once all have answered."""
        with self.condition:
            while any(index not in ticket.answers for index in range(units)) and ticket.error is None:
                self.condition.wait(POLL_SECONDS)
                self._watch_heartbeats()
                if not self.fleet.members and ticket.error is None:
                    ticket.error = self.fleet._none_left()
            if ticket.error is not None:
                raise ticket.error
        answers = [ticket.answers[index] for index in range(units)]
        return [row for drawn, _ in answers for row in drawn], [row for _, values in answers for row in values]

    def close(self) -> None:
        with self.condition:
            self._fail_all(RolloutEngineError("the run closed its rollout servers"))

    # --- each server's thread -----------------------------------------------------------------------------------

    def _start(self, address: str, member) -> None:
        threading.Thread(target=self._serve, args=(address, member), name=f"stream-{address}", daemon=True).start()

    def _serve(self, address: str, member) -> None:
        """Take the oldest unit, bring this server to its version, draw it; until this client leaves the pool (a
        rejoined server has a new one) or the run closes. A thread stopped by anything else requeues its unit."""
        unit = None
        try:
            while (unit := self._take(address, member)) is not None:
                answer, error, pushed = self._draw(member, unit)
                with self.condition:
                    if self.drawing.get(address) is not unit or self.fleet.members.get(address) is not member:
                        unit = None  # left meanwhile (its heartbeat): the unit is queued again, maybe taken
                        return
                    del self.drawing[address]
                    self.pushed_bytes += pushed
                    if isinstance(error, str) and not self.stopping:
                        self._lose(address, error, unit)
                    elif error is None:
                        self.held[address] = unit.version
                        unit.ticket.answers[unit.index] = answer
                    elif isinstance(error, BaseException):
                        unit.ticket.error = unit.ticket.error or error
                        self._fail_all(error)
                    self._drop_copies()
                    self.condition.notify_all()
                if error is not None:
                    unit = None
                    return
        finally:
            if unit is not None:
                with self.condition:
                    if self.drawing.get(address) is unit:
                        del self.drawing[address]
                        self._lose(address, "its thread in this process stopped", unit)
                    self.condition.notify_all()

    def _take(self, address: str, member) -> _Unit | None:
        """The oldest unit for this server's client, once there is one; None once it left or the run closed."""
        with self.condition:
            while not self.stopping and self.fleet.members.get(address) is member and not self.queue:
                self.condition.wait()
            if self.stopping or self.fleet.members.get(address) is not member:
                return None
            unit = self.queue.pop(0)
            self.drawing[address] = unit
            unit.weights = None if self.held.get(address) == unit.version else self.copies[unit.version]
            return unit

    @staticmethod
    def _draw(member, unit: _Unit) -> tuple:
        """(answer, None, bytes pushed); else the server's failure as a line, or a push's fault that is not the
        server's (out of memory, a bug) as the exception, for every batch to raise."""
        pushed = 0
        try:
            if unit.weights is not None:
                member.load_weights(unit.weights)
                pushed = member.pushed_bytes
        except RolloutEngineError as failure:
            return None, str(failure), pushed
        except Exception as failure:  # noqa: BLE001 - raised where the trainer waits, as a whole-batch push's
            return None, failure, pushed
        ticket = unit.ticket
        try:
            answer = member.generate([ticket.prompt_ids[row] for row in unit.rows], ticket.group_size,
                                     [ticket.seeds[row] for row in unit.rows])
        except RolloutEngineError as failure:
            return None, str(failure), pushed
        except Exception as failure:  # noqa: BLE001 - any other fault of a draw is that server's failure too
            return None, f"{type(failure).__name__}: {failure}", pushed
        return answer, None, pushed

    # --- under the lock -----------------------------------------------------------------------------------------

    def _lose(self, address: str, why: str, unit: _Unit) -> None:
        """The server leaves the pool; its unit goes back to the queue; with no server left, every batch fails."""
        self.fleet._leave(address, why)
        self.held.pop(address, None)
        bisect.insort(self.queue, unit, key=lambda queued: queued.order)
        if not self.fleet.members:
            self._fail_all(self.fleet._none_left(), stop=False)

    def _fail_all(self, error: BaseException, stop: bool = True) -> None:
        """Every batch queued or drawing ends with ``error``; ``stop``: the stream takes no more."""
        for queued in self.queue + list(self.drawing.values()):
            queued.ticket.error = queued.ticket.error or error
        if stop:
            self.stopping, self.failure = True, self.failure or error
        self.condition.notify_all()

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


def _copy_in_host_memory(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``policy`` in host memory, made without a passing copy on the policy's device (a GPU's
    memory is the trainer's); every push path takes its tensors from the host."""
    memo = {id(parameter): torch.nn.Parameter(parameter.detach().to("cpu", copy=True), requires_grad=False)
            for parameter in policy.parameters()}
    return copy.deepcopy(policy, memo).requires_grad_(False)
