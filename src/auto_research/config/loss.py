"""The loss and critic sections of a generation-level run: each choice from its list in ``algorithms/registry.py``,
and the knobs an algorithm cannot take (``check_with``). Light: no torch."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from auto_research.algorithms.registry import (AGGREGATIONS, DISTILL_BASELINES, KL_ESTIMATORS, KL_PLACEMENTS, POLICY_LOSSES,
                                               RATIO_FREE_LOSSES, REGISTRY, STANDARD_DEVIATIONS, described,
                                               kl_in_loss, kl_shapes_reward, names_by)
from auto_research.config.fields import (check_choice, check_non_negative_finite, check_non_negative_integers,
                                         check_positive_finite, check_positive_integers, setting)
from auto_research.errors import UserError


def served(model: str | None) -> bool:
    """--teacher-model http://HOST:PORT: a rollout server scores for the teacher (``engine/rollout/teacher.py``)."""
    return model is not None and model.startswith("http://")


TEACHER_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def teacher_entries(given) -> dict[str, str]:
    """--teacher-model's teachers by name: one bare source (named ``teacher``), or ``name=source`` entries (a text
    before ``=`` holding ``/`` or ``:`` is part of a bare source)."""
    entries = [given] if isinstance(given, str) else list(given or ())
    named = {}
    for entry in entries:
        name, equals, source = entry.partition("=")
        if not equals or "/" in name or ":" in name:
            if len(entries) > 1:
                raise UserError(f"--teacher-model {entry}: several teachers are named, NAME=SOURCE each (a row's "
                                "'teacher' column names the one that scores it)")
            name, source = "teacher", entry
        elif not TEACHER_NAME.fullmatch(name) or not source:
            raise UserError(f"--teacher-model {entry}: a teacher's entry is NAME=SOURCE, NAME of letters, digits, "
                            "'_', '.' or '-'")
        if name in named:
            raise UserError(f"--teacher-model names the teacher {name!r} twice")
        named[name] = source
    return named


def by_algorithm(attribute: str, choices) -> str:
    """``a (rloo, grpo), b (…)``: each choice with the algorithms whose record defaults to it."""
    grouped = names_by(attribute)
    return ", ".join(f"{choice} ({', '.join(grouped[choice])})" for choice in choices if choice in grouped)


def having(attribute: str) -> str:
    return ", ".join(name for name, algorithm in REGISTRY.items() if getattr(algorithm, attribute))


