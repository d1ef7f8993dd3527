"""The teachers' log-probs of a batch (on-policy distillation, docs/distillation.md): the rollout side scores each
batch once, as its reward does, and the scores travel with the batch (``rollouts.Drawn``), into a checkpoint's
batches in flight too, so a resumed run asks no teacher again.

Each row is scored by its prompt's teacher (the only one, or the one its ``teacher`` column names), by the policy's
own log-prob function at temperature 1 (a teacher loaded in this process) or by a rollout server's ``/logprobs``
(a served one). A served teacher that fails after its retries leaves its rows unscored, each with the cause, as a
failed reward does: the run goes on with the other rows, and a step in which no row could be scored stops in one
line (``rollouts.agreed_scores``). Its term is never read as zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from auto_research.data.tasks import row_teacher
from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout import Rollout
from auto_research.errors import RolloutEngineError
from auto_research.train.experience import no_grad_forward, widen


@dataclass(frozen=True)
class TeacherScores:
    """One batch's teacher log-probs: ``logprobs`` (B, T) at each completion token (0 on a row left unscored),
    ``failures`` (B,) why a row is unscored (None where scored), ``tokens`` {teacher: completion tokens it scored}."""

    logprobs: torch.Tensor
    failures: list
    tokens: dict

    @property
    def scored(self) -> torch.Tensor:
        return torch.tensor([failure is None for failure in self.failures])


def score_with_teachers(run, teachers: dict, rollout: Rollout, examples: list) -> TeacherScores:
    """Each row's teacher log-probs, a teacher's rows in runs of consecutive groups (one run, the whole batch, when
    one teacher scores it: its micro-batches are the trainer's)."""
    K, (rows, width) = rollout.group_size, rollout.completion_mask.shape
    names = [row_teacher(example, teachers) for example in examples for _ in range(K)]
    logprobs, failures = torch.zeros(rows, width), [None] * rows
    tokens = {name: 0 for name in teachers}
    start = 0
    while start < rows:
        stop = next((i for i in range(start, rows) if names[i] != names[start]), rows)
        part = rollout if (start, stop) == (0, rows) else rollout.rows(start, stop)
        try:
            logprobs[start:stop] = widen(_logprobs(run, teachers[names[start]], part).float().cpu(), width)
            tokens[names[start]] += int(part.trained_mask.sum())
        except RolloutEngineError as error:
            failures[start:stop] = [str(error)] * (stop - start)
        start = stop
    return TeacherScores(logprobs * rollout.trained_mask.float().cpu(), failures, tokens)


def _logprobs(run, teacher, rollout: Rollout) -> torch.Tensor:
    """(b, t) a teacher's log-prob of each completion token at temperature 1: a model's forward, or its server's."""
    if isinstance(teacher, torch.nn.Module):
        return no_grad_forward(run, teacher, rollout.to(run.device), token_logprobs, temperature=1.0)
    prompts = rollout.sequences[:, :rollout.prompt_length]
    answers = teacher.logprobs([row[mask.bool()].tolist() for row, mask in zip(prompts, rollout.prompt_mask)],
                               rollout.token_lists())
    values = torch.zeros(rollout.completion_mask.shape)
    for row, answer in zip(values, answers):
        row[: len(answer)] = torch.tensor(answer, dtype=row.dtype)
    return values
