"""A learned reward: a one-label sequence-classification model scoring ``prompt + completion`` text."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from auto_research.engine.packaged import materialise
from auto_research.engine.sources import check_model_source
from auto_research.errors import UserError, one_line


def score_texts(model, tokenizer, texts: list[str], device, batch_size: int = 16, max_length: int | None = None,
                grad: bool = False):
    """The single logit of each text: the one function that reward-model training and the RL reward both use."""
    scores = []
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start: start + batch_size], padding=True, truncation=True,
                              max_length=max_length, return_tensors="pt").to(device)
            scores.append(model(**batch).logits[:, 0].float())
    return torch.cat(scores) if scores else torch.zeros(0)


class RewardModel:
    """A sequence-classification model scoring ``prompt + completion`` text with its own tokenizer (so policy and
    reward model need not share a vocabulary): the head's single logit, as reward-model training scored it."""

    def __init__(self, path: str, device, offline: bool, batch_size: int = 16):
        check_model_source(path, offline, "--reward-model")
        path = materialise(path, offline)
        local = Path(path).expanduser().exists()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline or local)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=offline or local)
        except Exception as error:  # a damaged file surfaces as many exception types
            raise UserError(f"--reward-model {path}: cannot load ({one_line(error)})") from None
        labels = self.model.config.num_labels
        if labels != 1:
            raise UserError(f"--reward-model {path}: its head gives {labels} scores per text, a reward model gives one "
                            "(train one with auto-research reward-model)")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = self.model.to(device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = device, batch_size
        self.__name__ = f"reward-model:{path}"

    def __call__(self, prompts, completions, examples) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions)]
        return score_texts(self.model, self.tokenizer, texts, self.device, self.batch_size).tolist()
