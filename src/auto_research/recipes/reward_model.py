"""Reward-model training: one scalar head on a causal LM, fitted to preference pairs by Bradley–Terry,

    loss = −log σ(r(x, y_w) − r(x, y_l) − m) + c · (r(x, y_w) + r(x, y_l))²

with an optional margin m per pair (``--margin-field``) and centring coefficient c (Eisenstein et al., 2023; TRL's
``center_rewards_coefficient``). The result is a one-label ``AutoModelForSequenceClassification`` folder that
``--reward-model`` loads as it is, scoring ``prompt + completion`` as training did.
"""

from __future__ import annotations

import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from auto_research.config.recipes import RewardModelConfig
from auto_research.data.rows import load_rows
from auto_research.engine.models import quiet_transformers, resolve_device
from auto_research.engine.sources import check_model_source
from auto_research.engine.tiny import build_model, build_tokenizer
from auto_research.errors import UserError, one_line
from auto_research.files import atomic_write_json, check_writable_directory
from auto_research.locks import entries, locked
from auto_research.progress import Progress
from auto_research.report.plots import calibration_plot
from auto_research.rewards.reward_model import score_texts


def bradley_terry_loss(chosen, rejected, margin=None, center_coefficient: float = 0.0):
    """Mean over pairs of −log σ(r_w − r_l − m), plus c · mean (r_w + r_l)²."""
    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    if center_coefficient:
        loss = loss + center_coefficient * (chosen + rejected).square().mean()
    return loss


@dataclass
class Pair:
    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None


