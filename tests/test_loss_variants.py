"""The loss variants of 2025 (dr-grpo, dapo, gspo, cispo) and their knobs, each against numbers worked by hand from
its paper's formula on a small batch; the records name registered parts; impossible settings are one line, exit 2."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from auto_research.algorithms import losses
from auto_research.algorithms.estimators import (ADVANTAGE_ESTIMATORS, AdvantageInputs, normalise_over_batch,
                                                 overlong_penalty)
from auto_research.algorithms.registry import (AGGREGATIONS, POLICY_LOSSES, REGISTRY, ROLLOUT_CORRECTIONS,
                                               get_algorithm)
from auto_research.cli import main
from auto_research.config.generation import GenerationConfig


def _sequence_inputs(rewards, K, **extra) -> AdvantageInputs:
    """One token per completion: the per-token reward is the completion's reward."""
    rewards = torch.tensor(rewards, dtype=torch.float64).reshape(-1, 1)
    return AdvantageInputs(rewards, torch.ones_like(rewards), K, torch.ones(rewards.shape[0], dtype=torch.bool),
                           **extra)


def _loss_and_gradient(name, new, old, advantages, mask, aggregation, low, high, max_tokens=None):
    """The registered loss of ``name`` aggregated over the batch, and its gradient with respect to log π."""
    logprobs = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(mask, dtype=torch.float64)
    inputs = losses.LossInputs(logprobs, torch.tensor(old, dtype=torch.float64),
                               torch.tensor(advantages, dtype=torch.float64) * mask, mask, low, high)
    loss = losses.aggregate(losses.POLICY_LOSSES[name](inputs), mask, aggregation, sequences=float(mask.shape[0]),
                            tokens=float(mask.sum()), groups=1.0, max_tokens=max_tokens)
    loss.backward()
    return float(loss.detach()), logprobs.grad, losses.clip_fraction(name, inputs)


def test_every_record_names_registered_parts():
    for record in REGISTRY.values():
        assert record.advantage in ADVANTAGE_ESTIMATORS
        assert record.policy_loss in losses.POLICY_LOSSES and record.aggregation in AGGREGATIONS
        assert record.rollout_correction in ROLLOUT_CORRECTIONS
    # One list each: every listed loss is registered in torch, and nothing else is.
    assert set(losses.POLICY_LOSSES) == set(POLICY_LOSSES)
    dapo, gspo, cispo, dr = (get_algorithm(name) for name in ("dapo", "gspo", "cispo", "dr-grpo"))
    assert (dapo.clip_low, dapo.clip_high, dapo.aggregation, dapo.kl, dapo.dynamic_sampling) == (
        0.2, 0.28, "token-mean", "none", True)
    assert (gspo.policy_loss, gspo.aggregation, gspo.clip_low, gspo.clip_high) == (
        "gspo", "sequence-mean-token-mean", 3e-4, 4e-4)
    assert (cispo.policy_loss, cispo.aggregation, cispo.clip_low) == ("cispo", "token-mean", 1.0)
    assert (dr.advantage, dr.aggregation, dr.std, dr.kl) == ("dr-grpo", "constant", None, "none")


def test_the_record_defaults_fill_the_config():
    # arithmetic-generate's preset: 6 new tokens, so dapo's buffer is 6 // 5 = 1 token (DAPO: 4,096 of 20,480).
    dapo = GenerationConfig(algorithm="dapo").filled().validate()
    assert (dapo.kl_in, dapo.loss_aggregation, dapo.clip_low, dapo.clip_high, dapo.std) == (
        "none", "token-mean", 0.2, 0.28, "population")
    assert (dapo.overlong_buffer, dapo.overlong_penalty, dapo.policy_loss_in_use) == (1, 1.0, "clipped-token")
    rloo = GenerationConfig().filled().validate()
    assert (rloo.std, rloo.overlong_buffer, rloo.policy_loss_in_use, rloo.kl_estimator) == (None, 0, "vanilla", "k1")
    # A batch reused for several updates takes the record's loss with a ratio; --clip-range sets both sides,
    # --clip-high one side and wins.
    reused = GenerationConfig(updates_per_batch=2, clip_range=0.1, clip_high=0.3).filled().validate()
    assert (reused.policy_loss_in_use, reused.clip_low, reused.clip_high) == ("clipped-token", 0.1, 0.3)
    # Moved into the loss, the KL takes k3 (k1's expected gradient there is zero).
    assert GenerationConfig(kl_in="loss").filled().kl_estimator == "k3"


