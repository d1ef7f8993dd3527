"""The options of post-train and compare that span several runs (seeds, algorithms, group sizes): dataclasses
whose fields are flags, like a run's settings."""

from __future__ import annotations

from dataclasses import dataclass

from auto_research.algorithms.registry import REGISTRY
from auto_research.config.fields import comma_list, setting
from auto_research.errors import UserError


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

    algorithms: str | None = setting(None, "comma-separated", default_text="every algorithm the level has")
    seeds: str | None = setting(None, "comma-separated seeds", default_text="--seed")
    group_sizes: str = setting("4", "K samples per prompt; several, e.g. 2,4, at the generation level",
                               flag="--group-size")

    def algorithm_list(self, available: list[str]) -> list[str]:
        names = comma_list("--algorithms", self.algorithms, noun="algorithm") if self.algorithms else list(available)
        unknown = [name for name in names if name not in REGISTRY]
        if unknown:
            raise UserError(f"unknown algorithm {unknown[0]!r}; choose one of: {', '.join(REGISTRY)}")
        return names

    def group_size_list(self) -> list[int]:
        return comma_list("--group-size", self.group_sizes, int)

    def seed_list(self) -> list[int] | None:
        return comma_list("--seeds", self.seeds, int, "seed") if self.seeds else None
