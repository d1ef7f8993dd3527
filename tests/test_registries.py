"""The registries of names: a task, a sampler, a rollout mode … is one record, and every help text, check and
loader is made from the records (data/registry.py, engine/samplers.py, algorithms/)."""

from __future__ import annotations

import pytest

from auto_research.cli import build_parser
from auto_research.config.candidate import CandidateConfig
from auto_research.config.fields import check_candidate_dataset, check_generation_dataset
from auto_research.config.generation import GenerationConfig
from auto_research.data import registry
from auto_research.data.types import Example, Task
from auto_research.errors import UserError


def _help(command: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "2000")  # one line a flag: a name is never broken at its hyphen
    return build_parser(command)._subparsers._group_actions[0].choices[command].format_help()


def test_every_task_is_in_the_dataset_help_and_taken_by_dataset(monkeypatch):
    dataset_help = next(line for line in _help("post-train", monkeypatch).splitlines()
                        if line.strip().startswith("--dataset DATASET"))
    assert len(registry.TASKS) == 6
    for name, record in registry.TASKS.items():
        assert name in dataset_help
        if record.level == "candidate":
            CandidateConfig(dataset=name).validate()
        else:
            # A preference task trains against a learned reward model; gsm8k-generate has no embedded model.
            GenerationConfig(dataset=name, model=None if record.embedded_model else "some/model",
                             reward_model="some/reward-model" if record.preference else None).validate()
    with pytest.raises(UserError, match="unknown dataset 'arithmetic'; choose one of: arithmetic-smoke, "
                                        "gsm8k-candidate, arithmetic-generate, gsm8k-generate, preference-generate, "
                                        "preference-arithmetic, or a .jsonl file"):
        check_candidate_dataset("arithmetic")


def test_the_records_carry_what_the_lists_said():
    assert registry.task_names("generation", "embedded_model") == ("arithmetic-generate", "preference-generate",
                                                                  "preference-arithmetic")
    assert registry.task_names("generation", "preference") == ("preference-generate", "preference-arithmetic")
    assert registry.gold_names() == {"length": "preference-generate", "arithmetic": "preference-arithmetic"}
    presets = registry.generation_presets()
    assert list(presets) == ["arithmetic-generate", "gsm8k-generate", "preference-generate", "preference-arithmetic",
                             "jsonl"]
    assert presets["preference-arithmetic"] == dict(steps=300, learning_rate=3e-4, prompts_per_step=32,
                                                    temperature=1.5, max_new_tokens=6, evaluation_examples=500,
                                                    warmup_steps=10, eval_every=50)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.TASKS["gsm8k-generate"])


def _fake_task(record, settings) -> Task:
    rows = [Example(f"{a}+1=", str(a + 1)) for a in range(5)]
    return Task(record.name, rows[:3], rows[3:], rows[:3], verifier="match", source=f"seen {settings.dataset}")


def test_a_new_task_is_one_record(monkeypatch):
    from auto_research.data.tasks import load_task

    with pytest.raises(UserError, match="unknown dataset 'counting'"):
        check_generation_dataset("counting")
    monkeypatch.setitem(registry.TASKS, "counting", registry.TaskRecord("counting", "generation", _fake_task,
                                                                        "a test's"))
    check_generation_dataset("counting")
    with pytest.raises(UserError, match="counting is a generation-level dataset"):
        check_candidate_dataset("counting")
    task = load_task(GenerationConfig(dataset="counting", model="some/model").validate().filled().data)
    assert task.name == "counting" and task.source == "seen counting"
    assert [example.prompt for example in task.train] == ["0+1=", "1+1=", "2+1="]
    assert [example.answer for example in task.evaluation] == ["4", "5"]


def test_a_new_candidate_task_is_one_record(monkeypatch):
    from auto_research.candidate.trainer import load_data

    monkeypatch.setitem(registry.TASKS, "counting-candidate", registry.TaskRecord(
        "counting-candidate", "candidate", lambda record, config: ("data of", record.name, config.seed), "a test's",
        tag="counting"))
    config = CandidateConfig(dataset="counting-candidate", seed=7).validate()
    assert load_data(config) == ("data of", "counting-candidate", 7)
    with pytest.raises(UserError, match="counting-candidate is a candidate-level dataset"):
        check_generation_dataset("counting-candidate")


# --- the choices: each list once, where the code that acts on them lives ------------------------------------


