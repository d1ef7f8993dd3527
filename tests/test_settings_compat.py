"""Settings in sections (issue 39) keep every flag and config-file key of the command line as it was before them
(main at baba7b7, listed here), each setting the same setting: a user's command or YAML does not break. The three
settings named after vLLM take their flags' names (``RENAMED``), their old names still accepted."""

from __future__ import annotations

import pytest

from auto_research.cli import build_parser
from auto_research.config.files import read_config_file
from auto_research.config.generation import RENAMED, GenerationConfig, OWNER
from auto_research.config.options import PostTrainOptions

# post-train's flags before the sections: flag=its setting.
FLAGS = """
    --algorithm=algorithm --answer-field=answer_field --beta=beta --checkpoint-every=checkpoint_every
    --checkpoint-mlp=checkpoint_mlp --clip-high=clip_high --clip-low=clip_low --clip-range=clip_range
    --config=config --critic-model=critic_model --dataset=dataset --dataset-dir=dataset_dir --device=device
    --dtype=dtype --dynamic-sampling=dynamic_sampling --entropy-coef=entropy_coef --env-timeout=env_timeout
    --environment=environment --eval-every=eval_every --evaluation-examples=evaluation_examples --fsdp=fsdp
    --gae-lambda=gae_lambda --generation-batch-size=generation_batch_size
    --gradient-checkpointing=gradient_checkpointing --group-size=group_size --judge=judge
    --keep-checkpoints=keep_checkpoints --kl-estimator=kl_estimator --kl-in=kl_in --learning-rate=learning_rate
    --log-completions=log_completions --log-every=log_every --lora-alpha=lora_alpha --lora-dropout=lora_dropout
    --lora-r=lora_r --lora-target-modules=lora_target_modules --loss-aggregation=loss_aggregation
    --lr-schedule=lr_schedule --mask-truncated=mask_truncated --max-grad-norm=max_grad_norm
    --max-new-tokens=max_new_tokens --max-refills=max_refills --max-rollout-mismatch=max_rollout_mismatch
    --max-staleness=max_staleness --max-tokens-per-micro-batch=max_tokens_per_micro_batch
    --max-trajectory-tokens=max_trajectory_tokens --max-turns=max_turns --maximum-examples=maximum_examples
    --merge-lora=merge_lora --micro-batch-size=micro_batch_size --model=model --no-chat-template=chat_template
    --no-dynamic-sampling=dynamic_sampling --no-progress=progress --no-whiten-advantages=whiten_advantages
    --normalize-advantages=normalize_advantages --offline=offline --offload-reference=offload_reference
    --output-dir=output_dir --overlong-buffer=overlong_buffer --overlong-penalty=overlong_penalty
    --overwrite=overwrite --policy-loss=policy_loss --ppo-epochs=updates_per_batch
    --ppo-mini-batches=ppo_mini_batches --prompt-field=prompt_field --prompts-per-step=prompts_per_step
    --report-to=report_to --resume=resume --reward=reward --reward-model=reward_model --reward-url=reward_url
    --reward-weights=reward_weights --rollout-cores=rollout_cores --rollout-correction=rollout_correction
    --rollout-correction-cap=rollout_correction_cap --rollout-function=rollout_function --rollout-memory=vllm_memory
    --rollout-mode=vllm_mode --rollout-server=vllm_server --run-name=run_name --sampler=sampler --seed=seed
    --seeds=seeds --std=std --steps=steps --temperature=temperature --threads=threads --tool-timeout=tool_timeout
    --tools=tools --top-k=top_k --top-p=top_p --tracker-project=tracker_project
    --updates-per-batch=updates_per_batch --value-clip=value_clip --verbose=verbose --verifier=verifier
    --vf-coef=vf_coef --vllm-memory=vllm_memory --vllm-mode=vllm_mode --vllm-server=vllm_server
    --warmup-ratio=warmup_ratio --warmup-steps=warmup_steps --weight-decay=weight_decay
"""
# Its config-file keys before the sections: key=its setting.
KEYS = """
    algorithm=algorithm answer-field=answer_field beta=beta chat-template=chat_template
    checkpoint-every=checkpoint_every checkpoint-mlp=checkpoint_mlp clip-high=clip_high clip-low=clip_low
    clip-range=clip_range critic-model=critic_model dataset=dataset dataset-dir=dataset_dir device=device
    dtype=dtype dynamic-sampling=dynamic_sampling entropy-coef=entropy_coef env-timeout=env_timeout
    environment=environment eval-every=eval_every evaluation-examples=evaluation_examples fsdp=fsdp
    gae-lambda=gae_lambda generation-batch-size=generation_batch_size gradient-checkpointing=gradient_checkpointing
    group-size=group_size judge=judge keep-checkpoints=keep_checkpoints kl-estimator=kl_estimator kl-in=kl_in
    learning-rate=learning_rate log-completions=log_completions log-every=log_every lora-alpha=lora_alpha
    lora-dropout=lora_dropout lora-r=lora_r lora-target-modules=lora_target_modules
    loss-aggregation=loss_aggregation lr-schedule=lr_schedule mask-truncated=mask_truncated
    max-grad-norm=max_grad_norm max-new-tokens=max_new_tokens max-refills=max_refills
    max-rollout-mismatch=max_rollout_mismatch max-staleness=max_staleness
    max-tokens-per-micro-batch=max_tokens_per_micro_batch max-trajectory-tokens=max_trajectory_tokens
    max-turns=max_turns maximum-examples=maximum_examples merge-lora=merge_lora micro-batch-size=micro_batch_size
    model=model normalize-advantages=normalize_advantages offline=offline offload-reference=offload_reference
    output-dir=output_dir overlong-buffer=overlong_buffer overlong-penalty=overlong_penalty overwrite=overwrite
    policy-loss=policy_loss ppo-epochs=updates_per_batch ppo-mini-batches=ppo_mini_batches progress=progress
    prompt-field=prompt_field prompts-per-step=prompts_per_step report-to=report_to resume=resume reward=reward
    reward-model=reward_model reward-url=reward_url reward-weights=reward_weights rollout-cores=rollout_cores
    rollout-correction=rollout_correction rollout-correction-cap=rollout_correction_cap
    rollout-function=rollout_function rollout-memory=vllm_memory rollout-mode=vllm_mode rollout-server=vllm_server
    run-name=run_name sampler=sampler seed=seed seeds=seeds std=std steps=steps temperature=temperature
    threads=threads tool-timeout=tool_timeout tools=tools top-k=top_k top-p=top_p tracker-project=tracker_project
    value-clip=value_clip verbose=verbose verifier=verifier vf-coef=vf_coef warmup-ratio=warmup_ratio
    warmup-steps=warmup_steps weight-decay=weight_decay whiten-advantages=whiten_advantages
"""


