"""The Python API in TRL's shape: ``GenerationConfig`` takes TRL's names as keywords, and ``auto_research.Trainer``
(``Trainer(config, reward_funcs=..., train_dataset=...).train()``) runs post_train's one path (issue 53, item 5)."""

from __future__ import annotations

import json

import pytest

import auto_research
from auto_research import GenerationConfig, Trainer, post_train
from auto_research.errors import UserError


def test_generation_config_takes_trls_names_as_keywords_as_post_train_does():
    config = GenerationConfig(num_generations=4, max_completion_length=64, per_device_train_batch_size=8,
                              temperature=0.5)
    assert (config.group_size, config.max_new_tokens, config.micro_batch_size, config.prompts_per_step,
            config.temperature) == (4, 64, 8, 2, 0.5)
    assert config == GenerationConfig.from_trl({"num_generations": 4, "max_completion_length": 64,
                                                "per_device_train_batch_size": 8, "temperature": 0.5})
    with pytest.raises(UserError, match="TRL's sync_ref_model: True: TR-DPO's reference sync is not built"):
        GenerationConfig(sync_ref_model=True)
    with pytest.raises(UserError, match="given: give one"):
        GenerationConfig(group_size=2, num_generations=4)
    with pytest.raises(TypeError, match="no_such_setting"):  # neither ours nor TRL's: as for any class
        GenerationConfig(no_such_setting=1)


def test_the_package_exports_a_trainer():
    assert "Trainer" in auto_research.__all__ and auto_research.Trainer is Trainer


def _message(call) -> str:
    with pytest.raises(UserError) as caught:
        call()
    return str(caught.value)


def test_the_trainer_refuses_in_post_trains_one_lines_before_any_work(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    config = GenerationConfig(output_dir=tmp_path)
    for settings in ({"num_generaton": 3}, {"sync_ref_model": True}, {"group_size": 2, "num_generations": 4}):
        assert _message(lambda: Trainer(config, train_dataset=rows, **settings)) == \
            _message(lambda: post_train(rows, config=config, **settings))
    assert _message(lambda: Trainer(config, reward_funcs=[3])) == _message(lambda: post_train(rows, reward=[3]))
    assert _message(lambda: Trainer(peft_config=object())).startswith("peft_config: LoRA is given as settings here")
    assert _message(lambda: Trainer("Qwen/Qwen2.5-0.5B")).endswith("not a str (the model is model=...)")
    assert _message(lambda: Trainer(config, args={})) == "give the settings as config or as args (TRL's name for " \
                                                         "it), not both"
    assert "a dataset named by text" in _message(lambda: Trainer(train_dataset="x.jsonl", eval_dataset=rows))
    assert _message(lambda: Trainer(train_dataset=rows, eval_dataset=rows[:3], evaluation_examples=4)) == \
        "evaluation_examples 4 and eval_dataset's 3 rows differ: give one"


def test_the_trainer_trains_writes_the_run_folder_and_evaluates(tiny_model_dir, tmp_path):
    def correct(completions, answer, **kwargs):  # TRL's reward form
        return [1.0 if completion.strip() == expected else 0.0 for completion, expected in zip(completions, answer)]

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    trainer = Trainer({"model": str(tiny_model_dir), "num_generations": 2, "per_device_train_batch_size": 4},
                      reward_funcs=[correct], train_dataset=rows[:30], eval_dataset=rows[30:], max_steps=2,
                      max_completion_length=3, learning_rate=1e-3, output_dir=str(tmp_path), offline=True,
                      device="cpu", progress=False, threads=1, log=lambda text: None)
    before = trainer.evaluate()  # the starting model, built as the run builds it; nothing written
    assert not trainer.run_dir.exists()
    metrics = trainer.train()
    assert metrics["training"]["optimizer_updates"] == 2 and metrics["training"]["validation_examples"] == 6
    assert metrics["training"]["group_size"] == 2 and metrics["training"]["prompts_per_step"] == 2
    assert before == metrics["baseline"] and trainer.evaluate() == metrics["final"]
    assert trainer.run_dir == tmp_path / "rloo-rows-seed42"
    assert {"metrics.json", "metrics.jsonl", "report.md", "curves.png", "checkpoints"} <= {
        path.name for path in trainer.run_dir.iterdir()}
    steps = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == [1, 2] and all(row["grad_norm"] > 0 for row in steps)
    assert "reward/correct" in steps[0]