def test_dr_grpo_centres_without_std_and_normalises_by_a_constant():
    # Rewards 1, 0, 0, 1: mean 0.5, so A = ±0.5 (no std); RLOO's is K/(K−1) = 4/3 times that.
    advantages, _ = ADVANTAGE_ESTIMATORS["dr-grpo"](_sequence_inputs([1.0, 0.0, 0.0, 1.0], 4))
    assert advantages.reshape(-1).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    rloo, _ = ADVANTAGE_ESTIMATORS["rloo"](_sequence_inputs([1.0, 0.0, 0.0, 1.0], 4))
    assert rloo.reshape(-1).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # Two completions of 3 and 1 tokens, A = +0.5 and −0.5, on-policy (ρ = 1), --max-new-tokens 4: the loss is
    # −Σ_i Σ_t ρ_t A_i / (2 completions × 4), so ∂/∂log π_t = −A_i / 8 on every token, whatever the length
    # (the sequence-mean-token-mean of GRPO's paper would give the 3-token completion a third of it).
    same = [[-1.0, -2.0, -0.5], [-0.7, 0.0, 0.0]]
    value, gradient, _ = _loss_and_gradient("clipped-token", same, same, [[0.5], [-0.5]],
                                            [[1, 1, 1], [1, 0, 0]], "constant", 0.2, 0.2, max_tokens=4.0)
    assert value == pytest.approx(-(3 * 0.5 - 0.5) / 8)
    assert gradient.tolist() == [pytest.approx(row) for row in [[-0.0625] * 3, [0.0625, 0, 0]]]


def test_dapo_clip_higher_keeps_the_gradient_of_a_rising_token():
    # Token 1: ρ = 1.25, A = +1. Symmetric ε = 0.2: min(1.25, 1.2) = 1.2, clipped, no gradient. DAPO's ε_high 0.28:
    # min(1.25, 1.25) → the term −ρA, ∂/∂log π = −ρA = −1.25. Token 2: ρ = 0.75, A = −1: −min(−0.75, −0.8) = 0.8,
    # clipped below (ε_low 0.2 both times), no gradient. Token-mean over 2 tokens: ½ of each.
    old = [[0.0, 0.0]]
    new = [[math.log(1.25), math.log(0.75)]]
    advantages = torch.tensor([[1.0, -1.0]])
    for high, first_gradient, first_term in ((0.2, 0.0, -1.2), (0.28, -1.25, -1.25)):
        logprobs = torch.tensor(new, dtype=torch.float64, requires_grad=True)
        inputs = losses.LossInputs(logprobs, torch.tensor(old, dtype=torch.float64), advantages.double(),
                                   torch.ones(1, 2, dtype=torch.float64), 0.2, high)
        loss = losses.aggregate(losses.POLICY_LOSSES["clipped-token"](inputs), inputs.mask, "token-mean",
                                sequences=1.0, tokens=2.0, groups=1.0)
        loss.backward()
        assert float(loss.detach()) == pytest.approx((first_term + 0.8) / 2)
        assert logprobs.grad.tolist() == [pytest.approx([first_gradient / 2, 0.0])]


