"""A fleet drawing across batches (engine/rollout/fleet_stream.py): a server that finished its share of a batch moves
on to the next version while another still draws the old one, every unit is drawn by its own version's weights
(a failed one too, after every server left has moved on), and old copies of the weights are let go. Scripted
servers in this process: each draw's tokens name the version the server held and the seed."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from auto_research.engine.tiny import build_tokenizer
from auto_research.errors import RolloutEngineError


class Scripted:
    """A ServerSampler's face to the fleet: ``load_weights`` takes the version a model's one weight holds; a draw's
    completion is [10 + version, 100 + seed % 100]; ``gates`` hold the next draws until set; ``fail`` fails the next
    draw once its gate opens; ``entered`` is set once a draw began, ``seeds``: each draw's."""

    def __init__(self, address, model, events):
        self.address, self.events = address, events
        self.tokenizer = build_tokenizer()
        self.eos, self.pad = (self.tokenizer.eos_token_id,), self.tokenizer.pad_token_id
        self.transfer, self.weight_sync_seconds, self.pushed_bytes, self.answering = "HTTP", 0.0, 0, True
        self.gates: list[threading.Event] = []
        self.fail, self.entered, self.seeds = False, threading.Event(), []
        self.load_weights(model)

    def load_weights(self, model) -> None:
        self.version = int(model.weight.item())
        self.pushed_bytes = 4
        self.events.append((self.address, "push", self.version))

    def generate(self, prompt_ids, group_size, seeds):
        self.seeds.append(tuple(seeds))
        self.entered.set()
        gate = self.gates.pop(0) if self.gates else None
        if gate is not None:
            assert gate.wait(60)
        if self.fail:
            raise RolloutEngineError(f"{self.address} failed")
        self.events.append((self.address, "draw", self.version, tuple(seeds)))
        rows = [[10 + self.version, 100 + seed % 100] for seed in seeds for _ in range(group_size)]
        return rows, [[-1.0, -1.0] for _ in rows]

    def abandon(self) -> str:
        return f"lease of {self.address}"

    def give_back(self, lease) -> None:
        self.events.append((self.address, "give back", lease))

    def close(self) -> None:
        pass


def _policy(version: float) -> torch.nn.Module:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(version)
    return model


@pytest.fixture
def fleet():
    from auto_research.engine.distributed import World
    from auto_research.engine.rollout.fleet import Fleet

    events, lines = [], []
    made = Fleet(lambda address, model: Scripted(address, model, events), ["a:1", "b:2"], _policy(0), World(),
                 lines.append, chunk_prompts=1)
    made.events, made.lines = events, lines
    yield made
    made.close()


def _versions(rollout) -> list[int]:
    return [tokens[0] - 10 for tokens in rollout.token_lists()]


def test_a_server_done_with_its_share_draws_the_next_version_while_another_draws_the_old(fleet):
    a, b = fleet.members["a:1"], fleet.members["b:2"]
    held = threading.Event()
    a.gates.append(b.entered)  # each takes one of the first batch's units
    b.gates.append(held)  # b's waits
    stream = fleet.stream(0, _policy(0))
    first = stream.sample(["1+1=", "2+2="], 2, [7, 8], 0)
    stream.publish(1, _policy(1))
    second = stream.sample(["3+3=", "4+4="], 2, [9, 10], 1)
    rollout = second.rollout()  # drawn while b still holds the first batch's unit
    assert not held.is_set()
    assert _versions(rollout) == [1, 1, 1, 1]
    assert [tokens[1] for tokens in rollout.token_lists()] == [109, 109, 110, 110]
    assert [event for event in fleet.events if event[0] == "a:1"][-4:] == [
        ("a:1", "draw", 0, a.seeds[0]), ("a:1", "push", 1), ("a:1", "draw", 1, (9,)), ("a:1", "draw", 1, (10,))]
    held.set()
    assert _versions(first.rollout()) == [0, 0, 0, 0]
    assert set(stream.copies) == {1} and b.version == 0  # b took no unit of version 1: nothing pushed to it


