"""Reward-model training: one scalar head on a causal LM, fitted to preference pairs by Bradley–Terry.

    loss = −log σ(r(x, y_w) − r(x, y_l) − m) + c · (r(x, y_w) + r(x, y_l))²

with an optional margin m per pair (``--margin-field``) and an optional centring
coefficient c that keeps rewards near 0 (Eisenstein et al., 2023, "Helping or
Herding?", whose auxiliary loss TRL's ``center_rewards_coefficient`` also uses).
The result is an ordinary ``AutoModelForSequenceClassification`` folder with one
label: ``--reward-model OUT`` loads it as it is, and scores ``prompt + completion``
exactly as training did (``score_texts``).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from auto_research.errors import UserError, one_line


def bradley_terry_loss(chosen, rejected, margin=None, center_coefficient: float = 0.0):
    """Mean over pairs of −log σ(r_w − r_l − m), plus c · mean (r_w + r_l)²."""
    import torch.nn.functional as F

    difference = chosen - rejected
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    if center_coefficient:
        loss = loss + center_coefficient * (chosen + rejected).square().mean()
    return loss


def score_texts(model, tokenizer, texts: list[str], device, batch_size: int = 16, max_length: int | None = None,
                grad: bool = False):
    """The single logit of each text: the one function the trainer and the RL reward both use."""
    import torch

    scores = []
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start: start + batch_size], padding=True, truncation=True,
                              max_length=max_length, return_tensors="pt").to(device)
            scores.append(model(**batch).logits[:, 0].float())
    return torch.cat(scores) if scores else torch.zeros(0)


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


def load_rows(dataset: str, offline: bool) -> list[dict]:
    """Rows of a preference (or prompt) dataset through Hugging Face ``datasets``: a .jsonl, .json,
    .parquet or .csv file, a folder written by ``save_to_disk``, or a hub name when online."""
    path = Path(dataset).expanduser()
    try:
        import datasets
    except ImportError:
        raise UserError("reading preference datasets needs the datasets package: pip install datasets") from None
    datasets.disable_progress_bars()
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        elif path.suffix in kinds:
            if not path.is_file():
                raise UserError(f"--dataset {dataset}: no such file")
            if not path.read_bytes().strip():
                return []
            loaded = datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train")
        elif path.exists():
            raise UserError(f"--dataset {dataset}: give a .jsonl, .json, .parquet or .csv file, or a save_to_disk folder")
        else:
            if offline:
                raise UserError(f"--dataset {dataset}: no such file or folder, and hub datasets need a connection (offline)")
            loaded = datasets.load_dataset(dataset, split="train")
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - malformed files surface as many types
        raise UserError(f"--dataset {dataset}: cannot read ({one_line(error)})") from None
    return [dict(row) for row in loaded]


def preference_pairs(rows: list[dict], dataset: str, prompt_field: str | None, chosen_field: str,
                     rejected_field: str, margin_field: str | None, tokenizer, log=print) -> list[Pair]:
    """Rows → pairs; the prompt field may be absent (TRL's implicit-prompt format: the prompt is
    inside chosen and rejected). A pair whose two sides are equal teaches nothing: counted, skipped."""
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
    import torch

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
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from auto_research.post_training.lm.models import check_model_source, quiet_transformers
    from auto_research.progress import Progress

    quiet_transformers()
    torch.manual_seed(seed)
    if model_name is None:
        from auto_research.post_training.lm.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        backbone = build_model(tokenizer, seed=seed)
        staging = output_dir.parent / f".{output_dir.name}.backbone"
        backbone.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        model_name = str(staging)
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
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = min(evaluation_examples, len(pairs) - 1)
    evaluation = [pairs[i] for i in order[:held]]
    train = [pairs[i] for i in order[held:]]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate, foreach=True)
    generator = random.Random(seed + 1)
    history = []
    bar = Progress(steps, "reward model", enabled=progress, write=log)
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
    chosen = score_texts(model, tokenizer, [p.prompt + p.chosen for p in evaluation], device, max_length=max_length)
    rejected = score_texts(model, tokenizer, [p.prompt + p.rejected for p in evaluation], device, max_length=max_length)
    metrics = {"model": model_name, "train_pairs": len(train), "evaluation_pairs": len(evaluation), "steps": steps,
               "batch_size": batch_size, "learning_rate": learning_rate, "center_coefficient": center_coefficient,
               "seed": seed, **pairwise_metrics(chosen, rejected),
               "reward_mean": float(torch.cat([chosen, rejected]).mean()), "history": history}
    if model_name.endswith(".backbone"):
        import shutil

        shutil.rmtree(model_name, ignore_errors=True)
        metrics["model"] = "embedded tiny model (fresh)"
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    clean = {key: (None if isinstance(value, float) and not math.isfinite(value) else value) for key, value in metrics.items()}
    (output_dir / "metrics.json").write_text(json.dumps(clean, indent=2))
    _calibration_plot(output_dir / "calibration.png", metrics)
    return {**metrics, "evaluation_indices": order[:held]}


def _calibration_plot(path: Path, metrics: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    bins = metrics["calibration"]
    left.plot([0.5, 1.0], [0.5, 1.0], color="grey", linestyle="--", label="calibrated")
    left.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label="held-out pairs")
    left.set_xlabel("σ(|r_w − r_l|): confidence in the predicted order")
    left.set_ylabel("fraction ordered right")
    left.set_title(f"pairwise accuracy {metrics['pairwise_accuracy']:.3f}")
    left.legend()
    right.plot([h["step"] for h in metrics["history"]], [h["loss"] for h in metrics["history"]])
    right.set_xlabel("step")
    right.set_ylabel("Bradley–Terry loss")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