def test_dapo_overlong_punishment_by_hand():
    # L_max 6, buffer L 2, P 1: 0 up to 6 − 2 = 4 tokens, then −(|y| − 4)/2: 5 → −0.5, 6 → −1.
    lengths = torch.tensor([3, 4, 5, 6])
    assert overlong_penalty(lengths, 6, 2, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 6, 2, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


def test_dapo_advantages_see_the_overlong_punishment():
    from auto_research.engine.distributed import World
    from auto_research.train.experience import Scores, task_reward
    from auto_research.train.update import estimate_advantages

    # One group of 4 scored 1, 1, 1, 0 with 2, 3, 6, 6 tokens; dapo's default buffer at 6 new tokens is 1, so the
    # two 6-token completions lose 1: shaped rewards 1, 1, 0, −1, mean 0.25, population std √(2.75/4) = 0.829156:
    # A = (0.75, 0.75, −0.25, −1.25) / 0.829156 = 0.904534, 0.904534, −0.301511, −1.507556.
    config = GenerationConfig(algorithm="dapo", group_size=4).filled().validate()
    mask = torch.tensor([[1.0] * 2 + [0] * 4, [1.0] * 3 + [0] * 3, [1.0] * 6, [1.0] * 6])
    scores = Scores(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.ones(4, dtype=torch.bool))
    c = SimpleNamespace(config=config, algorithm=get_algorithm("dapo"), world=World())
    # The punishment is added where the task's stream is made (the ``task`` source), before any estimator.
    streams = {"task": task_reward(c, None, SimpleNamespace(trained_mask=mask), scores, None, None)}
    experience = SimpleNamespace(mask=mask, scores=scores, values=None, streams=streams)
    advantages = estimate_advantages(c, experience).advantages
    by_hand = [0.904534, 0.904534, -0.301511, -1.507556]
    assert advantages[:, 0].tolist() == pytest.approx(by_hand, abs=1e-5)
    assert torch.equal(advantages, advantages[:, :1] * mask)
    # --std unbiased reaches the estimator: std √(2.75/3) = 0.957427, A = 0.783349, 0.783349, −0.261116, −1.305582.
    c.config = GenerationConfig(algorithm="dapo", group_size=4, std="unbiased").filled().validate()
    unbiased = estimate_advantages(c, experience).advantages
    assert unbiased[:, 0].tolist() == pytest.approx([0.783349, 0.783349, -0.261116, -1.305582], abs=1e-5)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # Completion 1: log-ratios 0.2 and −0.1, s = exp(mean) = exp(0.05) = 1.051271, A = +1; completion 2: one token,
    # log-ratio −0.1, s = exp(−0.1) = 0.904837, A = −1. ε = 0.2 on both sides: both inside, terms −sA on each token;
    # the sequence-mean-token-mean is (−1.051271 + 0.904837)/2 = −0.073217, and ∂/∂log π_t = −s_i A_i/(|y_i|·2):
    # −1.051271/4 = −0.262818 on both tokens of completion 1 (GSPO's s_i A_i · 1/|y_i| Σ_t ∇log π), +0.452419.
    old = [[-1.0, -2.0], [-0.5, 0.0]]
    new = [[-0.8, -2.1], [-0.6, 0.0]]
    mask = [[1, 1], [1, 0]]
    aggregation = "sequence-mean-token-mean"
    value, gradient, outside = _loss_and_gradient("gspo", new, old, [[1.0], [-1.0]], mask, aggregation, 0.2, 0.2)
    assert value == pytest.approx(-0.073217, abs=1e-6)
    assert gradient.tolist() == [pytest.approx([-0.262818, -0.262818], abs=1e-6), pytest.approx([0.452419, 0.0],
                                                                                                  abs=1e-6)]
    assert float(outside.sum()) == 0.0
    # GSPO's own range (3e-4, 4e-4): s = 1.051 > 1.0004 with A > 0 and s = 0.905 < 0.9997 with A < 0 are both
    # clipped (terms −1.0004 and +0.9997): no gradient at all, and every token counts as clipped.
    value, gradient, outside = _loss_and_gradient("gspo", new, old, [[1.0], [-1.0]], mask, aggregation, 3e-4, 4e-4)
    assert value == pytest.approx((-1.0004 + 0.9997) / 2)
    assert gradient.abs().max() == 0.0
    assert outside.tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_the_clipped_weight():
    # Two tokens, A = +1, log π = −0.5 and −1.0, ratios 1.6 and 0.5. CISPO (ε_low 1: no lower bound, ε_high 0.28):
    # weights sg(clip(ρ)) = 1.28 and 0.5, terms −w·A·log π = 0.64 and 0.5, token-mean 0.57, ∂/∂log π = −w/2 =
    # −0.64 and −0.25. PPO's surrogate with the same range gives the first token no gradient.
    new = [[-0.5, -1.0]]
    old = [[-0.5 - math.log(1.6), -1.0 - math.log(0.5)]]
    value, gradient, outside = _loss_and_gradient("cispo", new, old, [[1.0]], [[1, 1]], "token-mean", 1.0, 0.28)
    assert value == pytest.approx(0.57)
    assert gradient.tolist() == [pytest.approx([-0.64, -0.25])]
    assert outside.tolist() == [[1.0, 0.0]]
    _, ppo, _ = _loss_and_gradient("clipped-token", new, old, [[1.0]], [[1, 1]], "token-mean", 1.0, 0.28)
    assert ppo.tolist() == [pytest.approx([0.0, -0.25])]


def test_std_population_or_unbiased_by_hand():
    # Rewards 1, 0, 0, 0: mean 0.25; population std √(3/16) = 0.433013, unbiased √(0.75/3) = 0.5.
    population, _ = ADVANTAGE_ESTIMATORS["grpo"](_sequence_inputs([1.0, 0.0, 0.0, 0.0], 4))
    unbiased, _ = ADVANTAGE_ESTIMATORS["grpo"](_sequence_inputs([1.0, 0.0, 0.0, 0.0], 4, std="unbiased"))
    assert population.reshape(-1).tolist() == pytest.approx([1.732051, -0.577350, -0.577350, -0.577350], abs=1e-5)
    assert unbiased.reshape(-1).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)


