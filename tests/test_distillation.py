"""On-policy distillation (issue 55) on the open training signal (issue 54, item 5): the teacher's dense term
Â_{i,t} = A_i + λ·(d_{i,t} − b_i), d = sg(log π_T − log π_old), checked by hand, by enumeration on a 3-token toy,
against plain RLOO's rows, and its refusals (docs/distillation.md says which pitfall each test covers)."""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from auto_research import GenerationConfig, post_train
from auto_research.algorithms.estimators import dense_term
from auto_research.algorithms.losses import POLICY_LOSSES, LossInputs
from auto_research.algorithms.registry import get_algorithm
from auto_research.engine.distributed import World
from auto_research.engine.logprobs import token_logprobs
from auto_research.engine.rollout import Rollout
from auto_research.errors import UserError
from auto_research.train.experience import Experience, Scores
from auto_research.train.signals.teacher import score_with_teachers, teacher_signal
from auto_research.train.update import estimate_advantages
from conftest import run_cli

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
NOT_COMPARED = ("time_", "step_seconds", "tokens_per_second", "teacher_", "distill_")


def test_dense_term_by_hand():
    # One group of K = 3: d = [1, 3] (mean 2), [0, 0] (mean 0), [4, pad] (mean 4). The LOO baselines are the others'
    # means: b = (0 + 4)/2 = 2, (2 + 4)/2 = 3, (2 + 0)/2 = 1; so d − b = [−1, 1], [−3, −3], [3, 0 on the pad].
    d = torch.tensor([[1.0, 3.0], [0.0, 0.0], [4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    assert dense_term(d, mask, 3, "loo").tolist() == [[-1.0, 1.0], [-3.0, -3.0], [3.0, 0.0]]
    assert dense_term(d, mask, 3, "none").tolist() == [[1.0, 3.0], [0.0, 0.0], [4.0, 0.0]]
    assert dense_term(d[:1], mask[:1], 1, "loo").tolist() == [[1.0, 3.0]]  # K = 1: no other sample, b = 0
    # Row 2 unscored (its teacher failed): no term of its own, and out of the others' baselines: b = 4 and 2.
    valid = torch.tensor([True, False, True])
    assert dense_term(d, mask, 3, "loo", valid).tolist() == [[-3.0, -1.0], [0.0, 0.0], [2.0, 0.0]]
    assert dense_term(d, mask, 3, "none", valid).tolist() == [[1.0, 3.0], [0.0, 0.0], [4.0, 0.0]]


class _Toy(torch.nn.Module):
    """A model over a 3-token vocabulary whose next-token logits are ``logits`` at every position."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, **options):
        return SimpleNamespace(logits=self.logits.expand(*input_ids.shape, 3))


THETA = torch.tensor([0.3, -0.2, 0.5])   # the student's logits over a 3-token vocabulary
TEACHER = torch.tensor([1.5, -1.0, 0.1])


def _taught_gradient(draw, baseline: str = "none", penalty: float | None = None) -> torch.Tensor:
    """∇θ of the opd record's loss on one group of one-token completions ``draw`` of the student (logits THETA), by
    the code under test: the teacher's d (signals.teacher.teacher_signal, through the log-prob function the trainer
    calls), its baseline and the record's advantage (update.estimate_advantages, estimators.dense_term), the
    record's policy loss; averaged over the group. ``penalty``: that one value in place of every token's d."""
    K = len(draw)
    rollout = Rollout(torch.tensor([[0, y] for y in draw]), torch.ones(K, 1), torch.ones(K, 1), [""] * K, K)
    config = GenerationConfig(group_size=K, micro_batch_size=None, max_tokens_per_micro_batch=None, distill_weight=1.0,
                              distill_baseline=baseline, kl_in="none", beta=0.0, gae_lambda=1.0, std=None,
                              whiten_advantages=False, normalize_advantages=False)
    record = get_algorithm("opd")
    c = SimpleNamespace(config=config, world=World(), autocast=contextlib.nullcontext, algorithm=record, device="cpu")
    student = _Toy(THETA)
    logprobs = token_logprobs(student, rollout.sequences, rollout.prompt_mask, rollout.completion_mask)
    old, zero = logprobs.detach(), torch.zeros(K, 1)
    taught = score_with_teachers(c, {"teacher": _Toy(TEACHER)}, rollout, [None] * K)
    scores = Scores(torch.zeros(K), torch.ones(K, dtype=torch.bool), streams={"teacher": taught.values})
    d = teacher_signal(c, c, rollout, scores, old, None) if penalty is None else torch.full((K, 1), penalty)
    experience = Experience(rollout, scores, old, zero, {"task": zero, "kl": zero, "teacher": d})
    advantages = estimate_advantages(c, experience).advantages
    POLICY_LOSSES[record.policy_loss](LossInputs(logprobs, old, advantages, torch.ones(K, 1))).sum().backward()
    return student.logits.grad / K


def test_at_one_position_the_teachers_term_is_minus_the_reverse_kls_gradient_in_expectation_enumerated():
    # One position, the 3 tokens enumerated: E_y~π[∇(−d(y) log π(y))], d(y) = log π_T(y) − log π(y) detached, is
    # ∇ KL(π ‖ π_T), so a step against the loss is a step down the reverse KL (Σ_y π(y)∇log π(y) = 0 is why the
    # detached d suffices). Over several positions it is the sum of the per-position reverse KLs' gradients with the
    # prefixes held at their sampled values (docs/distillation.md); this checks the one position.
    pi = torch.softmax(THETA, -1)
    expected = sum(float(pi[y]) * _taught_gradient([y]) for y in range(3))
    theta = THETA.clone().requires_grad_(True)
    log_pi = torch.log_softmax(theta, -1)
    (log_pi.exp() * (log_pi - torch.log_softmax(TEACHER, -1))).sum().backward()  # the analytic reverse KL
    assert torch.allclose(expected, theta.grad, atol=1e-6) and theta.grad.abs().max() > 0.1


def test_a_penalty_that_does_not_depend_on_the_sampled_token_has_zero_gradient():
    # The trap of a full-distribution (or top-k) KL used as every token's reward (miles #2362): the same value c for
    # whichever token was drawn, so E[c ∇log π(y)] = c Σ_y ∇π(y) = 0. The sampled token's d is the signal.
    pi = torch.softmax(THETA, -1)
    penalty = float((pi * (torch.log(pi) - torch.log_softmax(TEACHER, -1))).sum())
    flat = sum(float(pi[y]) * _taught_gradient([y], penalty=-penalty) for y in range(3))
    sampled = sum(float(pi[y]) * _taught_gradient([y]) for y in range(3))
    assert flat.abs().max() < 1e-7 and penalty > 0.1 and sampled.abs().max() > 0.1


def test_the_leave_one_out_baseline_leaves_the_expected_gradient_unchanged_enumerated():
    # K = 3 samples of one token each from the 3-token student: all 27 draws, weighted by their probability. The LOO
    # baseline changes every draw's gradient but not the expected gradient (b_i does not depend on y_i).
    pi = torch.softmax(THETA, -1)
    expected, per_draw = {}, {}
    for baseline in ("none", "loo"):
        total = torch.zeros(3)
        for draw in itertools.product(range(3), repeat=3):
            gradient = _taught_gradient(list(draw), baseline)
            total += float(pi[list(draw)].prod()) * gradient
            per_draw.setdefault(draw, []).append(gradient)
        expected[baseline] = total
    assert torch.allclose(expected["loo"], expected["none"], atol=1e-6) and expected["none"].abs().max() > 0.1
    assert not torch.allclose(*per_draw[(0, 1, 1)])


def test_a_teacher_that_is_the_current_policy_changes_no_bit_of_the_gradient():
    # d ≡ 0 exactly when the teacher is the policy itself (the same log-prob function on the same weights, at
    # temperature 1), so the golden batch's gradient with the teacher's term on is the gradient without it, bit for
    # bit; another teacher changes it.
    from test_lm_core import _Fixed, _golden_setup

    golden, config, policy, reference, tokenizer, rollout = _golden_setup()
    plain = _Fixed(config, policy, reference, tokenizer, rollout, golden["rewards"]).gradient()
    taught = GenerationConfig(**{**config.to_json(), "teacher_model": "itself", "kl_in": "reward"}).filled()
    fixed = _Fixed(taught.validate(), policy, reference, tokenizer, rollout, golden["rewards"])
    teach = lambda teacher: replace(fixed.scores, streams={"teacher": score_with_teachers(  # noqa: E731
        fixed.run, {"teacher": teacher}, rollout, [None] * 3).values})
    fixed.scores = teach(policy)
    grads = fixed.gradient()
    assert all(torch.equal(grads[name], plain[name]) for name in plain)
    fixed.scores = teach(reference)  # other weights (seed 1): d is not 0, and the gradient moves
    assert not all(torch.allclose(fixed.gradient()[name], plain[name]) for name in plain)


def _rows(tmp_path, name: str, model, **settings) -> list[dict]:
    post_train(ROWS, model=str(model), **{"group_size": 4, "prompts_per_step": 2, "steps": 2, **settings},
               max_new_tokens=3, learning_rate=1e-3, output_dir=str(tmp_path / name), offline=True, device="cpu",
               progress=False, threads=1, eval_every=0, evaluation_examples=4, log=lambda text: None)
    (folder,) = (tmp_path / name).iterdir()
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _compared(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(NOT_COMPARED)}


def test_lambda_zero_reproduces_rloo_and_the_initial_student_as_teacher_gives_rloos_first_step(tiny_model_dir,
                                                                                              tmp_path):
    plain = _rows(tmp_path, "plain", tiny_model_dir)
    silent = _rows(tmp_path, "silent", tiny_model_dir, teacher_model=str(tiny_model_dir), distill_weight=0.0,
                   kl_in="reward")
    assert [_compared(row) for row in silent] == [_compared(row) for row in plain]
    assert silent[0]["teacher_tokens"] > 0 and silent[0]["distill_share"] == 0.0
    # λ = 1, teacher = the initial student: at step 1 d is 0 up to the sampler's rounding (its log-probs are the
    # incremental decode's), so the step's advantages are plain RLOO's.
    taught = _rows(tmp_path, "taught", tiny_model_dir, teacher_model=str(tiny_model_dir), kl_in="reward")
    assert abs(taught[0]["teacher_reverse_kl"]) < 1e-5
    for key in ("advantage_mean", "advantage_std", "advantage_abs_max", "objective", "pg_loss"):
        assert taught[0][key] == pytest.approx(plain[0][key], abs=1e-4), key


def _other_model(folder, seed: int = 5):
    """A tiny model with the policy's tokenizer and other weights: a teacher whose d is not 0."""
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=seed, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_opd_runs_on_rows_without_answers_and_moves_the_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    unanswered = [{"prompt": row["prompt"]} for row in ROWS]
    with pytest.raises(UserError, match="no answers"):
        post_train(unanswered, model=str(tiny_model_dir), output_dir=str(tmp_path), offline=True, device="cpu")
    post_train(unanswered, model=str(tiny_model_dir), algorithm="opd", teacher_model=str(_other_model(tmp_path / "t")),
               group_size=2, prompts_per_step=2, steps=1, max_new_tokens=3, output_dir=str(tmp_path / "opd"),
               offline=True, device="cpu", progress=False, threads=1, eval_every=0, evaluation_examples=2,
               log=lambda text: None)
    run = next((tmp_path / "opd").iterdir())
    (row,) = [json.loads(line) for line in run.joinpath("metrics.jsonl").open()]
    assert row["reward_mean"] == 0.0 and row["teacher_tokens"] > 0 and row["distill_share"] == pytest.approx(1.0)
    assert not any(key.startswith("no_signal_") for key in row)  # equal task rewards are not opd's signal
    before, after = load_file(str(tiny_model_dir / "model.safetensors")), load_file(
        str(sorted((run / "checkpoints").iterdir())[-1] / "model.safetensors"))
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("settings, message", [
    ({"algorithm": "opd"}, "--algorithm opd takes no task reward: its signal is a teacher's, so it needs "
                           "--teacher-model"),
    ({"distill_weight": 0.5}, "--distill-weight and --distill-baseline shape a teacher's term: give --teacher-model"),
    ({"teacher_model": "t", "distill_baseline": "mean"}, "--distill-baseline 'mean': choose one of loo, none"),
    ({"teacher_model": "t", "distill_weight": -1.0}, "--distill-weight must be a finite number >= 0, got -1.0"),
    ({"teacher_model": "t", "distill_weight": float("nan")}, "--distill-weight must be a finite number >= 0, got nan"),
    ({"algorithm": "opd", "teacher_model": "t", "dynamic_sampling": True}, "--dynamic-sampling drops groups whose task "
                                                                           "rewards are equal; opd takes no task reward"),
])
def test_bad_distillation_settings_are_one_line(settings, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        GenerationConfig(**settings).filled().validate()


@pytest.mark.parametrize("weight", ["nan", "-1"])
def test_a_bad_distill_weight_is_one_line(weight, tmp_path):
    result = run_cli("post-train", "--dataset", "arithmetic-generate", "--teacher-model", "t", "--distill-weight",
                     weight, "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"auto-research: error: --distill-weight must be a finite number >= 0, got {float(weight)}"]


def test_a_teacher_gets_the_kl_off_unless_asked():
    assert GenerationConfig(teacher_model="t").filled().kl_in == "none"
    assert GenerationConfig(teacher_model="t", kl_in="loss").filled().kl_in == "loss"
    assert GenerationConfig().filled().kl_in == "reward"


def _folder(path, tiny_model_dir, tokenizer=None):
    """A model folder with the tiny model's config.json and ``tokenizer`` (none: no tokenizer files), no weights."""
    path.mkdir()
    (path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_before_any_weights(tiny_model_dir, sums_jsonl,
                                                                                     tmp_path):
    # The teachers' folders hold no weights: the refusal comes from the tokenizers alone, before any model loads.
    from auto_research.engine.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    other = _folder(tmp_path / "other", tiny_model_dir, tokenizer)
    result = run_cli("post-train", "--dataset", str(sums_jsonl), "--model", str(tiny_model_dir), "--teacher-model",
                     str(other), "--steps", "1", "--offline", "--device", "cpu", "--output-dir", str(tmp_path / "runs"),
                     cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"auto-research: error: --teacher-model {other}: its tokenizer is not the policy's ({tiny_model_dir}): "
        f"{len(tokenizer)} tokens, the policy's {len(tokenizer) - 1}; it must score the policy's own token ids")
    # As many tokens, two of them swapped: the line names a token whose id differs.
    swapped = _folder(tmp_path / "swapped", tiny_model_dir, build_tokenizer())
    saved = json.loads((swapped / "tokenizer.json").read_text())
    vocabulary = saved["model"]["vocab"]
    vocabulary["a"], vocabulary["b"] = vocabulary["b"], vocabulary["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=rf"^--reference-model {swapped}: its tokenizer is not the policy's "
                                        rf"\({tiny_model_dir}\): 'a' is id {vocabulary['a']} there, {vocabulary['b']} "
                                        "in the policy's; it must score the policy's own token ids$"):
        _rows(tmp_path, "swapped", tiny_model_dir, reference_model=str(swapped))


def test_a_teacher_that_cannot_load_is_named_by_its_flag(tiny_model_dir, tmp_path):
    from auto_research.engine.tiny import build_tokenizer

    weightless = _folder(tmp_path / "weightless", tiny_model_dir, build_tokenizer())
    with pytest.raises(UserError, match=f"^--teacher-model {weightless}: cannot load"):
        _rows(tmp_path, "teacher", tiny_model_dir, teacher_model=str(weightless))
    bare = _folder(tmp_path / "bare", tiny_model_dir)  # a config.json only
    with pytest.raises(UserError, match=f"^--reference-model {bare}: "):
        _rows(tmp_path, "reference", tiny_model_dir, reference_model=str(bare))


def test_a_reference_model_with_lora_is_refused_before_torch(tiny_model_dir, sums_jsonl, tmp_path):
    result = run_cli("post-train", "--dataset", str(sums_jsonl), "--model", str(tiny_model_dir), "--reference-model",
                     str(tiny_model_dir), "--lora-r", "2", "--offline", "--output-dir", str(tmp_path / "runs"),
                     "--device", "cpu", cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "auto-research: error: --reference-model with --lora-r is not built: under LoRA the reference is the policy "
        "with its adapters off")
    assert "| torch\n" not in result.stderr  # refused before torch was imported


def test_the_teachers_figures_by_hand():
    from auto_research.train.metrics import outside_figures

    def figures(d, advantages=None, scored=(True,) * 4, tokens=None):
        d, mask, scored = torch.tensor(d), torch.ones(4, 2), torch.tensor(scored)
        centred = dense_term(d, mask, 2, "loo", scored)
        experience = SimpleNamespace(mask=mask, streams={"teacher": d * scored.unsqueeze(1)},
                                     scores=SimpleNamespace(scored=scored, counts={
                                         f"teacher/{name}/tokens": count for name, count in (tokens or {}).items()}))
        given = SimpleNamespace(centred=centred, advantages=centred if advantages is None else advantages)
        return outside_figures(SimpleNamespace(config=GenerationConfig(distill_weight=1.0), world=World()),
                               experience, given)

    # Two groups of K = 2 whose d is a prompt-level offset (−2 and 0): the LOO baseline takes all of it. d's mean is
    # −1 (reverse KL 1), var(d) = 2 − 1 = 1, E[d²] = 2; d − b ≡ 0.
    assert figures([[-2.0, -2.0], [-2.0, -2.0], [0.0, 0.0], [0.0, 0.0]]) == {
        "teacher_reverse_kl": 1.0, "distill_share": 0.0, "distill_variance_reduction": 1.0,
        "distill_square_reduction": 1.0, "teacher_tokens": 8}
    # Noise with no offset: group 1's means 2 and 0 give b = 0 and 2, d − b = [1, 3], [−2, −2] (group 2 all 0).
    # var(d) = 10/8 − (4/8)² = 1, var(d − b) = 18/8 − 0 = 2.25: the baseline adds variance (1 − 2.25 = −1.25);
    # mean squares 18/8 against 10/8: −0.8. Beside a task advantage of 1 on every token, Σ|Â| = 12: its share 8/12.
    noisy = figures([[1.0, 3.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],
                    advantages=torch.tensor([[2.0, 4.0], [-1.0, -1.0], [1.0, 1.0], [1.0, 1.0]]))
    assert noisy == {"teacher_reverse_kl": -0.5, "distill_share": pytest.approx(2 / 3),
                     "distill_variance_reduction": -1.25, "distill_square_reduction": pytest.approx(-0.8),
                     "teacher_tokens": 8}
    # Row 2 unscored (its teacher failed): its tokens leave every figure. d over rows 1, 3, 4 is [−2, −2], [0, 0],
    # [0, 0] (6 tokens, mean −2/3); row 1 has no scored partner (b = 0), group 2's baseline takes all; each teacher's
    # tokens as counted where it scored.
    partial = figures([[-2.0, -2.0], [5.0, 5.0], [0.0, 0.0], [0.0, 0.0]], scored=(True, False, True, True),
                      tokens={"a": 2, "b": 4})
    assert partial["teacher_tokens"] == 6 and partial["teacher_reverse_kl"] == pytest.approx(2 / 3)
    assert partial["teacher/a/tokens"] == 2 and partial["teacher/b/tokens"] == 4


def test_the_reference_model_is_a_setting(tiny_model_dir, tmp_path):
    # --reference-model: another model with the policy's tokenizer. At step 1 the sampling policy is the initial one,
    # so the default reference's KL is 0 and another reference's is not; the row's rewards are the same samples'.
    from auto_research.engine.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    other = tmp_path / "other-weights"
    build_model(tokenizer, seed=5, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(other)
    tokenizer.save_pretrained(other)
    default = _rows(tmp_path, "default", tiny_model_dir)[0]
    moved = _rows(tmp_path, "moved", tiny_model_dir, reference_model=str(other))[0]
    assert abs(default["kl"]) < 1e-5 and abs(moved["kl"]) > 0.01  # (k1: a sampled estimate, either sign)
    assert moved["reward_mean"] == default["reward_mean"] and moved["completion_length"] == default["completion_length"]


def test_a_run_with_a_teacher_resumes_to_the_same_rows(tiny_model_dir, tmp_path):
    # The teacher is frozen and reloaded; its d is recomputed from each batch, so a resumed run's rows are the
    # uninterrupted run's (times aside).
    settings = dict(teacher_model=str(tiny_model_dir), distill_weight=0.5, kl_in="reward", steps=4)
    whole = _rows(tmp_path, "whole", tiny_model_dir, **settings)
    _rows(tmp_path, "cut", tiny_model_dir, **{**settings, "steps": 2})
    resumed = _rows(tmp_path, "cut", tiny_model_dir, **settings, resume=True)
    assert [_compared(row) for row in resumed] == [_compared(row) for row in whole]
    assert [row["teacher_reverse_kl"] for row in resumed] == [row["teacher_reverse_kl"] for row in whole]


def test_two_processes_with_a_teacher_end_with_the_weights_of_one(tiny_model_dir, sums_jsonl, tmp_path):
    # torchrun N = 2 (DDP, then FSDP, which shards the teacher too) against one process, as tests/test_distributed.py
    # checks every layout: a teacher with other weights than the student's, so that d is not 0.
    import textwrap

    from auto_research.engine.tiny import build_model, build_tokenizer
    from test_distributed import REWARDS, test_two_processes_end_with_the_weights_of_one as two_against_one

    tokenizer = build_tokenizer()
    teacher = tmp_path / "teacher"
    build_model(tokenizer, seed=5, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "dist_rewards.py").write_text(textwrap.dedent(REWARDS))  # (test_distributed's workdir fixture)
    two_against_one(tiny_model_dir, sums_jsonl, workdir, "rloo", ("--teacher-model", str(teacher)))


def test_trls_beta_beside_a_teacher_is_refused_in_one_line(sums_jsonl, tmp_path):
    # DistillationConfig's beta is the generalised JSD's interpolation, ours (--beta) the KL's weight: a file with
    # both teacher_model_name_or_path and beta is refused rather than read as ours.
    config = tmp_path / "distill.yaml"
    config.write_text("teacher_model_name_or_path: teacher\nbeta: 0.5\n")
    result = run_cli("post-train", "--dataset", str(sums_jsonl), "--config", str(config), "--output-dir",
                     str(tmp_path / "runs"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "auto-research: error: TRL's beta: beside teacher_model_name_or_path it is the JSD's interpolation, here the "
        "KL's weight: leave it out (the reverse KL, its beta 1, is built) or use --teacher-model"]
    with pytest.raises(UserError, match="^TRL's beta: beside teacher_model_name_or_path"):
        GenerationConfig.from_trl({"teacher_model_name_or_path": "teacher", "beta": 0.5})
    assert GenerationConfig.from_trl({"teacher_model_name_or_path": "teacher"}).teacher_model == ["teacher"]
    # DistillationConfig's other names: accepted at the values that say what is built, else refused by name.
    assert GenerationConfig.from_trl({"teacher_model_name_or_path": "t", "lmbda": 1.0, "loss_top_k": 1,
                                      "use_teacher_server": False}).teacher_model == ["t"]
    with pytest.raises(UserError, match="^TRL's use_teacher_server: True: a served teacher here is auto-research "
                                        "rollout-serve, given as --teacher-model http://HOST:PORT"):
        GenerationConfig.from_trl({"teacher_model_name_or_path": "t", "use_teacher_server": True})
    with pytest.raises(UserError, match="^TRL's lmbda: 0.5: distillation here is always on the student's own samples"):
        GenerationConfig.from_trl({"teacher_model_name_or_path": "t", "lmbda": 0.5})
