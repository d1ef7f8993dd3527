"""``auto-research sft``: supervised fine-tuning of any causal LM on a dataset's demonstrations, into a folder
that ``--model`` then takes."""

from __future__ import annotations

from dataclasses import replace

from auto_research.config.generation import GenerationConfig
from auto_research.config.recipes import SFTConfig
from auto_research.data.tasks import load_task
from auto_research.engine.machine import set_threads
from auto_research.engine.models import format_prompt, load_policy, quiet_transformers, resolve_device, resolve_dtype
from auto_research.engine.sources import check_model_source
from auto_research.engine.tiny import build_model, build_tokenizer
from auto_research.errors import UserError
from auto_research.files import atomic_write_json, check_writable_directory
from auto_research.locks import entries, locked
from auto_research.train.evaluation import greedy_accuracy
from auto_research.train.sft import supervised_fine_tune


def run(config: SFTConfig) -> dict:
    """Returns ``{"history": [...], "output_dir": folder}``."""
    config.validate()
    task_config = GenerationConfig(model=config.model, dataset=config.dataset, dataset_dir=config.dataset_dir,
                                   offline=config.offline, seed=config.seed, chat_template=config.chat_template,
                                   device=config.device, threads=config.threads, prompt_field=config.prompt_field,
                                   answer_field=config.answer_field)
    task_config.data.check()
    task_config = task_config.filled()
    check_writable_directory(config.output_dir)
    with locked(config.output_dir, "sft"):
        return _fine_tune(config, task_config)


def _fine_tune(config: SFTConfig, task_config: GenerationConfig) -> dict:
    output_dir = config.output_dir
    if not config.overwrite and entries(output_dir):
        raise UserError(f"--output-dir {output_dir} is not empty; choose another folder, or --overwrite to replace "
                        "what is there")
    if config.model is not None:
        check_model_source(config.model, config.offline)
    task = load_task(task_config.data)
    if any(example.solution is None and example.answer is None for example in task.demonstrations):
        raise UserError(f"sft trains on each row's answer (or a messages conversation's final assistant turn), and "
                        f"{task.name}'s rows have none")
    quiet_transformers()
    set_threads(config.threads)
    device = resolve_device(config.device)
    if config.model is None:
        tokenizer = build_tokenizer()
        policy = build_model(tokenizer, seed=config.seed).to(device)
    else:
        policy, tokenizer = load_policy(config.model, device, resolve_dtype(task_config.dtype, device), config.offline)
    pairs = [(format_prompt(tokenizer, example.messages or example.prompt, config.chat_template), example.solution or example.answer)
             for example in task.demonstrations]
    # Held-out prompts go through the chat template too, as the model will see them.
    formatted = replace(task, evaluation=[replace(e, prompt=format_prompt(tokenizer, e.messages or e.prompt, config.chat_template))
                                          for e in task.evaluation])
    history = supervised_fine_tune(
        policy, tokenizer, pairs, steps=config.steps, batch_size=config.batch_size,
        learning_rate=config.learning_rate, seed=config.seed,
        evaluate=lambda: {"held_out_accuracy": greedy_accuracy(policy, tokenizer, formatted,
                                                               task_config.max_new_tokens)},
        eval_every=max(1, config.steps // 4),
    )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        policy.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        atomic_write_json(output_dir / "sft.json", {"model": config.model or "embedded tiny (random init)",
                                                    "dataset": task.name, "demonstrations": len(pairs),
                                                    "steps": config.steps, "history": history})
    except OSError as error:
        raise UserError(f"cannot save the model to {output_dir}: {error.strerror or error}") from None
    return {"history": history, "output_dir": output_dir}
