"""LoRA through PEFT: low-rank adapters train, the base weights stay frozen, and the reference costs no second
copy of the model.

* A fresh run adds adapters (``--lora-r`` …; by default PEFT's ``all-linear``). The reference is the same model with
  its adapters disabled, which is exactly the starting policy, since LoRA's B starts at zero.
* A run that starts from an adapter folder continues that adapter, and its reference is a frozen copy of the same
  adapter (named ``reference``): disabling it would measure the KL to a policy the run never started from.

Checkpoints hold the trainable adapter only; ``--merge-lora`` also writes the merged model at the end.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from auto_research.errors import UserError, one_line

REFERENCE = "reference"


def _peft():
    """PEFT is an optional dependency (the ``lora`` extra): imported only by runs that ask for LoRA."""
    try:
        import peft
    except ImportError:
        raise UserError("--lora-r needs the peft package: pip install 'auto-research[lora]' (or pip install peft)") from None
    return peft


def attach_saved_adapter(model, name: str, trainable: bool):
    """The base ``model`` with the adapter saved in folder ``name``."""
    peft = _peft()
    try:
        return peft.PeftModel.from_pretrained(model, name, is_trainable=trainable)
    except Exception as error:  # noqa: BLE001 - a damaged adapter surfaces as many types
        raise UserError(f"--model {name}: cannot load the adapter ({one_line(error)})") from None


class _Reference:
    """A reference that calls the policy's own PEFT model (its parameters are the model's)."""

    def __init__(self, model, adapter: str | None = None):
        self.model, self.adapter = model, adapter

    def parameters(self):
        return self.model.parameters()


class AdaptersDisabled(_Reference):
    """Calls the model with its adapters off: the base model, the reference of a fresh LoRA run."""

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


class AdapterSwitched(_Reference):
    """Calls the model with another (frozen) adapter active, then switches back to the trained one."""

    def __call__(self, **inputs):
        self.model.set_adapter(self.adapter)
        try:
            return self.model(**inputs)
        finally:
            self.model.set_adapter("default")
            _freeze(self.model, self.adapter)


def _freeze(model, adapter: str) -> None:
    for name, parameter in model.named_parameters():
        if f".{adapter}." in name:
            parameter.requires_grad_(False)


def linear_module_names(model) -> list[str]:
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    return sorted(names - {"lm_head", "score"})


def add_adapters(model, lora, model_name: str):
    """(policy with trainable adapters, reference callable) for ``--lora-r`` (``lora``: the run's LoRA settings,
    ``config.sections.LoraSection``)."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        # Started from a saved adapter: continue it; the reference is that adapter, frozen.
        model.load_adapter(model_name, adapter_name=REFERENCE, is_trainable=False)
        model.set_adapter("default")
        _freeze(model, REFERENCE)
        return model, AdapterSwitched(model, REFERENCE)
    if lora.lora_target_modules:
        targets = [name.strip() for name in lora.lora_target_modules.split(",") if name.strip()]
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [name for name in targets if name not in present]
        if missing:
            raise UserError(f"--lora-target-modules {','.join(missing)}: no module of {model_name} is named so; its "
                            f"linear layers are {', '.join(linear_module_names(model))}")
    else:
        targets = "all-linear"
    settings = peft.LoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha or 2 * lora.lora_r,
                               lora_dropout=lora.lora_dropout, target_modules=targets, bias="none",
                               task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, settings)
    return model, AdaptersDisabled(model)


def load_adapter_weights(folder: Path, model) -> None:
    """A checkpoint's adapter weights into the (not yet wrapped) PEFT model."""
    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        raise UserError(f"--resume: checkpoint {folder} holds no adapter (was the run started without --lora-r?)")
    result = _peft().set_peft_model_state_dict(model, load_file(str(path)), adapter_name="default")
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"--resume: checkpoint {folder} does not match the adapters ({len(unexpected)} unexpected tensors)")


def save_merged(model, tokenizer, folder: Path) -> Path:
    """Base weights + the trained adapter folded in, as an ordinary model folder."""
    merged = model.merge_and_unload(adapter_names=["default"])
    merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