def _pairs(text: str) -> list[tuple[str, str]]:
    return [tuple(item.split("=")) for item in text.split()]


def _post_train_options() -> dict:
    parser = build_parser("post-train")
    return next(action for action in parser._actions if action.dest == "command").choices["post-train"]._option_string_actions


@pytest.mark.parametrize(("flag", "setting"), _pairs(FLAGS))
def test_every_flag_of_before_the_sections_sets_the_same_setting(flag, setting):
    action = _post_train_options().get(flag)
    assert action is not None, flag
    assert action.dest == RENAMED.get(setting, setting)


@pytest.mark.parametrize(("key", "setting"), _pairs(KEYS))
def test_every_config_key_of_before_the_sections_sets_the_same_setting(key, setting, tmp_path):
    new = RENAMED.get(setting, setting)
    item = next((item for item in [*GenerationConfig.flat_fields(), *PostTrainOptions.__dataclass_fields__.values()]
                 if item.name == new))
    value = {"bool": True, "int": 3, "float": 0.5, "list": ["match"]}.get(_kind(item), "x")
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: {value!r}\n".replace("'", '"').replace("True", "true"))
    settings = read_config_file(path, [GenerationConfig, PostTrainOptions])
    assert list(settings) == [new]


def _kind(item) -> str:
    text = str(item.type)
    for kind in ("bool", "int", "float", "list"):
        if text.startswith(kind):
            return kind
    return "text"


def test_the_old_names_of_the_rollout_settings_still_set_them():
    config = GenerationConfig(vllm_mode="server", vllm_server="127.0.0.1:8000", vllm_memory=0.2)
    assert (config.rollout_mode, config.rollout_server, config.rollout_memory) == ("server", "127.0.0.1:8000", 0.2)
    assert config.rollout.rollout_mode == "server" and config.vllm_mode == "server"


def test_every_setting_lives_in_one_section_and_flat_names_read_and_replace_it():
    import dataclasses

    assert len(OWNER) == len(GenerationConfig.flat_fields())
    config = dataclasses.replace(GenerationConfig(temperature=0.7), seed=3)
    assert (config.temperature, config.sampling.temperature, config.seed, config.run.seed) == (0.7, 0.7, 3, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sampling.temperature = 1.0
    with pytest.raises(TypeError, match="no_such_setting"):
        GenerationConfig(no_such_setting=1)
