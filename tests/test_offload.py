"""--offload-reference: the reference's weights live in a mapped file outside the process's resident memory
between its passes, give the same numbers, and a run with it ends where a run without it ends; the heap is given
back before a step's sampling and its update."""

from __future__ import annotations

import pytest
import torch

from auto_research.cli import main
from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.offload import OffloadedReference
from auto_research.engine.tiny import build_model, build_tokenizer
from test_lm_training import _config, _one_step_weights, reward_module  # noqa: F401  (a fixture)


def _model():
    return build_model(build_tokenizer(), seed=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64).eval()


def test_an_offloaded_model_gives_the_same_numbers_and_leaves_the_process_between_passes(tmp_path):
    model, original = _model(), _model()
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    offloaded = OffloadedReference(model, tmp_path)
    assert offloaded.resident_bytes() == 0  # released when made
    assert list(tmp_path.iterdir()) == []  # the file is unlinked at once: nothing is left behind
    assert model.get_input_embeddings().weight.data_ptr() != original.get_input_embeddings().weight.data_ptr()
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
    for (name, got), (_, want) in zip(model.named_parameters(), original.named_parameters()):
        assert torch.equal(got, want), name
    offloaded.release()  # (the comparisons read every page)
    sequences = torch.randint(4, 260, (4, 10), generator=torch.Generator().manual_seed(0))
    prompt_mask, mask = torch.ones(4, 4, dtype=torch.long), torch.ones(4, 6, dtype=torch.long)
    with torch.no_grad():
        got = token_logprobs(offloaded.fetch(), sequences, prompt_mask, mask)
        held = offloaded.resident_bytes()
        offloaded.release()
        want = token_logprobs(original, sequences, prompt_mask, mask)
    assert torch.equal(got, want)
    weights = sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
    assert held >= 0.9 * weights  # in use, the weights are the process's (within the mapping's padding)
    assert offloaded.resident_bytes() == 0  # and after the pass they are not
    with torch.no_grad():
        assert torch.equal(token_logprobs(offloaded.fetch(), sequences, prompt_mask, mask), want)  # back again


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_a_step_with_the_reference_offloaded_ends_where_it_ends_without(tiny_model_dir, sums_jsonl, tmp_path,
                                                                          reward_module, algorithm, monkeypatch):
    monkeypatch.setenv("AUTO_RESEARCH_CACHE", str(tmp_path / "cache"))
    plain, plain_row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "a", reward_module,
                                         algorithm=algorithm)
    offloaded, row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path / "b", reward_module,
                                       algorithm=algorithm, offload_reference=True)
    assert plain_row["kl"] != 0 or algorithm == "grpo"
    for key in ("kl", "loss", "grad_norm"):
        assert row[key] == plain_row[key], key
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name
    assert list((tmp_path / "cache" / "offload").iterdir()) == []


def test_rollouts_in_flight_read_the_offloaded_reference(tiny_model_dir, sums_jsonl, tmp_path, reward_module,
                                                         monkeypatch):
    """At --max-staleness 1 the rollout side computes the reference's log-probs: from the offloaded weights
    themselves (a copy would be ordinary memory again), with the numbers of a copy."""
    from auto_research.train.trainer import Trainer

    monkeypatch.setenv("AUTO_RESEARCH_CACHE", str(tmp_path / "cache"))
    finals = []
    for offload, folder in ((False, "a"), (True, "b")):
        config = _config(tiny_model_dir, sums_jsonl, tmp_path / folder, reward=[f"{reward_module}:checksum"],
                         beta=0.1, max_staleness=1, steps=3, eval_every=0, checkpoint_every=0,
                         offload_reference=offload)
        trainer = Trainer.build(config, log=lambda text: None)
        rows = [trainer.step(step) for step in (1, 2, 3)]
        if offload:
            assert trainer.components.offloaded_reference.resident_bytes() == 0
        finals.append(([row["kl"] for row in rows], {n: p.detach().clone()
                                                     for n, p in trainer.components.policy.named_parameters()}))
        trainer.close()
    (kl, weights), (offloaded_kl, offloaded_weights) = finals
    assert offloaded_kl == kl and any(value != 0 for value in kl)
    for name in weights:
        assert torch.equal(weights[name], offloaded_weights[name]), name


@pytest.mark.parametrize("flags, message", [
    (["--lora-r", "4"], "--offload-reference with --lora-r: the reference is the policy with its adapters off"),
    (["--fsdp"], "--offload-reference with --fsdp is not built"),
])
def test_offloading_what_cannot_be_offloaded_is_refused(tiny_model_dir, sums_jsonl, tmp_path, capsys, flags,
                                                        message):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--offline",
                 "--device", "cpu", "--output-dir", str(tmp_path / "run"), "--offload-reference", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_cpu_step_gives_the_heap_back_before_sampling_and_before_the_update(tiny_model_dir, sums_jsonl, tmp_path,
                                                                 reward_module, monkeypatch):
    from auto_research.engine import heap
    from auto_research.train import step as step_module

    assert heap.release_free_memory()  # glibc, on this Linux machine
    phases = ("waiting_for_rollouts", "score", "experience", "advantages", "update_actor", "update_critic",
              "weight_sync")  # the trainer's phases, in rl_step's order
    calls, started = [], []
    original = step_module._timer

    def timer(c, seconds):
        timed = original(c, seconds)

        def watched(phase):
            started.append((phase, len(calls)))
            return timed(phase)

        return watched

    monkeypatch.setattr(step_module, "_timer", timer)
    monkeypatch.setattr(step_module, "release_free_memory", lambda: calls.append(1))
    _, row = _one_step_weights(tiny_model_dir, sums_jsonl, tmp_path, reward_module)
    # The step's start and the update each gave the heap back once, as they started (before their clocks, so
    # before their work); no other phase did.
    assert [phase for phase, _ in started] == list(phases)
    given_back = [phases[index] for index in range(len(phases)) if index + 1 < len(started)
                  and started[index + 1][1] > started[index][1]] + ([phases[-1]] if len(calls) > started[-1][1] else [])
    assert given_back == ["waiting_for_rollouts", "update_actor"] and len(calls) == 2
    assert all(f"time_{phase}" in row for phase in phases)
