"""Progress of long work: a live bar on a terminal; elsewhere (a bar redrawn with carriage returns makes a log file
one enormous line) a plain line every ``total // lines`` steps and at the end."""

from __future__ import annotations

import sys
import time
from typing import Callable


class Progress:
    def __init__(self, total: int, description: str, initial: int = 0, enabled: bool = True,
                 write: Callable[[str], None] | None = None, lines: int = 20, leave: bool = True,
                 every: int | None = None, bar: bool = True):
        """``every``: without a terminal, a line every N steps (default: ``total // lines``; lines=0: none);
        ``bar``: False draws no bar on a terminal either, only the lines (``--no-progress --log-every N``)."""
        self.total, self.description, self.count = total, description, initial
        self.enabled = enabled
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.every = every or (max(1, total // lines) if lines else None)
        self.started = time.perf_counter()
        self.bar = None
        if enabled and bar and sys.stderr.isatty():
            from tqdm import tqdm  # on a terminal only: --help and logged runs never pay for its import

            self.bar = tqdm(total=total, initial=initial, desc=description, leave=leave)

    def update(self, postfix: dict[str, str] | None = None) -> None:
        """One step done; ``postfix`` holds the figures to show beside the count."""
        self.count += 1
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.enabled and self.every and (self.count % self.every == 0 or self.count == self.total):
            figures = "".join(f"  {key} {value}" for key, value in (postfix or {}).items())
            self.write(f"{self.description}: {self.count}/{self.total}{figures}  "
                       f"({time.perf_counter() - self.started:.0f} s)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
