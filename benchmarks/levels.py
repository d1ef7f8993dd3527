"""The levels the async benchmarks take (``--staleness`` of async.py, ``--levels`` of async_learning.py): ``K``
(--max-staleness K), ``K+`` (and --in-flight-updates), ``K+r`` (and --recompute-kv-on-update), and a ``xF`` tail
on either (and --in-flight-pool F): ``4+x1.5``."""

from __future__ import annotations

import re
from dataclasses import dataclass

PATTERN = re.compile(r"(\d+)(?:\+(r?)(?:x(\d+(?:\.\d+)?))?)?")


@dataclass(frozen=True)
class Level:
    K: int
    in_flight: bool
    recompute: bool
    pool: float

    def flags(self) -> list[str]:
        """The command line's flags for this level."""
        return (["--max-staleness", str(self.K)] + (["--in-flight-updates"] if self.in_flight else [])
                + (["--recompute-kv-on-update"] if self.recompute else [])
                + (["--in-flight-pool", str(self.pool)] if self.pool != 1 else []))


def parse(level: str) -> Level:
    found = PATTERN.fullmatch(level.strip())
    if found is None:
        raise SystemExit(f"a level is K, K+, K+r or K+x F (e.g. 1, 3+, 2+r, 4+x1.5), got {level!r}")
    K, recompute, pool = found.groups()
    return Level(int(K), "+" in level, recompute == "r", float(pool or 1))