def test_samplers_and_rollout_modes_come_from_the_engine_registry():
    from auto_research.engine import samplers

    assert {(record.engine, record.mode) for record in samplers.SAMPLERS.values()} == {
        ("builtin", "colocate"), ("vllm", "colocate"), ("vllm", "server"), ("builtin", "server"),
        ("builtin", "process")}
    assert all(name == samplers.sampler_key(record.engine, record.mode) for name, record in samplers.SAMPLERS.items())
    assert samplers.served_engines() == ("vllm", "builtin")
    with pytest.raises(ValueError, match="its mode one of colocate, server, process"):
        samplers.register(samplers.SamplerRecord("builtin", "remote", lambda needs: None))
    with pytest.raises(UserError, match=r"^--rollout-mode 'remote': choose one of colocate, server, process$"):
        GenerationConfig(vllm_mode="remote").validate()
    with pytest.raises(UserError, match=r"^--sampler 'sglang': choose one of builtin, vllm$"):
        GenerationConfig(sampler="sglang").validate()


def test_a_new_rollout_mode_is_taken_once_registered(monkeypatch):
    from auto_research.engine import samplers

    monkeypatch.setitem(samplers.ROLLOUT_MODES, "fleet", "several servers")
    monkeypatch.setattr(samplers, "SAMPLERS", dict(samplers.SAMPLERS))
    samplers.register(samplers.SamplerRecord("builtin", "fleet", lambda needs: None))
    config = GenerationConfig(vllm_mode="fleet").validate()
    assert samplers.sampler_record(config).name == "builtin-fleet"


def test_the_vllm_memory_default_is_written_once():
    from auto_research.engine.samplers import vllm_memory

    assert vllm_memory(None, "cpu") == (0.05, "host memory for its KV cache")
    assert vllm_memory(None, "cuda:0") == (0.3, "device memory")
    assert vllm_memory(0.5, "cpu")[0] == vllm_memory(0.5, "cuda")[0] == 0.5


def test_the_data_file_kinds_are_the_reader_s():
    from auto_research.config.fields import DATA_FILE_SUFFIXES, check_generation_dataset, is_data_source
    from auto_research.data.rows import DATA_FILE_KINDS

    assert DATA_FILE_SUFFIXES == tuple(DATA_FILE_KINDS) == (".jsonl", ".json", ".parquet", ".csv")
    assert all(is_data_source(f"rows{suffix}") for suffix in DATA_FILE_KINDS)
    with pytest.raises(UserError, match=r"^--dataset rows.txt: a data file must be .jsonl \(JSON Lines\), .json, "
                                        r".parquet or .csv, or a folder written by datasets' save_to_disk$"):
        check_generation_dataset("rows.txt")


def test_one_table_of_subcommands(capsys):
    from auto_research import cli
    from auto_research.cli import commands

    parser = build_parser()
    assert list(parser._subparsers._group_actions[0].choices) == list(cli.SUBCOMMANDS)
    assert not hasattr(commands, "COMMANDS")
    assert cli.SUBCOMMANDS["vllm-serve"].run is cli.SUBCOMMANDS["rollout-serve"].run is commands.rollout_serve
    # The table's function is the one called.
    assert cli.main(["rlhf", "--gold", "length", "--betas", "-1"]) == 2
    assert capsys.readouterr().err == "auto-research: error: --betas must be a finite number >= 0, got -1.0\n"


def test_aggregations_are_registered_like_losses():
    import torch

    from auto_research.algorithms import losses
    from auto_research.algorithms.registry import AGGREGATIONS

    assert set(losses.AGGREGATORS) == set(AGGREGATIONS)
    with pytest.raises(ValueError, match="not listed in algorithms/registry.py's AGGREGATIONS"):
        losses.register_aggregation("median")
    terms = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # Σ masked terms = 15; / (2 completions × 5 tokens) for the constant normaliser.
    assert float(losses.aggregate(terms, mask, "constant", sequences=2.0, tokens=5.0, groups=1.0,
                                  max_tokens=5.0)) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="unknown aggregation 'median'; choose one of sequence, token-mean"):
        losses.aggregate(terms, mask, "median", sequences=2.0, tokens=5.0, groups=1.0)


def test_kl_placements_are_asked_not_spelled():
    from auto_research.algorithms.registry import KL_PLACEMENTS, get_algorithm, kl_in_loss, kl_shapes_reward

    assert [name for name in KL_PLACEMENTS if kl_shapes_reward(name)] == ["reward"]
    assert [name for name in KL_PLACEMENTS if kl_in_loss(name)] == ["loss"]
    rloo = get_algorithm("rloo")
    assert (rloo.kl_estimator_for("reward"), rloo.kl_estimator_for("loss"), rloo.kl_estimator_for("none")) == (
        "k1", "k3", "k1")
    with pytest.raises(UserError, match="--kl-in reward: grpo's advantage does not use the shaped reward"):
        GenerationConfig(algorithm="grpo", kl_in="reward").validate()
    with pytest.raises(UserError, match="--kl-estimator k1 with --kl-in loss"):
        GenerationConfig(kl_in="loss", kl_estimator="k1").validate()
