"""REINFORCE++ and REINFORCE++-baseline (Hu et al., 2025): returns by hand, the whitening over the global batch
the same on 1 and 2 processes, and a run that learns."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from auto_research.algorithms.estimators import ADVANTAGE_ESTIMATORS, AdvantageInputs, whiten
from auto_research.algorithms.losses import last_token
from auto_research.algorithms.registry import get_algorithm
from auto_research.engine.distributed import World

# Two groups of K = 2, up to 3 tokens; scores r and β·kl per token (β = 0.1).
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
SCORES = torch.tensor([1.0, 0.0, 0.5, 0.3])
BETA_KL = torch.tensor([[0.01, 0.02, 0.03], [0.0, 0.04, 0.0], [0.05, 0.0, 0.0], [0.01, 0.01, 0.01]])


def _inputs(rows=slice(None)) -> AdvantageInputs:
    mask, scores = MASK[rows], SCORES[rows]
    token_rewards = last_token(mask) * scores.unsqueeze(1) - BETA_KL[rows] * mask
    return AdvantageInputs(token_rewards, mask, 2, torch.ones(len(scores), dtype=torch.bool), task_rewards=scores)


def test_reinforce_pp_sums_the_per_token_rewards_to_the_end():
    # Rewards per token: row 0 (−.01, −.02, 1 − .03), row 1 (0, 0 − .04), row 2 (.5 − .05), row 3 (−.01, −.01, .3 − .01).
    returns, targets = ADVANTAGE_ESTIMATORS["reinforce-pp"](_inputs())
    by_hand = [[0.94, 0.95, 0.97], [-0.04, -0.04, 0.0], [0.45, 0.0, 0.0], [0.27, 0.28, 0.29]]
    assert returns.tolist() == [pytest.approx(row) for row in by_hand]
    assert torch.equal(returns, targets)


def test_reinforce_pp_baseline_subtracts_the_groups_mean_score_first():
    # Group means: (1 + 0) / 2 = 0.5 and (0.5 + 0.3) / 2 = 0.4, off every token's return.
    returns, _ = ADVANTAGE_ESTIMATORS["reinforce-pp-baseline"](_inputs())
    by_hand = [[0.44, 0.45, 0.47], [-0.54, -0.54, 0.0], [0.05, 0.0, 0.0], [-0.13, -0.12, -0.11]]
    assert returns.tolist() == [pytest.approx(row) for row in by_hand]
    # An unscored completion leaves its group's mean and gets nothing.
    inputs = _inputs()
    unscored = AdvantageInputs(inputs.token_rewards, inputs.mask, 2, torch.tensor([True, False, True, True]),
                               task_rewards=inputs.task_rewards)
    returns, _ = ADVANTAGE_ESTIMATORS["reinforce-pp-baseline"](unscored)
    assert returns[0].tolist() == pytest.approx([0.94 - 1.0, 0.95 - 1.0, 0.97 - 1.0])
    assert returns[1].tolist() == [0.0, 0.0, 0.0]


def test_their_records_whiten_over_the_global_batch_with_no_critic():
    for name, baseline in (("reinforce-pp", False), ("reinforce-pp-baseline", True)):
        record = get_algorithm(name)
        assert record.whiten and record.kl == "reward" and not record.needs_critic and record.candidate is None
        assert (record.min_group_size == 2) == baseline
    # Whitened: mean 0, population std 1 over the valid tokens.
    returns, _ = ADVANTAGE_ESTIMATORS["reinforce-pp"](_inputs())
    white = whiten(returns, MASK, epsilon=0.0)
    valid = white[MASK.bool()]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(valid.square().mean()) == pytest.approx(1.0, abs=1e-5)


def _whiten_on_rank(rank: int, store: str, name: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        inputs = _inputs(slice(2 * rank, 2 * rank + 2))  # each rank holds one whole group
        returns, _ = ADVANTAGE_ESTIMATORS[name](inputs)
        torch.save(whiten(returns, inputs.mask, total=World(rank, 2).total), f"{results}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["reinforce-pp", "reinforce-pp-baseline"])
def test_the_whitening_is_the_same_on_one_and_two_processes(tmp_path, name):
    returns, _ = ADVANTAGE_ESTIMATORS[name](_inputs())
    alone = whiten(returns, MASK)
    mp.spawn(_whiten_on_rank, args=(str(tmp_path / "store"), name, str(tmp_path / "white")), nprocs=2)
    together = torch.cat([torch.load(tmp_path / f"white-{rank}.pt") for rank in range(2)])
    assert torch.allclose(together, alone, atol=1e-6)
    assert not torch.allclose(whiten(returns[:2], MASK[:2]), alone[:2], atol=1e-3)  # a rank's own statistics differ


SEVENS = '''
def count_sevens(prompts, completions, rows):
    return [c.count("7") / 3 for c in completions]
'''


@pytest.mark.parametrize("name", ["reinforce-pp", "reinforce-pp-baseline"])
def test_a_run_learns_a_trivially_learnable_target(tiny_model_dir, sums_jsonl, tmp_path, monkeypatch, name):
    import numpy as np

    from auto_research.config.generation import GenerationConfig
    from auto_research.train.trainer import Trainer

    (tmp_path / "sevens.py").write_text(textwrap.dedent(SEVENS))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = GenerationConfig(algorithm=name, model=str(tiny_model_dir), dataset=str(sums_jsonl), output_dir=tmp_path,
                              steps=40, prompts_per_step=8, group_size=4, max_new_tokens=3, learning_rate=1e-2,
                              temperature=1.0, beta=0.0, evaluation_examples=8, eval_every=0, checkpoint_every=0,
                              warmup_steps=0, progress=False, offline=True, seed=3, device="cpu",
                              reward=["sevens:count_sevens"])
    trainer = Trainer.build(config, log=lambda text: None)
    rewards = [trainer.step(step)["reward_mean"] for step in range(1, 41)]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.3, (first, last)
