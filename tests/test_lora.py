"""LoRA through PEFT: the reference without a second copy, adapters in checkpoints, bad settings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from auto_research.cli import main
from auto_research.config.generation import GenerationConfig
from auto_research.engine.logprobs import token_logprobs
from auto_research.train.components import parameter_counts
from auto_research.train.trainer import Trainer

pytest.importorskip("peft", reason="LoRA needs peft (installed with the dev extra)")


def _config(model_dir, dataset, output, **overrides):
    settings = dict(model=str(model_dir), dataset=str(dataset), output_dir=output, steps=2, prompts_per_step=4,
                    group_size=4, max_new_tokens=3, learning_rate=5e-2, evaluation_examples=8, eval_every=0,
                    checkpoint_every=1, progress=False, offline=True, seed=3, device="cpu", reward=["format"],
                    lora_r=4, beta=0.1)
    settings.update(overrides)
    return GenerationConfig(**settings).filled().validate()


def test_the_lora_reference_is_the_base_model_and_only_adapters_train(tiny_model_dir, sums_jsonl, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer.build(_config(tiny_model_dir, sums_jsonl, tmp_path), log=lambda text: None)
    # No second copy of the weights: the reference is the policy with its adapters off.
    assert parameter_counts(trainer.models, trainer.drawing, True)["reference"] == 0
    trainable = [name for name, p in trainer.components.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    # Move the adapters away from zero, so that the policy differs from the base model.
    with torch.no_grad():
        for name, parameter in trainer.components.policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rollout = trainer.sample(1)
    arguments = (rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    with torch.no_grad():
        expected = token_logprobs(base, *arguments)
        reference = token_logprobs(trainer.components.reference, *arguments)
        policy = token_logprobs(trainer.components.policy, *arguments)
    assert torch.allclose(reference, expected, atol=1e-6)
    assert (policy - expected).abs().max() > 1e-2  # the adapters are on for the policy
    frozen = {name: p.detach().clone() for name, p in trainer.components.policy.named_parameters() if not p.requires_grad}
    trainer.step(1)
    for name, parameter in trainer.components.policy.named_parameters():
        if not parameter.requires_grad:
            assert torch.equal(parameter, frozen[name]), name


def test_lora_checkpoints_hold_the_adapter_and_the_merged_model_loads(tiny_model_dir, sums_jsonl, tmp_path, capsys):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--reward", "format",
                 "--steps", "2", "--prompts-per-step", "4", "--max-new-tokens", "3", "--evaluation-examples", "4",
                 "--learning-rate", "5e-2", "--offline", "--device", "cpu", "--no-progress", "--lora-r", "4",
                 "--lora-target-modules", "q_proj,v_proj", "--merge-lora", "--output-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    run = tmp_path / "rloo-sums-seed42"
    checkpoint = run / "checkpoints" / "step-000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert {name.split(".")[-3] for name in adapter} == {"q_proj", "v_proj"}
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    # The merged model is an ordinary model; the checkpoint's adapter loads through --model as well.
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    changed = max(float((merged.state_dict()[name] - base[name]).abs().max()) for name in base if "q_proj" in name)
    assert changed > 0
    metrics = json.loads((run / "metrics.json").read_text())
    parameters = metrics["training"]["parameters"]
    assert 0 < parameters["trainable"] < parameters["policy"] / 5


def test_a_run_from_a_saved_adapter_keeps_that_adapter_as_its_reference(tiny_model_dir, sums_jsonl, tmp_path):
    first = Trainer.build(_config(tiny_model_dir, sums_jsonl, tmp_path / "first", steps=1), log=lambda text: None)
    with torch.no_grad():
        for name, parameter in first.components.policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    first.components.policy.save_pretrained(tmp_path / "adapter", selected_adapters=["default"])
    first.run.tokenizer.save_pretrained(tmp_path / "adapter")
    rollout = first.sample(1)
    arguments = (rollout.sequences, rollout.prompt_mask, rollout.completion_mask, 1.0)
    with torch.no_grad():
        adapted = token_logprobs(first.components.policy, *arguments)
    second = Trainer.build(_config(tmp_path / "adapter", sums_jsonl, tmp_path / "second"), log=lambda text: None)
    with torch.no_grad():
        reference = token_logprobs(second.components.reference, *arguments)
        policy = token_logprobs(second.components.policy, *arguments)
    # The reference is the starting adapter (not the bare base model), and so is the policy at step 0.
    assert torch.allclose(reference, adapted, atol=1e-6)
    assert torch.allclose(policy, adapted, atol=1e-6)
    second.step(1)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(second.components.reference, *arguments), adapted, atol=1e-6)
        assert (token_logprobs(second.components.policy, *arguments) - adapted).abs().max() > 1e-4


@pytest.mark.parametrize("flags, message", [
    (["--lora-r", "0"], "--lora-r must be a positive integer, got 0"),
    (["--lora-r", "4", "--lora-target-modules", "q_proj,attention_dense"],
     "--lora-target-modules attention_dense: no module of"),
    (["--lora-alpha", "16"], "--lora-alpha needs --lora-r"),
    (["--lora-r", "4", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1), got 1.5"),
])
def test_bad_lora_settings_are_one_line(tiny_model_dir, sums_jsonl, tmp_path, capsys, flags, message):
    code = main(["post-train", "--model", str(tiny_model_dir), "--dataset", str(sums_jsonl), "--offline", "--device",
                 "cpu", "--no-progress", "--output-dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