def test_a_unit_whose_server_fails_after_the_others_moved_on_is_drawn_by_its_own_version(fleet):
    a, b = fleet.members["a:1"], fleet.members["b:2"]
    held = threading.Event()
    a.gates.append(b.entered)  # each takes one of the first batch's units
    b.gates.append(held)
    stream = fleet.stream(0, _policy(0))
    first = stream.sample(["1+1=", "2+2="], 1, [7, 8], 0)
    stream.publish(1, _policy(1))
    assert _versions(stream.sample(["3+3="], 1, [9], 1).rollout()) == [1]
    stream.publish(2, _policy(2))
    assert _versions(stream.sample(["5+5="], 1, [11], 2).rollout()) == [2]
    assert set(stream.copies) == {0, 2}  # b's unit still needs version 0
    b.fail = True
    held.set()
    rollout = first.rollout()
    assert _versions(rollout) == [0, 0] and [tokens[1] for tokens in rollout.token_lists()] == [107, 108]
    a_events = [event[1:] for event in fleet.events if event[0] == "a:1"]
    assert a_events[-3:] == [("draw", 2, (11,)), ("push", 0), ("draw", 0, b.seeds[0])]  # a went back to version 0
    assert fleet.lines == ["rollout server b:2 left the pool (b:2 failed); 1 of 2 serve on"]
    assert set(stream.copies) == {2}


def test_with_no_server_left_every_waiting_batch_is_one_error_naming_them(fleet):
    for member in fleet.members.values():
        member.fail = True
    stream = fleet.stream(0, _policy(0))
    ticket = stream.sample(["1+1=", "2+2=", "3+3="], 1, [1, 2, 3], 0)
    with pytest.raises(RolloutEngineError, match=r"every rollout server of this run has left the pool \(a:1: a:1 "
                                                 r"failed; b:2: b:2 failed\)"):
        ticket.rollout()


def test_a_version_published_before_its_batch_is_queued_is_kept_for_it(fleet):
    """At K ≥ 2 the trainer may publish the next version before the rollout side queued the batch of this one."""
    stream = fleet.stream(0, _policy(0))
    stream.publish(1, _policy(1))
    stream.publish(2, _policy(2))
    assert set(stream.copies) == {0, 1, 2}
    assert _versions(stream.sample(["1+1="], 1, [1], 1).rollout()) == [1]
    assert set(stream.copies) == {1, 2}  # 0 comes before the queued batch's version: no batch needs it again
    assert _versions(stream.sample(["2+2="], 1, [2], 2).rollout()) == [2]
    assert set(stream.copies) == {2} and len(stream.spare) == 2


def _until(condition, seconds=60.0):
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_server_that_rejoins_mid_batch_draws_the_unit_it_lost_by_that_unit_s_version(fleet, monkeypatch):
    """a stops answering its heartbeat mid-draw and rejoins (a new client, holding version 1) while b still draws:
    the new client draws a's unit after a push of version 0, then the next batch after a push of version 1; the old
    client's late answer is dropped."""
    a, b = fleet.members["a:1"], fleet.members["b:2"]
    late, held = threading.Event(), threading.Event()
    a.gates.append(late)
    b.gates.append(held)
    stream = fleet.stream(0, _policy(0))
    first = stream.sample(["1+1=", "2+2="], 1, [7, 8], 0)
    _until(lambda: a.entered.is_set() and b.entered.is_set())
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(rollout=first.rollout()))
    waiter.start()
    a.answering = False
    _until(lambda: "a:1" not in fleet.members)
    own = []
    rejoined = Scripted("a:1", _policy(1), own)
    monkeypatch.setattr(fleet, "reconnect", lambda model: [("a:1", rejoined)])
    stream.publish(1, _policy(1))
    monkeypatch.setattr(fleet, "reconnect", lambda model: [])
    _until(lambda: len(rejoined.seeds) == 1)
    assert _versions(stream.sample(["3+3="], 1, [9], 1).rollout()) == [1]
    late.set()  # the old client answers now, too late
    held.set()
    waiter.join(60)
    assert not waiter.is_alive()
    assert _versions(waited["rollout"]) == [0, 0]
    assert [event[1:] for event in own] == [
        ("push", 1), ("push", 0), ("draw", 0, a.seeds[0]), ("push", 1), ("draw", 1, (9,))]
    assert fleet.members["a:1"] is rejoined and stream.held["a:1"] == 1
    assert fleet.lines == ["rollout server a:1 left the pool (it stopped answering (no heartbeat)); 1 of 2 serve on"]


