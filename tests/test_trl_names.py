"""TRL's names for our settings (config/trl.py, docs/trl.md): each one sets the field it should, as a flag, a config
file key and a Python keyword; a TRL field without an equivalent is refused in one line; a TRL-style config file and
TRL-style keywords run."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from auto_research.cli import build_parser
from auto_research.cli.commands import _levels
from auto_research.config import trl
from auto_research.config.generation import GenerationConfig
from auto_research.errors import UserError
from tests.conftest import REPOSITORY, run_cli

# TRL name, its value, and the settings of ours it must give (written out by hand, not read from the table).
CASES = [
    ("num_generations", 6, {"group_size": 6}),
    ("max_completion_length", 48, {"max_new_tokens": 48}),
    ("max_steps", 7, {"steps": 7}),
    ("max_steps", -1, {}),
    ("beta", 0.01, {"beta": 0.01}),
    ("num_iterations", 2, {"updates_per_batch": 2}),
    ("epsilon", 0.1, {"clip_range": 0.1}),
    ("epsilon_high", 0.28, {"clip_high": 0.28}),
    ("loss_type", "grpo", {"loss_aggregation": "sequence-mean-token-mean"}),
    ("loss_type", "dr_grpo", {"loss_aggregation": "constant"}),
    ("loss_type", "dapo", {"loss_aggregation": "token-mean"}),
    ("loss_type", "cispo", {"loss_aggregation": "token-mean", "policy_loss": "cispo"}),
    ("scale_rewards", "group", {"std": "unbiased"}),
    ("scale_rewards", True, {"std": "unbiased"}),
    ("scale_rewards", "none", {"std": "none"}),
    ("scale_rewards", False, {"std": "none"}),
    ("importance_sampling_level", "sequence", {"policy_loss": "gspo"}),
    ("mask_truncated_completions", True, {"mask_truncated": True}),
    ("normalize_advantages", True, {"normalize_advantages": True}),
    ("reward_weights", [1.0, 0.5], {"reward_weights": [1.0, 0.5]}),
    ("reward_funcs", ["a:f", "b:g"], {"reward": ["a:f", "b:g"]}),
    ("temperature", 0.7, {"temperature": 0.7}),
    ("top_p", 0.9, {"top_p": 0.9}),
    ("top_k", 20, {"top_k": 20}),
    ("use_vllm", True, {"sampler": "vllm"}),
    ("use_vllm", False, {"sampler": "builtin"}),
    ("vllm_mode", "server", {"rollout_mode": "server"}),
    ("vllm_server_base_url", "http://10.0.0.2:8011", {"rollout_server": "10.0.0.2:8011"}),
    ("vllm_gpu_memory_utilization", 0.4, {"rollout_memory": 0.4}),
    ("vllm_importance_sampling_correction", False, {"rollout_correction": "none"}),
    ("vllm_importance_sampling_mode", "token_truncate", {"rollout_correction": "token-tis"}),
    ("vllm_importance_sampling_mode", "sequence_truncate", {"rollout_correction": "sequence-tis"}),
    ("vllm_importance_sampling_mode", "sequence_mask", {"rollout_correction": "sequence-mask"}),
    ("vllm_importance_sampling_clip_max", 3.0, {"rollout_correction_cap": 3.0}),
    ("max_tool_calling_iterations", 3, {"max_turns": 4}),
    ("learning_rate", 2e-6, {"learning_rate": 2e-6}),
    ("lr_scheduler_type", "cosine", {"lr_schedule": "cosine"}),
    ("lr_scheduler_type", "linear", {"lr_schedule": "linear"}),
    ("lr_scheduler_type", "constant_with_warmup", {"lr_schedule": "constant"}),
    ("lr_scheduler_type", "constant", {"lr_schedule": "constant", "warmup_steps": 0}),
    ("warmup_steps", 5, {"warmup_steps": 5}),
    ("warmup_steps", 0.1, {"warmup_ratio": 0.1}),
    ("warmup_ratio", 0.05, {"warmup_ratio": 0.05}),
    ("weight_decay", 0.01, {"weight_decay": 0.01}),
    ("max_grad_norm", 0.5, {"max_grad_norm": 0.5}),
    ("bf16", True, {"dtype": "bfloat16"}),
    ("bf16", False, {"dtype": "float32"}),
    ("gradient_checkpointing", True, {"gradient_checkpointing": True}),
    ("seed", 7, {"seed": 7}),
    ("output_dir", "out", {"output_dir": "out"}),
    ("run_name", "mine", {"run_name": "mine"}),
    ("project", "p", {"tracker_project": "p"}),
    ("report_to", ["tensorboard", "wandb"], {"report_to": "tensorboard,wandb"}),
    ("logging_steps", 3, {"log_every": 3}),
    ("save_steps", 25, {"checkpoint_every": 25}),
    ("save_total_limit", 3, {"keep_checkpoints": 3}),
    ("eval_steps", 10, {"eval_every": 10}),
    ("eval_strategy", "no", {"eval_every": 0}),
    ("log_completions", False, {"log_completions": 0}),
    ("num_completions_to_print", 4, {"log_completions": 4}),
    ("disable_tqdm", True, {"progress": False}),
]


@pytest.mark.parametrize(("name", "value", "expected"), CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_each_trl_name_sets_the_field_it_means(name, value, expected):
    assert trl.finish(trl.translate({name: value}), GenerationConfig()) == expected


def test_the_batch_in_completions_becomes_prompts_per_step_and_micro_batches(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    # 6 per device × 2 accumulation × 2 processes = 24 completions = 6 prompts of K = 4.
    settings = trl.finish(trl.translate({"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2,
                                         "num_generations": 4}), GenerationConfig())
    assert settings == {"micro_batch_size": 6, "prompts_per_step": 6, "group_size": 4}
    # Only the accumulation given: transformers' 8 per device.
    assert trl.finish(trl.translate({"gradient_accumulation_steps": 3}), GenerationConfig())["prompts_per_step"] == 12
    with pytest.raises(UserError, match=r"6 × gradient_accumulation_steps 1 × 2 processes = 12 completions, is not a "
                                        r"multiple of the group size K = 5"):
        trl.finish(trl.translate({"per_device_train_batch_size": 6, "num_generations": 5}), GenerationConfig())
    with pytest.raises(UserError, match="steps_per_generation"):
        trl.finish(trl.translate({"per_device_train_batch_size": 4, "steps_per_generation": 2}), GenerationConfig())


def test_server_address_epochs_and_the_bias_corrected_kl():
    assert trl.finish(trl.translate({"vllm_server_port": 8011}), GenerationConfig()) == {
        "rollout_server": "127.0.0.1:8011"}
    assert trl.finish(trl.translate({"num_train_epochs": 3.0, "max_steps": 5}), GenerationConfig()) == {"steps": 5}
    with pytest.raises(UserError, match="num_train_epochs: steps here draw fresh prompts"):
        trl.finish(trl.translate({"num_train_epochs": 3.0}), GenerationConfig())
    assert trl.finish(trl.translate({"use_bias_correction_kl": True, "beta": 0.0}), GenerationConfig()) == {"beta": 0.0}
    with pytest.raises(UserError, match="use_bias_correction_kl: true with beta 0.05"):
        trl.finish(trl.translate({"use_bias_correction_kl": True}), GenerationConfig())
    with pytest.raises(UserError, match="'constant' ignores warmup"):
        trl.finish(trl.translate({"lr_scheduler_type": "constant", "warmup_steps": 3}), GenerationConfig())


@pytest.mark.parametrize(("settings", "message"), [
    ({"sync_ref_model": True}, "TRL's sync_ref_model: True: TR-DPO's reference sync is not built"),
    ({"loss_type": "bnpo"}, "TRL's loss_type: 'bnpo' normalises by each process's own tokens"),
    ({"loss_type": "sapo"}, "TRL's loss_type: 'sapo' .SAPO's soft gate. is not built"),
    ({"scale_rewards": "batch"}, "TRL's scale_rewards: 'batch' .the batch's std, PPO Lite. is not built"),
    ({"vllm_importance_sampling_mode": "token_mask"}, "token_mask' .masking tokens. is not built"),
    ({"fp16": True}, "TRL's fp16: True needs loss scaling"),
    ({"report_to": ["all"]}, "'all' has no equivalent here"),
    ({"deepspeed": "ds.json"}, "DeepSpeed is not built"),
    ({"optim": "adafactor"}, "TRL's optim: 'adafactor': the optimizer is torch's AdamW"),
    ({"num_generations": 4, "generation_kwargs": {"min_tokens": 3}}, "TRL's generation_kwargs"),
    ({"lr_scheduler_type": "polynomial"}, "'polynomial' has no equivalent here; accepted: constant"),
    ({"eval_strategy": "epoch"}, "'epoch' has no equivalent here"),
    ({"no_such_field": 1}, "'no_such_field' is not a setting of TRL's RLOOConfig or GRPOConfig, nor of auto-research"),
])
def test_a_trl_field_without_an_equivalent_is_refused_in_one_line(settings, message):
    with pytest.raises(UserError, match=message) as caught:
        GenerationConfig.from_trl(settings)
    assert "\n" not in str(caught.value)


def test_neutral_values_are_accepted():
    config = GenerationConfig.from_trl({"sync_ref_model": False, "optim": "adamw_torch", "adam_beta2": 0.999,
                                        "remove_unused_columns": False, "push_to_hub": False, "logging_dir": "x",
                                        "gradient_checkpointing_kwargs": {"use_reentrant": False}})
    assert config == GenerationConfig()


def test_every_field_of_trainingarguments_and_trls_configs_is_mapped_or_refused_by_name():
    from transformers import TrainingArguments

    names = {item.name for item in dataclasses.fields(TrainingArguments) if item.init}
    # TRL 1.16's RLOOConfig and GRPOConfig fields beyond TrainingArguments (from TRL's source).
    names |= set("""model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
        remove_unused_columns num_generations num_generations_eval max_completion_length ds3_gather_for_generation
        shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature top_p top_k min_p
        generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode
        vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
        vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
        vllm_tensor_parallel_size beta num_iterations epsilon delta epsilon_high sapo_temperature_neg
        sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg importance_sampling_level
        reward_weights multi_objective_aggregation scale_rewards loss_type normalize_advantages reward_clip_range
        mask_truncated_completions sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile
        entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
        max_tool_calling_iterations vllm_importance_sampling_correction vllm_importance_sampling_mode
        vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min vllm_importance_sampling_cap
        off_policy_mask_threshold use_bias_correction_kl log_completions log_multimodal num_completions_to_print
        log_unique_prompts log_completions_hub_repo use_transformers_continuous_batching
        transformers_continuous_batching_config use_transformers_paged logging_steps gradient_checkpointing bf16
        lr_scheduler_kwargs use_liger_kernel torch_empty_cache_steps learning_rate""".split())
    ours = {item.name for item in GenerationConfig.flat_fields()}
    assert sorted(name for name in names if not trl.is_trl_name(name) and name not in ours) == []
    assert {"entropy_coef", "generation_batch_size"} <= ours  # ours by name, another meaning: docs/trl.md


def test_docs_table_lists_every_mapped_name():
    text = (REPOSITORY / "docs" / "trl.md").read_text()
    table = text.split("## The table", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"`([a-z0-9_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert listed == set(trl.MAPPED)


def _cli_settings(*words: str) -> dict:
    args = build_parser("post-train").parse_args(["post-train", *words])
    return _levels(args, [GenerationConfig])[0]


def test_flags_under_trls_names_dashed_and_underscored():
    settings = _cli_settings("--dataset", "x.jsonl", "--num_generations", "2", "--max-completion-length", "9",
                             "--per-device-train-batch-size", "4", "--gradient_accumulation_steps", "2",
                             "--use-vllm", "--loss_type", "dr_grpo", "--reward-funcs", "m:a", "m:b",
                             "--reward_weights", "1", "0.5", "--report_to", "wandb", "--learning_rate", "3e-6",
                             "--warmup_steps", "0.25", "--scale-rewards", "false", "--bf16", "false")
    assert settings == {"dataset": "x.jsonl", "group_size": 2, "max_new_tokens": 9, "micro_batch_size": 4,
                        "prompts_per_step": 4, "sampler": "vllm", "loss_aggregation": "constant",
                        "reward": ["m:a", "m:b"], "reward_weights": [1.0, 0.5], "report_to": "wandb",
                        "learning_rate": 3e-6, "warmup_ratio": 0.25, "std": "none", "dtype": "float32"}
    # A name that is ours and TRL's is ours when its text reads as ours, TRL's when only TRL's reading fits.
    assert _cli_settings("--log_completions", "4") == {"log_completions": 4}
    assert _cli_settings("--log_completions", "false") == {"log_completions": 0}
    assert _cli_settings("--warmup_steps", "3") == {"warmup_steps": 3}
    with pytest.raises(UserError, match=r"--group-size 4 and a TRL flag that sets it to 8 were both given"):
        _cli_settings("--group-size", "4", "--num-generations", "8")
    with pytest.raises(UserError, match="sync_ref_model: True: TR-DPO"):
        _cli_settings("--sync-ref-model", "true")


def test_a_config_file_of_trls_names_and_its_clashes(tmp_path):
    path = tmp_path / "rloo.yaml"
    path.write_text("num_generations: 2\nper_device_train_batch_size: 8\nmax_completion_length: 5\nmax_steps: 3\n"
                    "report_to: [tensorboard]\nlog_completions: false\nwarmup_steps: 0.5\nbeta: 0.02\n"
                    "sync_ref_model: false\n")
    settings = _cli_settings("--config", str(path), "--max-steps", "4")
    assert settings == {"group_size": 2, "micro_batch_size": 8, "prompts_per_step": 4, "max_new_tokens": 5,
                        "steps": 4, "report_to": "tensorboard", "log_completions": 0, "warmup_ratio": 0.5,
                        "beta": 0.02}
    path.write_text("group_size: 4\nnum_generations: 2\n")
    with pytest.raises(UserError, match=r"rloo.yaml: group-size is 4, and a TRL key sets it to 2: give one"):
        _cli_settings("--config", str(path))
    path.write_text("num_generation: 2\n")
    with pytest.raises(UserError, match="unknown key 'num_generation'; did you mean num-generations"):
        _cli_settings("--config", str(path))


def test_trls_warmup_ratio_and_linear_schedule_give_transformers_rates():
    from auto_research.train.update import learning_rate_at

    config = GenerationConfig.from_trl({"lr_scheduler_type": "linear", "warmup_ratio": 0.2, "max_steps": 10,
                                        "learning_rate": 1.0}, GenerationConfig(dataset="x.jsonl")).filled()
    assert config.warmup_steps == 2
    rates = [learning_rate_at(config.optimisation, update, 10) for update in range(10)]
    # Warmup 1/2, 2/2, then (10 - u) / 8 down to 1/8 at the last update (transformers' linear decay).
    assert rates == pytest.approx([0.5, 1.0, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])


def test_a_presets_warmup_is_at_most_a_tenth_of_the_steps_and_a_data_file_has_none():
    assert GenerationConfig(dataset="x.jsonl", steps=2).filled().warmup_steps == 0
    assert GenerationConfig(dataset="arithmetic-generate", steps=40).filled().warmup_steps == 4
    assert GenerationConfig(dataset="arithmetic-generate").filled().warmup_steps == 10
    assert GenerationConfig(dataset="arithmetic-generate", steps=40, warmup_steps=7).filled().warmup_steps == 7


RUN = ["--model", "{model}", "--dataset", "{data}", "--max-new-tokens", "3", "--evaluation-examples", "4",
       "--eval-every", "0", "--offline", "--device", "cpu", "--no-progress", "--threads", "1"]


def test_a_trl_style_config_file_runs_two_steps(tmp_path, tiny_model_dir, sums_jsonl):
    config = tmp_path / "trl.yaml"
    config.write_text("num_generations: 2\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 1\n"
                      "max_steps: 2\nlearning_rate: 1.0e-3\nlr_scheduler_type: constant_with_warmup\n"
                      "warmup_steps: 1\nlogging_steps: 1\nsave_steps: 1\nsave_total_limit: 1\nseed: 3\n")
    words = [word.format(model=tiny_model_dir, data=sums_jsonl) for word in RUN]
    result = run_cli("post-train", *words, "--config", str(config), "--output-dir", str(tmp_path / "out"),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warmup: the learning rate rises linearly to 0.001 over the first 1 of 2 steps" in result.stderr
    run = tmp_path / "out" / "rloo-sums-seed3"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "learning_rate" in row]
    assert [row["learning_rate"] for row in steps] == [1e-3, 1e-3]
    assert [path.name for path in (run / "checkpoints").iterdir()] == ["step-000002"]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["training"]["group_size"] == 2 and metrics["training"]["prompts_per_step"] == 2


def test_trl_style_python_keywords_run_two_steps(tmp_path, tiny_model_dir, sums_jsonl):
    from auto_research import post_train

    def correct(completions, answer, **kwargs):  # TRL's reward form
        return [1.0 if completion.strip() == expected else 0.0 for completion, expected in zip(completions, answer)]

    metrics = post_train(str(sums_jsonl), reward=correct, log=lambda text: None, model=str(tiny_model_dir),
                         num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_completion_length=3, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path / "out"),
                         run_name="trl-run", offline=True, device="cpu", evaluation_examples=4, eval_every=0,
                         progress=False, threads=1)
    assert metrics["training"]["steps"] == 2 and metrics["training"]["prompts_per_step"] == 2
    rows = (tmp_path / "out" / "trl-run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"step"' in row for row in rows) >= 2
