"""How many lost inputs a batch job accepts: ``--max-failures`` as a count or a fraction.

docs/design.md: a job that lost data or did nothing exits non-zero; ``--max-failures`` lets the user
accept a known number or share of bad inputs (corrupt photos in a web crawl).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureLimit:
    """How many failed inputs a job accepts and still succeeds: a count, or a fraction of the inputs (a
    job in which every input failed never succeeds, whatever the limit)."""

    count: int | None = 0
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> FailureLimit:
        """``"10"`` -> at most 10 failures; ``"0.05"`` or ``"5%"`` -> at most 5% of the inputs."""
        value = str(text).strip()
        if re.fullmatch(r"\d+", value):
            return cls(count=int(value), fraction=None)
        try:
            fraction = float(value[:-1]) / 100.0 if value.endswith("%") else float(value)
        except ValueError:
            fraction = math.nan
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"--max-failures {text!r}: give a count (e.g. 10), a fraction of the inputs (e.g. 0.05)"
                " or a percentage (e.g. 5%)"
            )
        return cls(count=None, fraction=fraction)

    def allows(self, failed: int, inputs: int) -> bool:
        """True when ``failed`` failures out of ``inputs`` inputs are within the limit."""
        if inputs == 0 or failed >= inputs:
            return False
        if self.count is not None:
            return failed <= self.count
        return failed <= (self.fraction or 0.0) * inputs

    def describe(self) -> str:
        return str(self.count) if self.count is not None else f"{100 * (self.fraction or 0.0):g}%"