def test_a_push_that_fails_in_this_process_is_raised_as_it_is_and_no_server_leaves(fleet):
    """A fault that is not the server's (out of memory, a bug) stops the run as a whole-batch push would."""
    for member in fleet.members.values():
        member.load_weights = lambda model: (_ for _ in ()).throw(TypeError("a bug in this process"))
    stream = fleet.stream(0, _policy(0))
    stream.publish(1, _policy(1))
    with pytest.raises(TypeError, match="a bug in this process"):
        stream.sample(["1+1="], 1, [1], 1).rollout()
    assert fleet.lines == [] and set(fleet.members) == {"a:1", "b:2"}
    with pytest.raises(TypeError, match="a bug in this process"):
        stream.sample(["2+2="], 1, [2], 1)


@pytest.mark.parametrize("lora", [False, True])
def test_a_published_copy_pushes_the_policy_s_weights_and_shares_no_memory_with_it(lora):
    from peft import LoraConfig, get_peft_model

    from auto_research.engine.rollout.fleet_stream import _copy_in_host_memory
    from auto_research.engine.rollout.remote import adapter_factors, pushed_weights
    from auto_research.engine.tiny import build_model

    policy = build_model(build_tokenizer(), seed=0)
    if lora:
        policy = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # a trained adapter (B starts at zero)
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_()
    copied = _copy_in_host_memory(policy)
    ours, theirs = dict(pushed_weights(copied, torch.float32)), dict(pushed_weights(policy, torch.float32))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    if lora:
        factors, expected = adapter_factors(copied), adapter_factors(policy)
        assert factors.keys() == expected.keys() and all(torch.equal(factors[k], expected[k]) for k in factors)
    mine = {parameter.data_ptr() for parameter in policy.parameters()}
    assert not any(parameter.data_ptr() in mine or parameter.requires_grad for parameter in copied.parameters())
    assert len(list(copied.parameters())) == len(list(policy.parameters()))  # tied weights stay tied
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    assert not torch.equal(next(policy.parameters()), next(copied.parameters()))


def test_a_trainer_in_flight_refuses_to_sample_beside_its_rollout_side(tmp_path):
    """Trainer.sample once the rollout side runs in flight would share its prompt generator (and over a fleet draw
    from servers holding different versions): refused in one line; before the first step it draws."""
    from auto_research.config.generation import GenerationConfig
    from auto_research.errors import UserError
    from auto_research.train.trainer import Trainer

    config = GenerationConfig(dataset="arithmetic-generate", steps=2, prompts_per_step=2, eval_every=0,
                              evaluation_examples=4, offline=True, progress=False, output_dir=tmp_path,
                              max_staleness=1, max_new_tokens=4)
    trainer = Trainer.build(config, log=lambda line: None)
    try:
        assert len(trainer.sample(1).completions) == 2 * config.group_size
        trainer.step(1)
        with pytest.raises(UserError, match=r"^Trainer.sample draws as a synchronous step does \(--max-staleness 0\)"):
            trainer.sample(2)
    finally:
        trainer.close()


def _hold(fleet, seed: int, released: threading.Event) -> None:
    """Every server's draw of ``seed`` waits for ``released``."""
    for member in fleet.members.values():
        def generate(prompt_ids, group_size, seeds, original=member.generate):
            if list(seeds) == [seed]:
                assert released.wait(60)
            return original(prompt_ids, group_size, seeds)

        member.generate = generate


def test_a_batch_s_first_prompts_are_there_while_its_last_unit_is_still_drawn(fleet):
    held = threading.Event()
    _hold(fleet, 9, held)  # the last prompt's unit (one prompt a unit) waits
    ticket = fleet.stream(0, _policy(0)).sample(["1+1=", "2+2=", "3+3="], 2, [7, 8, 9], 0)
    head = ticket.rollout(0, 2)  # the first two prompts' rows, their units answered, the batch not whole
    assert not held.is_set() and [tokens[1] for tokens in head.token_lists()] == [107, 107, 108, 108]
    held.set()
    whole, tail = ticket.rollout(), ticket.rollout(1, 3)
    assert [tokens[1] for tokens in whole.token_lists()] == [107, 107, 108, 108, 109, 109]
    assert tail.token_lists() == whole.token_lists()[2:]


