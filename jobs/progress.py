"""Progress for long jobs: a tqdm bar with total and ETA on a terminal, one line per finished phase otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


class Phase:
    """A phase of work with a known total: `update(n)` as items finish; `close()` ends it.

    On a terminal (stderr is a TTY) a tqdm bar shows rate and ETA; elsewhere (logs, CI, SLURM)
    one line is printed when the phase ends: its name, count and duration.
    """

    def __init__(self, desc: str, total: int | None, *, unit: str = "it", enabled: bool = True):
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled
        self.count = 0
        self.start = time.monotonic()
        self.bar = tqdm(total=total, desc=desc, unit=unit, smoothing=0.1, file=sys.stderr) if enabled and sys.stderr.isatty() else None

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled:
            total = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc}: {self.count}{total} {self.unit}(s) in {time.monotonic() - self.start:.1f} s",
                  file=sys.stderr, flush=True)
        self.enabled = False

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.bar is not None:
            self.bar.close()


def tracked(items: Iterable[T], desc: str, total: int | None, *, unit: str = "it", enabled: bool = True) -> Iterator[T]:
    """Iterate `items` inside a :class:`Phase`."""
    with Phase(desc, total, unit=unit, enabled=enabled) as phase:
        for item in items:
            yield item
            phase.update()