def test_normalize_advantages_is_a_z_score_over_the_batchs_completions():
    # RLOO advantages 0.75, −0.75, 0, 0 (rewards 1, 0, .5, .5) on completions of 1, 3, 2 and 2 tokens; the fifth
    # completion is unscored (left out). Each completion once: mean 0, sample std √((0.5625·2)/3) = 0.612372, so
    # 0.75/(0.612372 + 1e−4) = 1.224545 on every token of the first, −1.224545 on the second's.
    advantages = torch.tensor([[0.75, 0, 0], [-0.75] * 3, [0.0, 0, 0], [0.0, 0, 0], [9.0, 0, 0]])
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
    valid = torch.tensor([True, True, True, True, False])
    normalised = normalise_over_batch(advantages * mask, mask, valid)
    assert normalised[:, 0].tolist() == pytest.approx([1.224545, -1.224545, 0.0, 0.0, 0.0], abs=1e-5)
    assert torch.equal(normalised, normalised[:, :1] * mask)


def test_mask_truncated_leaves_completions_that_hit_the_limit_out_of_the_loss():
    from auto_research.engine.rollout import Rollout
    from auto_research.train.update import loss_mask, truncated

    # EOS is 0, the limit 3 tokens: "5 6 0" ended at the limit, "5 6 7" was cut, "5 0" ended early.
    completions = torch.tensor([[5, 6, 0], [5, 6, 7], [5, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    rollout = Rollout(torch.cat([torch.full((3, 1), 9), completions], 1), torch.ones(3, 1), mask, [""] * 3, 3)
    assert truncated(rollout, 3, [0]).tolist() == [False, True, False]
    experience = SimpleNamespace(rollout=rollout, mask=mask.float())
    for on, expected in ((False, mask), (True, torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]]))):
        c = SimpleNamespace(config=GenerationConfig(mask_truncated=on, max_new_tokens=3),
                            tokenizer=SimpleNamespace(eos_token_id=0), policy=None)
        assert torch.equal(loss_mask(c, None, experience), expected.float())


