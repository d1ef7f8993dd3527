"""The options of post-train and compare that span several runs (seeds, algorithms, group sizes): dataclasses
whose fields are flags, like a run's settings."""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.algorithms.registry import REGISTRY
from auto_research.config.fields import comma_list, setting
from auto_research.errors import UserError, is_decimal


@dataclass
class PostTrainOptions:
    """post-train's options beyond one run's settings."""

    seeds: str | None = setting(None, "several runs, e.g. 42,43,44: a run directory each and a mean ± std summary "
                                      "(candidate level)")

    def seed_list(self) -> list[int] | None:
        return comma_list("--seeds", self.seeds, int, "seed") if self.seeds else None


@dataclass
class CompareOptions:
    """What compare runs: every algorithm × K × seed, on identical data and settings."""

    algorithms: str | None = setting(None, "comma-separated; at the generation level name:K runs that algorithm at "
                                           "that K alone, e.g. rloo:2,rloo:4,ppo-rlhf:2",
                                     default_text="every algorithm the level has")
    seeds: str | None = setting(None, "comma-separated seeds", default_text="--seed")
    group_sizes: str = setting("4", "K samples per prompt; several, e.g. 2,4, at the generation level",
                               flag="--group-size")
    samples_per_step: int | None = setting(None, "completions per step for every run (generation level): each run "
                                                 "draws this / K prompts, so that all train on as many samples "
                                                 "(instead of --prompts-per-step)", type=int)
    drop_checkpoints: bool = setting(False, "delete a run's checkpoints once it has finished and its metrics are read "
                                            "(generation level; --resume still skips a finished run)",
                                     action="store_true")

    def algorithm_list(self, available: list[str]) -> list[str]:
        names = comma_list("--algorithms", self.algorithms, noun="algorithm") if self.algorithms else list(available)
        _check_known(names)
        return names

    def generation_runs(self, group_sizes: list[int]) -> list[tuple[str, int]]:
        """(algorithm, K) in the order given: a name at every --group-size, name:K at that K alone."""
        entries = comma_list("--algorithms", self.algorithms, noun="algorithm") if self.algorithms else list(REGISTRY)
        runs = []
        for entry in entries:
            name, _, size = entry.partition(":")
            _check_known([name])
            if size and not is_decimal(size):
                raise UserError(f"--algorithms {entry}: K after the colon must be a whole number, e.g. {name}:4")
            runs += [(name, K) for K in ([int(size)] if size else group_sizes) if (name, K) not in runs]
        return runs

    def group_size_list(self) -> list[int]:
        return comma_list("--group-size", self.group_sizes, int)

    def seed_list(self) -> list[int] | None:
        return comma_list("--seeds", self.seeds, int, "seed") if self.seeds else None


def _check_known(names: list[str]) -> None:
    unknown = [name for name in names if name not in REGISTRY]
    if unknown:
        raise UserError(f"unknown algorithm {unknown[0]!r}; choose one of: {', '.join(REGISTRY)}")