def _text(value, where: str, field: str, tokenizer) -> str:
    """A plain string, or a conversation (a list of {"role", "content"} messages) rendered as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(value, tokenize=False)
        return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in value)
    raise UserError(f"{where}: field {field!r} must be text or a list of chat messages, got {type(value).__name__}")


def preference_pairs(rows: list[dict], dataset: str, prompt_field: str | None, chosen_field: str,
                     rejected_field: str, margin_field: str | None, tokenizer, log=print) -> list[Pair]:
    """Rows → pairs; the prompt field may be absent (TRL's implicit-prompt format). A pair whose two sides are equal
    teaches nothing: counted, skipped."""
    if not rows:
        raise UserError(f"--dataset {dataset}: no rows")
    pairs, ties = [], 0
    for number, row in enumerate(rows, 1):
        where = f"{dataset}: row {number}"
        for field in (chosen_field, rejected_field, *([prompt_field] if prompt_field else []),
                      *([margin_field] if margin_field else [])):
            if field not in row or row[field] is None:
                raise UserError(f"{where} has no field {field!r} (fields: {', '.join(sorted(row))})")
        prompt = _text(row[prompt_field], where, prompt_field, tokenizer) if prompt_field else ""
        chosen = _text(row[chosen_field], where, chosen_field, tokenizer)
        rejected = _text(row[rejected_field], where, rejected_field, tokenizer)
        margin = None
        if margin_field:
            try:
                margin = float(row[margin_field])
            except (TypeError, ValueError):
                raise UserError(f"{where}: field {margin_field!r} must be a number, got {row[margin_field]!r}") from None
        if chosen == rejected:
            ties += 1
            continue
        pairs.append(Pair(prompt, chosen, rejected, margin))
    if ties:
        log(f"warning: {ties} of {len(rows)} pairs have chosen == rejected; they teach nothing and are left out")
    if len(pairs) < 2:
        raise UserError(f"--dataset {dataset}: {len(pairs)} usable pair(s); a reward model needs at least 2 "
                        "(one to train on, one held out)")
    return pairs


def pairwise_metrics(chosen, rejected) -> dict:
    """Held-out pairwise accuracy, mean reward gap and calibration of σ(r_w − r_l) in five bins."""
    gap = (chosen - rejected).double()
    probability = torch.sigmoid(gap)
    # Calibration: confidence in the predicted order against how often that order is right.
    confidence = torch.maximum(probability, 1 - probability)
    correct = (gap > 0).double()
    bins = []
    for low in (0.5, 0.6, 0.7, 0.8, 0.9):
        inside = (confidence >= low) & (confidence < low + 0.1 if low < 0.9 else confidence <= 1.0)
        if inside.any():
            bins.append({"confidence": float(confidence[inside].mean()), "accuracy": float(correct[inside].mean()),
                         "pairs": int(inside.sum())})
    return {"pairwise_accuracy": float(correct.mean()) if gap.numel() else float("nan"),
            "reward_gap": float(gap.mean()) if gap.numel() else float("nan"),
            "calibration": bins}


def train_reward_model(model_name: str | None, pairs: list[Pair], output_dir: Path, steps: int, batch_size: int,
                       learning_rate: float, evaluation_examples: int, seed: int, device: str, offline: bool,
                       center_coefficient: float = 0.0, max_length: int | None = None, progress: bool = True,
                       log=print, task=None) -> dict:
    """Fit the reward model and write it, with metrics.json and calibration.png, to ``output_dir``."""
    quiet_transformers()
    torch.manual_seed(seed)  # before any load: the fresh scalar head (and a fresh backbone) start the same each run
    if model_name is None:
        model_name = _fresh_backbone(output_dir, seed)
    model, tokenizer = _load(model_name, device, offline)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = min(evaluation_examples, len(pairs) - 1)
    evaluation = [pairs[i] for i in order[:held]]
    train = [pairs[i] for i in order[held:]]
    history = _fit_pairs(model, tokenizer, train, steps, batch_size, learning_rate, random.Random(seed + 1), device,
                         center_coefficient, max_length, Progress(steps, "reward model", enabled=progress, write=log))
    metrics = {"model": model_name, "train_pairs": len(train), "evaluation_pairs": len(evaluation), "steps": steps,
               "batch_size": batch_size, "learning_rate": learning_rate, "center_coefficient": center_coefficient,
               "seed": seed, **_held_out(model, tokenizer, evaluation, device, max_length), "history": history}
    if model_name.endswith(".backbone"):
        shutil.rmtree(model_name, ignore_errors=True)
        metrics["model"] = "embedded tiny model (fresh)"
    _save(output_dir, model, tokenizer, metrics)
    return {**metrics, "evaluation_indices": order[:held]}


def _fresh_backbone(output_dir: Path, seed: int) -> str:
    """Without --model: the tiny model, fresh, saved beside ``output_dir`` so it loads as any checkpoint."""
    tokenizer = build_tokenizer()
    backbone = build_model(tokenizer, seed=seed)
    staging = output_dir.parent / f".{output_dir.name}.backbone"
    backbone.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    return str(staging)


def _load(model_name: str, device: str, offline: bool):
    """The checkpoint as a one-label sequence classifier (a fresh scalar head) and its tokenizer."""
    check_model_source(model_name, offline)
    local = Path(model_name).expanduser().exists()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name, local_files_only=offline or local)
        model = AutoModelForSequenceClassification.from_pretrained(model_name, num_labels=1,
                                                                   local_files_only=offline or local)
    except Exception as error:  # noqa: BLE001
        raise UserError(f"--model {model_name}: cannot load as a reward model ({one_line(error)})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    return model, tokenizer


def _fit_pairs(model, tokenizer, train: list[Pair], steps: int, batch_size: int, learning_rate: float,
               generator: random.Random, device: str, center_coefficient: float, max_length: int | None,
               bar: Progress) -> list[dict]:
    """``steps`` AdamW steps on the Bradley–Terry loss, on ``batch_size`` pairs drawn with replacement each."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate, foreach=True)
    history = []
    model.train()
    for step in range(1, steps + 1):
        batch = [train[generator.randrange(len(train))] for _ in range(batch_size)]
        texts = [p.prompt + p.chosen for p in batch] + [p.prompt + p.rejected for p in batch]
        scores = score_texts(model, tokenizer, texts, device, batch_size=len(texts), max_length=max_length, grad=True)
        margin = (torch.tensor([p.margin for p in batch], device=scores.device)
                  if batch[0].margin is not None else None)
        loss = bradley_terry_loss(scores[:batch_size], scores[batch_size:], margin, center_coefficient)
        if not torch.isfinite(loss):
            raise UserError(f"the reward model's loss became {float(loss)} at step {step}; lower --learning-rate")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append({"step": step, "loss": float(loss.detach())})
        bar.update({"loss": f"{history[-1]['loss']:.3f}"})
    bar.close()
    model.eval()
    return history


def _held_out(model, tokenizer, evaluation: list[Pair], device: str, max_length: int | None) -> dict:
    """The held-out pairs' ``pairwise_metrics`` and the mean reward over both sides."""
    chosen = score_texts(model, tokenizer, [p.prompt + p.chosen for p in evaluation], device, max_length=max_length)
    rejected = score_texts(model, tokenizer, [p.prompt + p.rejected for p in evaluation], device, max_length=max_length)
    return {**pairwise_metrics(chosen, rejected), "reward_mean": float(torch.cat([chosen, rejected]).mean())}


def _save(output_dir: Path, model, tokenizer, metrics: dict) -> None:
    """The trained model as an ordinary checkpoint folder, with its metrics.json and calibration.png."""
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    atomic_write_json(output_dir / "metrics.json", metrics)
    calibration_plot(output_dir / "calibration.png", metrics)


# --- the command ---------------------------------------------------------------------------------------------


def run(config: RewardModelConfig) -> dict:
    """``auto-research reward-model``: preference pairs → a one-scalar reward model in --output-dir. Every input is
    checked first; the model is trained beside the earlier one and replaces it only at the end."""
    config.validate()
    check_writable_directory(config.output_dir)
    with locked(config.output_dir, "reward-model"):
        return _fit(config, Path(config.output_dir))


def _fit(config: RewardModelConfig, output: Path) -> dict:
    if entries(output) and not config.overwrite:
        raise UserError(f"{output} is not empty: choose another --output-dir, or --overwrite to replace it")
    if config.model is not None:
        check_model_source(config.model, config.offline)
    rows = load_rows(config.dataset, config.offline)
    log = lambda text: print(text, file=sys.stderr)  # noqa: E731
    tokenizer = build_tokenizer() if config.model is None else AutoTokenizer.from_pretrained(
        config.model, local_files_only=config.offline or Path(config.model).expanduser().exists())
    pairs = preference_pairs(rows, config.dataset, config.prompt, config.chosen_field, config.rejected_field,
                             config.margin_field, tokenizer, log=log)
    held = config.evaluation_examples or max(1, min(500, len(pairs) // 10))
    if held >= len(pairs):
        raise UserError(f"--evaluation-examples {held}: the dataset has {len(pairs)} usable pairs, and some must be "
                        "left to train on")
    staging = output / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        metrics = train_reward_model(config.model, pairs, staging, config.steps, config.batch_size,
                                     config.learning_rate, held, config.seed, resolve_device(config.device),
                                     config.offline, config.center_rewards_coefficient, config.max_length,
                                     progress=config.progress, log=log)
        replace_contents(output, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metrics


def replace_contents(folder: Path, staging: Path) -> None:
    """The locked ``folder``'s contents replaced by ``staging``'s (a folder inside it), then ``staging`` removed."""
    for path in entries(folder):
        if path != staging:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for path in staging.iterdir():
        path.replace(folder / path.name)
    staging.rmdir()