def test_the_reference_is_computed_in_parts_as_rows_come_equal_to_those_rows_cut_from_the_batch(fleet):
    """StreamedInFlight._reference_parts: each part once its units answered (the first before the last unit is
    drawn), trimmed to its rows; its numbers are those of the same rows cut from the whole batch, and within
    1e-6 of one forward over the batch."""
    import types

    from auto_research.engine.logprobs import token_logprobs
    from auto_research.engine.machine import computing, one_blas_thread
    from auto_research.engine.tiny import build_model
    from auto_research.train.experience import widen
    from auto_research.train.in_flight import StreamedInFlight

    model = build_model(build_tokenizer(), seed=0).eval()
    calls, held = [], threading.Event()

    def reference(rollout):
        calls.append((rollout.sequences.shape[0], held.is_set()))
        with torch.no_grad():
            return token_logprobs(model, rollout.sequences, rollout.prompt_mask, rollout.completion_mask)

    _hold(fleet, 13, held)  # the last prompt's unit (one prompt a unit) waits until the first parts are computed
    ticket = fleet.stream(0, _policy(0)).sample(["1+1=", "22+2=", "3+33=", "4+4="], 2, [10, 11, 12, 13], 0)
    side = types.SimpleNamespace(reference_rows=3, source=types.SimpleNamespace(reference=reference))
    parts = []
    one_blas_thread()  # as every thread of a run that computes: the same kernels here as in the worker
    worker = threading.Thread(target=computing(lambda: parts.extend(StreamedInFlight._reference_parts(side, ticket))))
    worker.start()
    _until(lambda: len(calls) == 2)  # rows 0-2 and 3-5: prompts 0-2, drawn
    held.set()
    worker.join(60)
    assert not worker.is_alive()
    assert calls == [(3, False), (3, False), (2, True)]
    whole = ticket.rollout()
    width = whole.completion_mask.shape[1]
    for part, (start, stop) in zip(parts, [(0, 3), (3, 6), (6, 8)]):
        assert torch.equal(part, reference(whole.rows(start, stop, trim=True)))
    together = torch.cat([widen(part, width) for part in parts])
    assert torch.allclose(together, reference(whole), atol=1e-6)


def test_a_streamed_batch_s_reference_parts_follow_the_trainer_s_micro_batches_else_a_quarter_of_its_groups():
    import types

    from auto_research.train.schedule import reference_rows

    def config(size=None, tokens=None, offload=False):
        return types.SimpleNamespace(micro_batch_size=size, max_tokens_per_micro_batch=tokens,
                                     offload_reference=offload)

    assert reference_rows(config(), 32, 4) == 32  # 8 prompts' groups
    assert reference_rows(config(), 3, 4) == 4 and reference_rows(config(), 2, 8) == 8  # never part of a group
    assert reference_rows(config(size=8), 32, 4) == 8
    assert reference_rows(config(size=8, tokens=512), 32, 4) is None  # parts cut by tokens need every row's length
    assert reference_rows(config(offload=True), 32, 4) is None  # its weights would come back for each part


def test_drawing_across_batches_gives_way_to_whole_batches_when_its_copies_would_not_fit(monkeypatch):
    """K + 2 host copies of the weights against half the memory available: over it, one line and whole batches."""
    from auto_research.train import schedule

    if sys.platform.startswith("linux"):
        assert schedule.available_memory() > 0  # this host's, read from /proc/meminfo
    policy, lines = torch.nn.Linear(256, 256), []  # 65,792 float32 weights: 263,168 bytes a copy
    monkeypatch.setattr(schedule, "available_memory", lambda: 2 * 3 * 263_168)
    assert schedule.copies_fit(policy, 1, lines.append) and not lines  # 3 copies: exactly half
    assert not schedule.copies_fit(policy, 2, lines.append)  # 4 copies
    assert lines == ["rollout fleet: whole batches, one version on every server: drawing across batches would hold "
                     "4 copies of the weights in host memory (0.0 GiB), more than half of the 0.0 GiB available"]
    monkeypatch.setattr(schedule, "available_memory", lambda: None)  # unknown: drawn across batches
    assert schedule.copies_fit(policy, 8, lines.append) and len(lines) == 1
