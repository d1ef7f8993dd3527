"""The teachers' log-probs of a batch (on-policy distillation, docs/distillation.md): the rollout side scores each
batch once, as its reward does, and the scores travel with the batch (``rollouts.Drawn``), into a checkpoint's
batches in flight too, so a resumed run asks no teacher again.

Each row is scored by its prompt's teacher (the only one, or the one its ``teacher`` column names), by the policy's
own log-prob function at temperature 1 (a teacher loaded in this process) or by a rollout server's ``/logprobs``
(a served one). A served teacher that fails after its retries leaves its rows unscored, each with the cause, as a
failed reward does: the run goes on with the other rows, and a step in which no row could be scored stops in one
line (``rollouts.agreed_scores``). Its term is never read as zero.

Its stream ``teacher`` is d = log π_T − log π_old on the rows scored; its figures are docs/distillation.md's.
"""

from __future__ import annotations

import torch

from auto_research.algorithms.registry import kl_in_loss, kl_shapes_reward
from auto_research.config.loss import LossSection, served
from auto_research.data.tasks import row_teacher
from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.models import load_policy
from auto_research.engine.rollout import Rollout
from auto_research.engine.rollout.teacher import ServedTeacher
from auto_research.errors import RolloutEngineError
from auto_research.train.signals import OUTSIDE, Loading, OutsideSignal, RowScores


def teachers(loss: LossSection, loading: Loading) -> dict:
    """--teacher-model's teachers by name: each frozen in the compute dtype and wrapped for several processes as the
    reference is (its tokenizer is the policy's: ``components._check_tokenizers``), or, http://HOST:PORT, the client
    of the rollout server that scores for it (``ServedTeacher``, which checks the server's vocabulary)."""
    held = {}
    if loss.teachers and not (kl_shapes_reward(loss.kl_in) or kl_in_loss(loss.kl_in)):
        loading.log(f"--teacher-model {', '.join(loss.teachers.values())}: the reference KL is off (--kl-in none; "
                    "--kl-in reward or loss puts it back), the teacher's term takes its place")
    for name, source in loss.teachers.items():
        if served(source):
            held[name] = ServedTeacher(source, loading.tokenizer)
            continue
        held[name] = load_policy(source, loading.device, loading.compute_dtype, loading.offline,
                                 flag="--teacher-model")[0].eval().requires_grad_(False)
        loading.world.wrap(held[name], trains=False)
    return held


def score_with_teachers(run, teachers: dict, rollout: Rollout, examples: list) -> RowScores:
    """Each row's teacher log-probs, a teacher's rows in runs of consecutive groups (one run, the whole batch, when
    one teacher scores it: its micro-batches are the trainer's); with several teachers, the tokens each scored
    (``teacher/<name>/tokens``)."""
    from auto_research.train.experience import widen  # noqa: PLC0415 - experience reads this package's signals

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
    counts = {f"teacher/{name}/tokens": count for name, count in tokens.items()} if len(tokens) > 1 else {}
    return RowScores(logprobs * rollout.trained_mask.float().cpu(), failures, counts)


def _logprobs(run, teacher, rollout: Rollout) -> torch.Tensor:
    """(b, t) a teacher's log-prob of each completion token at temperature 1: a model's forward, or its server's."""
    if isinstance(teacher, torch.nn.Module):
        from auto_research.train.experience import no_grad_forward  # noqa: PLC0415 - see above

        return no_grad_forward(run, teacher, rollout.to(run.device), token_logprobs, temperature=1.0)
    prompts = rollout.sequences[:, :rollout.prompt_length]
    answers = teacher.logprobs([row[mask.bool()].tolist() for row, mask in zip(prompts, rollout.prompt_mask)],
                               rollout.token_lists())
    values = torch.zeros(rollout.completion_mask.shape)
    for row, answer in zip(values, answers):
        row[: len(answer)] = torch.tensor(answer, dtype=row.dtype)
    return values


def teacher_signal(run, models, rollout: Rollout, scores, old_logprobs, reference_logprobs):
    """d_t = log π_T(y_t) − log π_old(y_t) at each sampled token of a row its teacher scored (no gradient; the
    teachers' log-probs came with the batch); None without --teacher-model."""
    teacher = scores.streams.get("teacher")
    if teacher is None:
        return None
    return (teacher - old_logprobs) * rollout.trained_mask.float() * scores.scored.float().unsqueeze(1)


def teacher_figures(run, experience, advantages) -> dict:
    """A teacher's figures over every rank's tokens (``{}`` without one; docs/distillation.md): its reverse KL per
    token (the mean of −d), the dense term's share of the advantage (Σ|λ(d − b)| / Σ|Â|), how much the baseline
    lowers the per-token variance (1 − var(d − b) / var(d)) and mean square (1 − E[(d − b)²] / E[d²]: a constant
    offset, which var ignores, adds to the gradient's noise), over the rows a teacher scored, and the tokens scored."""
    if advantages.centred is None or "teacher" not in experience.streams:
        return {}
    scores, d, centred = experience.scores, experience.streams["teacher"], advantages.centred
    mask = experience.mask * scores.scored.float().unsqueeze(1)
    dense = (run.config.loss.distill_weight * centred).abs().sum()
    sums = run.world.total(torch.stack([mask.sum(), d.sum(), d.square().sum(), centred.sum(), centred.square().sum(),
                                      dense, (advantages.advantages * mask).abs().sum()]).double())
    tokens, d_sum, d_squares, c_sum, c_squares, dense, total = sums.tolist()
    variance = lambda summed, squares: squares / max(tokens, 1.0) - (summed / max(tokens, 1.0)) ** 2  # noqa: E731
    return {"teacher_reverse_kl": -d_sum / max(tokens, 1.0), "distill_share": dense / total if total else 0.0,
            "distill_variance_reduction": 1.0 - variance(c_sum, c_squares) / max(variance(d_sum, d_squares), 1e-30),
            "distill_square_reduction": 1.0 - c_squares / max(d_squares, 1e-30),
            "teacher_tokens": int(tokens)}


OUTSIDE["teacher"] = OutsideSignal(
    "loss", teachers, score_with_teachers, teacher_signal, teacher_figures,
    lambda held: {("teacher" if name == "teacher" else f"teacher/{name}"): model
                  for name, model in held.items() if isinstance(model, torch.nn.Module)})
