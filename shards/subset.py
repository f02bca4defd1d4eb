"""Seeded class-balanced key lists of a labelled shard set (the 1% / 10% label splits of fine-tuning).

From every class the same fraction of its samples is drawn (at least `min_per_class`), with a
seeded permutation, so a split is reproducible and no class is left out. The list is a text
file: `#` comment lines (how it was made), then one key per line, sorted.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.progress import tracked
from relicv2.shards.checks import check_tar, resolve_checks
from relicv2.shards.keys import check_key
from relicv2.shards.outdir import writing
from relicv2.shards.sample_set import PROGRESS_FROM


@dataclass(frozen=True)
class SubsetReport:
    keys: list[str]
    per_class: dict[int, int]  # label -> keys drawn
    total: int  # labelled samples in the shard set
    refused: Counter = field(default_factory=Counter)  # what the shard reader left out, by reason


def keys_and_labels(spec: str | Path, *, index_cache: Path | None = None) -> tuple[list[tuple[str, int | None]], Counter]:
    """(key, class index or None) of every sample of a shard set that the shard reader accepts, the samples
    the loaders see (`shards.checks.check_tar`: its one policy for a second sample of a key, an unsafe
    member, ...), and what it refused, by reason."""
    cache, shard_set, _ = resolve_checks(spec, index_cache, None, False)
    pairs: list[tuple[str, int | None]] = []
    refused: Counter = Counter()
    for tar, idx in tracked(zip(shard_set.tars, shard_set.index_files, strict=True), f"reading the labels of {spec}",
                            len(shard_set.tars), unit="tar", enabled=shard_set.samples >= PROGRESS_FROM):
        check = check_tar(tar, idx, headers=shard_set.manifest is None, cache=cache)
        refused.update(code for _, code in check.refused)
        pairs += [(ref.key, ref.label) for ref in check.samples]
    return pairs, refused


def class_balanced_keys(spec: str | Path, fraction: float, *, seed: int = 0, min_per_class: int = 1,
                        index_cache: Path | None = None) -> SubsetReport:
    """`fraction` of each class's keys (rounded, at least `min_per_class`), drawn with `seed`, from any
    shard set `resolve_shard_set` takes."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    by_class: dict[int, list[str]] = defaultdict(list)
    unlabelled = 0
    pairs, refused = keys_and_labels(spec, index_cache=index_cache)
    for key, label in pairs:
        if label is None:
            unlabelled += 1
        else:
            by_class[int(label)].append(key)
    fix = "build it with `relicv2 shards build` from a folder with class sub-folders"
    if not by_class:
        raise ValueError(f"{spec} has no labelled samples (no cls member holding a class index); {fix}")
    if unlabelled:
        raise ValueError(f"{spec} mixes labelled and {unlabelled} unlabelled samples (no cls member, or "
                         f"one that is not a class index); a label split needs a fully labelled set: {fix}")
    rng = np.random.default_rng(seed)
    keys: list[str] = []
    per_class: dict[int, int] = {}
    for label in sorted(by_class):
        members = sorted(by_class[label])  # manifest order must not matter, only the seed
        count = min(len(members), max(min_per_class, math.floor(fraction * len(members) + 0.5)))
        chosen = rng.permutation(len(members))[:count]
        keys += [members[i] for i in chosen]
        per_class[label] = count
    return SubsetReport(sorted(keys), per_class, sum(len(v) for v in by_class.values()), refused)


def write_key_list(path: str | Path, keys: list[str], header: str = "") -> None:
    """Write the key list atomically; an OutputError (naming `path`) when it cannot be written."""
    path = Path(path)
    lines = [f"# {line}" for line in header.splitlines()] + keys
    with writing(path, "--out"):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))


def read_key_list(path: str | Path, what: str = "key list") -> set[str]:
    """The keys of a key list (blank and `#` lines ignored); each is validated like a shard key. `what` names
    the file in the messages (a segmentation split file is a list of image names)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"key list {path} is a folder; pass the key list file `relicv2 shards subset` wrote")
    if not path.is_file():
        raise FileNotFoundError(f"key list {path} does not exist; write one with `relicv2 shards subset`")
    keys = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            check_key(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        keys.add(line)
    if not keys:
        raise ValueError(f"{what} {path} holds no names")
    return keys
