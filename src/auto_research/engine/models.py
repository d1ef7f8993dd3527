"""Loading a policy (any AutoModelForCausalLM), its tokenizer and PPO's critic; devices and dtypes."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from auto_research.engine import lora, onednn
from auto_research.engine.packaged import materialise
from auto_research.engine.sources import base_of, check_model_source, is_adapter
from auto_research.errors import UserError, one_line

_log = logging.getLogger("auto_research")


def resolve_device(name: str = "auto") -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: Apple's MPS backend is not available on this machine; use --device cpu")
    if name not in ("cpu", "mps") and not name.startswith("cuda"):
        raise UserError(f"--device {name!r}: choose auto, cpu, cuda, cuda:N or mps")
    return name


def resolve_dtype(name: str, device: str):
    """auto: bfloat16 on a GPU that supports it, else float32."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") and torch.cuda.is_bf16_supported() else torch.float32
    if name not in table:
        raise UserError(f"--dtype {name!r}: choose one of auto, {', '.join(table)}")
    return table[name]


def quiet_transformers() -> None:
    """Our own progress bar and log lines say what happens; keep the library's per-load bars out."""
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(name: str, offline: bool, log=None, flag: str = "--model"):
    """A model's tokenizer (an adapter's own, else its base model's; padding with EOS when it has no pad token), its
    resolved name and where its weights are; ``flag`` names the model in any error."""
    quiet_transformers()
    check_model_source(name, offline, flag)
    name = materialise(name, offline, log or _log.info)
    adapter = is_adapter(name)
    weights = base_of(name) if adapter else name
    if adapter:
        check_model_source(weights, offline, f"{flag} {name}'s base model")
    local = Path(weights).expanduser().exists()
    tokenizer_source = name if not adapter or (Path(name).expanduser() / "tokenizer_config.json").is_file() else weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, local_files_only=offline or local)
    except Exception as error:  # a damaged file surfaces as many types: OSError, SafetensorError, ValueError …
        raise UserError(f"{flag} {name}: cannot load ({one_line(error)})") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"{flag} {name}: the tokenizer has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
        (log or _log.info)(f"tokenizer of {name} has no pad token; padding with its EOS token {tokenizer.eos_token!r}")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (backend.padding or backend.truncation):
        # A fast tokenizer's padding and truncation are state on the object, set by a call that asks for them:
        # none of ours does (encode_prompts pads itself), so threads sharing it never change it under each other.
        backend.no_padding()
        backend.no_truncation()
    return tokenizer, name, weights


def load_policy(name: str, device: str, dtype, offline: bool, log=None, keep_adapter: bool = False,
                flag: str = "--model"):
    """Model and tokenizer (``load_tokenizer``; ``flag`` names the model in any error). A LoRA adapter's folder loads
    its base model with the adapter: kept as a PEFT model to train on (``keep_adapter``), or merged into the weights."""
    tokenizer, name, weights = load_tokenizer(name, offline, log, flag)
    try:
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype,
                                                     local_files_only=offline or Path(weights).expanduser().exists())
    except Exception as error:  # as for the tokenizer: many exception types for one mistake
        raise UserError(f"{flag} {name}: cannot load ({one_line(error)})") from None
    if weights != name:  # an adapter on its base model
        model = lora.attach_saved_adapter(model, name, trainable=keep_adapter)
        if not keep_adapter:
            model = model.merge_and_unload()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    onednn.use_onednn(model)  # float32 products on the CPU through oneDNN (onednn.py); elsewhere torch's
    return model, tokenizer


def format_prompt(tokenizer, prompt, use_chat_template: bool) -> str:
    """The prompt as the model sees it: through the chat template when it has one. A conversation (a sequence of
    ``{role, content}`` messages) needs the template: refused in one line without it. As TRL renders a
    prompt-only conversation (``trl.data_utils.apply_chat_template``): one that ends with the assistant's turn is
    continued (its text is the start of the completion), any other gets the generation prompt."""
    if not isinstance(prompt, str):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("conversational prompts ({role, content} messages) need a model with a chat template, "
                            "and this tokenizer has none; give plain-text prompts")
        if not use_chat_template:
            raise UserError("conversational prompts are rendered with the chat template: drop --no-chat-template")
        continued = prompt[-1]["role"] == "assistant"
        return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=not continued,
                                             continue_final_message=continued, tokenize=False)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return prompt


def context_length(model) -> int | None:
    values = (getattr(model.config, key, None) for key in ("max_position_embeddings", "n_positions",
                                                            "max_sequence_length"))
    return next((value for value in values if isinstance(value, int) and value > 0), None)


def load_critic(name: str, device: str, offline: bool, vocabulary: int, flag: str = "--critic-model"):
    """PPO's value model: ``name``'s backbone (the policy, a reward model, or --critic-model) with a scalar head per
    token, in float32. The head starts at zero, so the first advantages are the returns themselves."""
    check_model_source(name, offline, flag)
    name = materialise(name, offline)
    local = Path(name).expanduser().exists()
    try:
        critic = AutoModelForTokenClassification.from_pretrained(name, num_labels=1, dtype=torch.float32,
                                                                 local_files_only=offline or local)
    except Exception as error:  # as in load_policy: many exception types for one mistake
        raise UserError(f"{flag} {name}: cannot load as a value model ({one_line(error)})") from None
    if critic.config.vocab_size != vocabulary:
        raise UserError(f"{flag} {name}: its vocabulary has {critic.config.vocab_size} tokens, the policy's "
                        f"{vocabulary}; the critic reads the policy's tokens")
    head = getattr(critic, "score", None) or getattr(critic, "classifier")
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.zero_()
    onednn.use_onednn(critic)
    return critic.to(device)