def test_the_entropy_bonus_has_the_entropys_gradient():
    from auto_research.engine.logprobs import _ChunkedEntropy

    # Zero hidden states: uniform over 11 tokens, H = log 11.
    weight = torch.randn(11, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert _ChunkedEntropy.apply(torch.zeros(2, 8, dtype=torch.float64), weight, 1.0).tolist() == pytest.approx(
        [math.log(11)] * 2)
    # The chunked backward against autograd through −Σ p log p of the logits themselves.
    hidden = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight.requires_grad_(True)
    scale = torch.arange(1.0, 6.0, dtype=torch.float64)
    (_ChunkedEntropy.apply(hidden, weight, 0.7) * scale).sum().backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    log_p = torch.log_softmax(hidden @ weight.t() / 0.7, -1)
    (-(log_p.exp() * log_p).sum(-1) * scale).sum().backward()
    assert torch.allclose(ours[0], hidden.grad) and torch.allclose(ours[1], weight.grad)


BAD = [
    (["--clip-high", "-0.1"], "--clip-high must be a finite number >= 0, got -0.1"),
    (["--clip-low", "1.5"], "--clip-low must be in [0, 1]"),
    (["--clip-range", "-1"], "--clip-range must be in [0, 1], got -1.0"),
    (["--std", "unbiased"], "--std applies to the algorithms that divide by the group's standard deviation "
                            "(grpo, dapo, gspo, cispo); rloo has none"),
    (["--algorithm", "dr-grpo", "--std", "population"], "dr-grpo has none"),
    (["--algorithm", "grpo", "--std", "sample"], "--std 'sample': choose one of population, unbiased"),
    (["--overlong-buffer", "6"], "--overlong-buffer 6 must be below --max-new-tokens 6"),
    (["--algorithm", "dapo", "--max-new-tokens", "4", "--overlong-buffer", "5"], "must be below --max-new-tokens 4"),
    (["--overlong-penalty", "0.5"], "--overlong-penalty needs --overlong-buffer L > 0"),
    (["--overlong-buffer", "-2"], "--overlong-buffer must be >= 0, got -2"),
    (["--algorithm", "ppo-rlhf", "--normalize-advantages"], "ppo-rlhf already whitens its advantages"),
    (["--policy-loss", "vanilla", "--ppo-epochs", "2"], "a batch that serves several updates"),
    (["--policy-loss", "ppo"], "--policy-loss 'ppo': choose one of vanilla, clipped-token, clipped-sequence, gspo, cispo"),
    (["--loss-aggregation", "median"], "choose one of sequence, token-mean, sequence-mean-token-mean, constant"),
    (["--entropy-coef", "-0.01"], "--entropy-coef must be a finite number >= 0, got -0.01"),
    (["--algorithm", "cispo", "--dataset", "arithmetic-smoke"], "--algorithm cispo has no candidate-level form"),
    (["--clip-high", "0.3", "--dataset", "arithmetic-smoke"], "--clip-high applies to the generation level only"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(flags) for flags, _ in BAD])
def test_impossible_settings_are_one_line_exit_2_before_any_work(tmp_path, capsys, flags, message):
    output = tmp_path / "out"
    code = main(["post-train", "--dataset", "arithmetic-generate", "--output-dir", str(output), *flags])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("auto-research: error: ") and message in lines[0], lines
    assert not output.exists()


@pytest.mark.parametrize("overrides", [
    dict(algorithm="dr-grpo"), dict(algorithm="dapo"), dict(algorithm="gspo"), dict(algorithm="cispo"),
    dict(normalize_advantages=True, entropy_coef=0.01, overlong_buffer=1), dict(mask_truncated=True),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_each_variant_takes_finite_steps_that_change_the_policy(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch,
                                                                 overrides):
    from auto_research.train.trainer import Trainer

    (tmp_path / "lengths.py").write_text("def score(prompts, completions, rows):\n"
                                         "    return [len(set(c)) / 3 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = GenerationConfig(model=str(tiny_model_dir), dataset=str(sums_jsonl), output_dir=tmp_path, steps=2,
                              prompts_per_step=4, group_size=4, max_new_tokens=3, learning_rate=1e-2,
                              evaluation_examples=8, eval_every=0, checkpoint_every=0, progress=False, offline=True,
                              seed=3, device="cpu", updates_per_batch=2, reward=["lengths:score"], temperature=2.0,
                              **overrides)
    trainer = Trainer.build(config, log=lambda text: None)
    before = {name: value.detach().clone() for name, value in trainer.components.policy.named_parameters()}
    row = trainer.step(1)
    assert all(math.isfinite(row[key]) for key in ("loss", "pg_loss", "grad_norm", "clip_fraction"))
    changed = any(not torch.equal(before[name], value) for name, value in trainer.components.policy.named_parameters())
    if "mask_truncated" in overrides:
        # The random model ends none of its 16 completions within 3 tokens: every one is cut, none trains.
        assert row["completion_length"] == 3.0 and row["grad_norm"] == 0.0 and not changed
        return
    assert changed
    if overrides.get("algorithm") == "gspo":  # the second epoch's sequence ratios leave GSPO's narrow range
        assert row["clip_fraction"] > 0
    if "entropy_coef" in overrides:
        assert row["entropy_loss"] < 0


def test_the_docs_table_of_knobs_is_the_registrys():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = text.split("## Every algorithm against its knobs")[1].split("\n\n")[2]
    rows = {cells[0].strip("` "): [cell.strip() for cell in cells[1:]]
            for cells in (line.strip("|").split("|") for line in section.splitlines()[2:])}
    assert list(rows) == list(REGISTRY)
    for name, (_, loss, aggregation, kl, clip, std, _, _) in rows.items():
        record = get_algorithm(name)
        low, high = (float(part) for part in clip.split(" / "))
        assert (loss, aggregation.split()[0], kl) == (record.policy_loss, record.aggregation,
                                                      f"{record.kl} ({record.kl_estimator})"), name
        assert (low, high, std) == (record.clip_low, record.clip_high, record.std or "—"), name