@dataclass(frozen=True)
class LossSection:
    """The policy loss, the KL, the advantages and the updates a batch serves. None means the algorithm's own
    (``GenerationConfig.filled``)."""

    beta: float = setting(0.05, "β: weight of the KL penalty to the frozen reference", type=float)
    kl_estimator: str | None = setting(None, f"{', '.join(KL_ESTIMATORS)} (default: the algorithm's, "
                                       f"{by_algorithm('kl_estimator', KL_ESTIMATORS)}; moved into the loss by "
                                       "--kl-in, k3)", "loss")
    kl_in: str | None = setting(None, "; ".join(f"{placement}: {text} ({', '.join(names_by('kl').get(placement, []))})"
                                               for placement, text in KL_PLACEMENTS.items())
                                + " (default: the algorithm's)", "loss")
    loss_aggregation: str | None = setting(None, f"{described(AGGREGATIONS)} (default: the algorithm's: "
                                                 f"{by_algorithm('aggregation', AGGREGATIONS)})", "loss")
    updates_per_batch: int = setting(1, "epochs over each rollout batch; > 1 needs a loss with a ratio", "loss",
                                     flag="--ppo-epochs", aliases=("--updates-per-batch",), type=int)
    ppo_mini_batches: int = setting(1, "optimizer steps per epoch, each on whole groups; > 1 needs a loss with a "
                                       "ratio", "loss", type=int)
    policy_loss: str | None = setting(None, f"{described(POLICY_LOSSES)} (default: the algorithm's: "
                                            f"{by_algorithm('policy_loss', POLICY_LOSSES)}; with several updates per "
                                            "batch, clipped-token in place of vanilla)", "loss")
    clip_range: float | None = setting(None, "ε of the clipped ratio on both sides, 1 − ε … 1 + ε (default: the "
                                             "algorithm's; --clip-low and --clip-high set one side each and win)",
                                       "loss", type=float)
    clip_low: float | None = setting(None, "ε_low: ratios clipped below at 1 − ε_low, in [0, 1] (1: no lower bound, "
                                           "CISPO)", "loss", default_text="--clip-range, else the algorithm's: "
                                     "0.2; gspo 3e-4; cispo 1", type=float)
    clip_high: float | None = setting(None, "ε_high: ratios clipped above at 1 + ε_high, >= 0 (DAPO's clip-higher "
                                            "when above ε_low)", "loss", default_text="--clip-range, else the "
                                      "algorithm's: 0.2; dapo and cispo 0.28; gspo 4e-4", type=float)
    std: str | None = setting(None, f"the group std of {having('std')}: {described(STANDARD_DEVIATIONS)}", "loss",
                              default_text="population")
    normalize_advantages: bool = setting(False, "z-score the completions' advantages over the global batch, "
                                         "(A − mean A) / (std A + 1e-4), each completion once (TRL's option for "
                                         "RLOO); not for the algorithms that already whiten", "loss",
                                         action="store_true")
    mask_truncated: bool = setting(False, "leave completions that hit --max-new-tokens without ending out of the "
                                          "loss (DAPO's overlong filtering; TRL's mask_truncated_completions); they "
                                          "still count in their group's baseline", "loss", action="store_true")
    overlong_buffer: int | None = setting(None, "L of DAPO's soft overlong punishment, added to the reward: 0 up "
                                                "to --max-new-tokens − L tokens, then falling linearly to "
                                                "−--overlong-penalty at the limit; 0 = off", "loss",
                                          default_text="dapo: --max-new-tokens // 5, others 0", type=int)
    overlong_penalty: float | None = setting(None, "P, the overlong punishment at the length limit (needs "
                                                   "--overlong-buffer)", "loss", default_text="1.0 (DAPO)", type=float)
    entropy_coef: float = setting(0.0, "weight of the entropy bonus: the loss minus this × the policy's entropy, "
                                       "aggregated as the loss", "loss", type=float)
    reference_model: str | None = setting(None, "the KL's reference: a model folder, hub id or packaged name with the "
                                          "policy's tokenizer", "loss", default_text="the initial policy")
    teacher_model: list[str] | None = setting(None, "on-policy distillation: this model (folder, hub id or packaged "
                                              "name, or http://HOST:PORT, a rollout server serving it; the policy's "
                                              "tokenizer) scores the sampled tokens, and λ·(d_t − b_i), d_t = "
                                              "log π_teacher − log π_old, joins each token's advantage "
                                              "(docs/distillation.md); the reference KL is then off unless --kl-in is "
                                              "given; repeatable as NAME=SOURCE, a row's 'teacher' column naming its "
                                              "teacher", "loss", action="append")
    distill_weight: float = setting(1.0, "λ, the teacher's term's weight in the advantage", "loss", type=float)
    distill_baseline: str = setting("loo", f"the teacher's term's baseline: {described(DISTILL_BASELINES)}", "loss")
    whiten_advantages: bool = setting(True, "keep the advantages of algorithms that whiten them over the global batch "
                                      f"({having('whiten')}) as they are", "loss", flag="--no-whiten-advantages",
                                      action="store_false")

    @property
    def teachers(self) -> dict[str, str]:
        """--teacher-model's teachers by name (``teacher_entries``); empty without one."""
        return teacher_entries(self.teacher_model)

    @property
    def several_updates(self) -> bool:
        """A batch serves several optimizer steps (--ppo-epochs, --ppo-mini-batches): the loss needs a ratio."""
        return self.updates_per_batch > 1 or self.ppo_mini_batches > 1

    def check(self) -> None:
        """Choices and ranges, and what no algorithm can take."""
        check_non_negative_finite("--beta", self.beta)
        check_positive_integers(("--ppo-epochs", self.updates_per_batch), ("--ppo-mini-batches", self.ppo_mini_batches))
        for flag, value, allowed in (("--kl-estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("--kl-in", self.kl_in, KL_PLACEMENTS),
                                     ("--loss-aggregation", self.loss_aggregation, AGGREGATIONS),
                                     ("--policy-loss", self.policy_loss, POLICY_LOSSES),
                                     ("--std", self.std, STANDARD_DEVIATIONS)):
            check_choice(flag, value, allowed)
        if kl_in_loss(self.kl_in) and self.kl_estimator == "k1":
            raise UserError("--kl-estimator k1 with --kl-in loss: the expected gradient of a k1 loss term is zero, "
                            "so the penalty would do nothing; use k3 (the default there) or k2")
        self._check_clips()
        if self.policy_loss in RATIO_FREE_LOSSES and self.several_updates:
            raise UserError(f"--policy-loss {self.policy_loss} is the policy gradient only at the sampling weights; a "
                            "batch that serves several updates (--ppo-epochs, --ppo-mini-batches) needs a ratio: "
                            f"{', '.join(name for name in POLICY_LOSSES if name not in RATIO_FREE_LOSSES)}")
        check_non_negative_finite("--entropy-coef", self.entropy_coef)
        check_non_negative_integers(("--overlong-buffer", self.overlong_buffer))
        if self.overlong_penalty is not None:
            check_non_negative_finite("--overlong-penalty", self.overlong_penalty)
            if not self.overlong_buffer:
                raise UserError("--overlong-penalty needs --overlong-buffer L > 0 (the punishment is off without it)")
        check_non_negative_finite("--distill-weight", self.distill_weight)
        check_choice("--distill-baseline", self.distill_baseline, DISTILL_BASELINES)
        if not self.teachers and (self.distill_weight != 1.0 or self.distill_baseline != "loo"):
            raise UserError("--distill-weight and --distill-baseline shape a teacher's term: give --teacher-model")

    def _check_clips(self) -> None:
        if self.clip_range is not None and not (math.isfinite(self.clip_range) and 0 <= self.clip_range <= 1):
            raise UserError(f"--clip-range must be in [0, 1], got {self.clip_range}")
        if self.clip_low is not None and not (math.isfinite(self.clip_low) and 0 <= self.clip_low <= 1):
            raise UserError(f"--clip-low must be in [0, 1] (the ratio's lower bound 1 − ε_low is a probability "
                            f"ratio, >= 0), got {self.clip_low}")
        if self.clip_high is not None:
            check_non_negative_finite("--clip-high", self.clip_high)

    def check_with(self, algorithm) -> None:
        """The knobs ``algorithm`` (its record) cannot take."""
        if self.std is not None and algorithm.std is None:
            raise UserError(f"--std applies to the algorithms that divide by the group's standard deviation "
                            f"({having('std')}); {algorithm.name} has none")
        if self.normalize_advantages and algorithm.whiten:
            raise UserError(f"--normalize-advantages: {algorithm.name} already whitens its advantages over the batch "
                            "(--no-whiten-advantages turns that off)")
        if "task" not in algorithm.rewards and not self.teachers:
            raise UserError(f"--algorithm {algorithm.name} takes no task reward: its signal is a teacher's, so it "
                            "needs --teacher-model")
        if kl_shapes_reward(self.kl_in) and not kl_shapes_reward(algorithm.kl) and self.beta > 0:
            raise UserError(f"--kl-in reward: {algorithm.name}'s advantage does not use the shaped reward; "
                            "use --kl-in loss (or --beta 0)")


@dataclass(frozen=True)
class CriticSection:
    """PPO's learned value model: GAE's λ, the value loss's clip and weight, its initial weights."""

    gae_lambda: float = setting(1.0, "λ of GAE (the RLOO paper's best for PPO; TRL uses 0.95)", "critic", type=float)
    value_clip: float = setting(0.2, "clip range of the value loss around the old values", "critic", type=float)
    vf_coef: float = setting(0.1, "weight of the value loss (the critic has its own AdamW)", "critic", type=float)
    critic_model: str | None = setting(None, "initial critic weights (default: --reward-model if given, else the "
                                             "policy)", "critic")

    def check(self) -> None:
        check_positive_finite("--value-clip", self.value_clip)
        if not (math.isfinite(self.gae_lambda) and 0 <= self.gae_lambda <= 1):
            raise UserError(f"--gae-lambda must be in [0, 1], got {self.gae_lambda}")
        check_non_negative_finite("--vf-coef", self.vf_coef)

    def check_with(self, algorithm) -> None:
        if self.critic_model is not None and not algorithm.needs_critic:
            with_critic = [name for name, record in REGISTRY.items() if record.needs_critic]
            raise UserError(f"--critic-model applies to {', '.join(with_critic)} only; {algorithm.name} has no critic")
