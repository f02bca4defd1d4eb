"""Progress of long work, one policy for every command: on a terminal a tqdm bar with total, rate and
ETA; in a log file (SLURM, CI, nohup: stderr is not a terminal) one plain line every `LINE_EVERY_S`
seconds with the same facts, and one when the work ends. Never a carriage-return bar in a log."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LINE_EVERY_S = 60.0  # progress lines in a log file


class Phase:
    """A piece of work with a known total (None: unknown), `initial` of its items done by an earlier, resumed
    run; `set_postfix` adds figures (a loss, an epoch) to the bar and the lines."""

    def __init__(self, desc: str, total: int | None, *, unit: str = "it", enabled: bool = True, initial: int = 0):
        self.desc, self.total, self.unit, self.enabled = desc, total, unit, enabled
        self.count = self.first = initial
        self.start = self.last_line = time.monotonic()
        self.postfix: dict[str, str] = {}
        interactive = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, smoothing=0.1, file=sys.stderr,
                        dynamic_ncols=True) if interactive else None
        self.lines = enabled and not interactive

    def update(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
        now = time.monotonic()
        if self.lines and (now - self.last_line >= LINE_EVERY_S or self.count == self.total):
            self.last_line = now
            print(self.line(now), file=sys.stderr, flush=True)

    def set_postfix(self, **fields: Any) -> None:
        self.postfix = {name: f"{value:.4g}" if isinstance(value, float) else str(value)
                        for name, value in fields.items()}
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)

    def write(self, text: str, file: Any = None) -> None:
        """Print `text` (to stdout unless `file` says otherwise) without breaking the bar."""
        file = file or sys.stdout
        if self.bar is not None:
            self.bar.write(text, file=file)
        else:
            print(text, file=file, flush=True)

    def line(self, now: float) -> str:
        """The plain progress line: count of total, rate, ETA and the postfix figures."""
        done, elapsed = self.count - self.first, now - self.start
        per_item = elapsed / done if done else 0.0
        if self.total:
            where = f"{self.unit} {self.count}/{self.total} ({100 * self.count / self.total:.0f}%)"
            eta = f", ETA {clock(per_item * (self.total - self.count))}"
        else:
            where, eta = f"{self.unit} {self.count}", ""
        rate = f"{per_item:.2f} s/{self.unit}" if per_item >= 1 or not done else f"{done / elapsed:.1f} {self.unit}/s"
        shown = "".join(f", {name} {value}" for name, value in self.postfix.items())
        return f"{self.desc}: {where}, {rate}{eta}{shown}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled:
            total = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc}: {self.count}{total} {self.unit}(s) in {time.monotonic() - self.start:.1f} s",
                  file=sys.stderr, flush=True)
        self.enabled = self.lines = False

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.bar is not None:
            self.bar.close()


def tracked(items: Iterable[T], desc: str, total: int | None, *, unit: str = "it", enabled: bool = True) -> Iterator[T]:
    with Phase(desc, total, unit=unit, enabled=enabled) as phase:
        for item in items:
            yield item
            phase.update()


def clock(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
