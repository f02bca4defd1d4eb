"""What every evaluation reports beside its accuracy: images left out, samples lost, JSON-ready figures.

Two kinds of shortfall, kept apart in every output:
- undecodable images ("skipped"): samples whose image cannot be decoded; left out, counted and
  named (a few keys in messages, all of them in the JSON);
- samples lost while reading ("lost"): what `shards.ReadReport` records while a set is read (tars
  truncated, unreadable or missing, refused members and samples, fewer samples than the manifest
  lists). An accuracy on silently fewer samples is not a result: a set that loses samples is
  refused (`LostSamplesError`) unless the caller allows it, and then the loss is in the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relicv2.shards import ReadReport

FIGURE_DIGITS = 6  # accuracies in JSON: 0.425, not float32 noise such as 0.42500001192092896
NAMED_KEYS = 5  # keys named in a message; the JSON lists all


@dataclass(frozen=True)
class LostSamples:
    """Samples one shard set lost while it was read (from its `shards.ReadReport`)."""

    source: str
    samples: int  # known lost: short of the manifest, or (a set without one) samples and members refused
    shards: int  # tars that could not be read, or not to their end
    detail: str  # `ReadReport.summary()`: the counts and the first losses by name
    counted: bool = True  # False: a set without a manifest lost tars, whose samples nobody counted

    @staticmethod
    def of(source: str | Path | Sequence[str | Path], report: ReadReport) -> LostSamples | None:
        """What `report` says `source` lost, or None when nothing was lost."""
        if report.ok:
            return None
        counted = report.expected is not None
        samples = report.missing if counted else len(report.rejected)
        return LostSamples(str(source), samples, len(report.lost_shards), report.summary(),
                           counted or not report.lost_shards)

    def warning(self) -> str:
        """The one line a job that went on (allowed to) prints: the set, the loss, the fix."""
        return (f"warning: shard set {self.source} lost samples while being read ({self.detail}); the figures "
                f"are computed without them (--allow-lost): check it with `relicv2 shards verify {self.source}` "
                "and rebuild it")


class LostSamplesError(ValueError):
    """A shard set lost samples while it was read; the message names the set, the first loss and the fix."""


def refuse_lost(source: str | Path | Sequence[str | Path], report: ReadReport, *, finished: bool) -> None:
    """Raise `LostSamplesError` when `report` holds a loss. Called while reading too (`finished=False`:
    the count is still short of the manifest then), so a damaged set stops the job at the damage
    rather than after a whole pass."""
    first = ([f"{Path(tar).name}: {reason}" for tar, reason in report.lost_shards]
             + [f"{Path(tar).name}/{name}: {reason}" for tar, name, reason in report.rejected])
    if not first and not (finished and report.missing):
        return
    what = first[0] if first else report.summary()
    more = f" and {len(first) - 1} more loss(es)" if len(first) > 1 else ""
    raise LostSamplesError(
        f"shard set {source} lost samples while being read ({what}{more}); an accuracy on fewer samples than "
        f"the set holds is not reported: check it with `relicv2 shards verify {source}` and rebuild it"
    )


def lost_fields(lost: Sequence[LostSamples]) -> dict[str, Any]:
    """The JSON fields of what a result's sets lost while read: totals and one line per set.

    "lost" counts the samples known lost; "lost_uncounted" is true when tars of a set without a
    manifest were lost too (their samples cannot be counted)."""
    return {"lost": sum(entry.samples for entry in lost), "lost_shards": sum(entry.shards for entry in lost),
            "lost_uncounted": not all(entry.counted for entry in lost),
            "lost_detail": [f"{entry.source}: {entry.detail}" for entry in lost]}


def lost_text(lost: Sequence[LostSamples]) -> str:
    """The printed count: "6", or "3 + the samples of 1 unreadable tar(s)" where nobody counted them."""
    fields = lost_fields(lost)
    if not fields["lost_uncounted"]:
        return str(fields["lost"])
    return f"{fields['lost']} + the samples of {fields['lost_shards']} unreadable tar(s)"


def figure(value: float | None) -> float | None:
    """An accuracy as a plain Python float rounded to FIGURE_DIGITS (None stays None)."""
    return None if value is None else round(float(value), FIGURE_DIGITS)


def named(keys: Sequence[str], limit: int = NAMED_KEYS) -> str:
    """The first `limit` keys, then how many more: "a, b, c and 12 more"."""
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
