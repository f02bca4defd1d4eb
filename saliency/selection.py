"""Choosing a saliency pipeline on labelled dev images without scoring it on the images it was chosen on.

- The dev images only choose and score: `check_kept_out` refuses a training folder that holds one of them
  (the same bytes, under any name: a copy or a link).
- Folds (`assign_folds`): the dev images' names sorted, shuffled by `random.Random(fold_seed)` and dealt round
  robin into k folds; fixed by the names and the seed alone.
- Scores of a subset are computed from per-image sums (`saliency.metrics.ScoreSums`): max-F stays the maximum
  of the subset's mean F curve.
- Nested selection (`select`): for each fold, the candidate with the highest max-F on the other k-1 folds is
  scored on that fold; the k held-out folds, each scored by its own choice, add up to the selected pipeline's
  held-out score.
- Two candidates are told apart by their paired differences (`paired_difference`): the same images, the same
  trained networks (seed), so that what the seeds and the folds share cancels.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from relicv2.saliency.metrics import ImageScores, ScoreSums, summed
from relicv2.shards.sources import walk_files


class DevImageInTrainingError(ValueError):
    """A training folder holds a dev image: it would be scored on an image its network trained on."""


def _digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_kept_out(train_folders: Iterable[Path], dev_images: Path, option: str = "--train-images") -> None:
    """Refuse any file under `train_folders` (walked as `shards build` walks them) with the bytes of a file in
    `dev_images`. Only files of a dev image's size are read: seconds for ten thousand photos."""
    dev_files = [path for _, path in walk_files(Path(dev_images))[0]]
    by_size: dict[int, list[str]] = defaultdict(list)
    for path in dev_files:
        by_size[Path(path).stat().st_size].append(path)
    dev_digests: dict[str, str] = {}
    for folder in train_folders:
        for relative, path in walk_files(Path(folder))[0]:
            try:
                size = Path(path).stat().st_size
            except OSError:
                continue  # a broken link: the shard build reports it
            if size not in by_size:
                continue
            for dev in by_size[size]:
                dev_digests.setdefault(dev, _digest(dev))
            digest = _digest(path)
            same = [dev for dev in by_size[size] if dev_digests[dev] == digest]
            if same:
                raise DevImageInTrainingError(
                    f"{option} {folder}: {relative} is the dev image {Path(same[0]).name} of {dev_images} (the same "
                    "bytes); the dev images only choose and score: take it out of the training folder")


def assign_folds(stems: Iterable[str], k: int, seed: int) -> list[list[str]]:
    """`k` disjoint folds covering `stems`: the names sorted, shuffled by random.Random(seed), dealt round robin
    (fold i takes positions i, i + k, ...); each fold sorted."""
    names = sorted(set(stems))
    if k < 2 or len(names) < k:
        raise ValueError(f"{k} folds of {len(names)} images: take 2 folds or more, and at most one an image")
    random.Random(seed).shuffle(names)
    return [sorted(names[i::k]) for i in range(k)]


def fold_sums(per_image: Mapping[str, ImageScores], folds: Sequence[Sequence[str]], what: str) -> list[ScoreSums]:
    """The sums of each fold's per-image scores; a ValueError naming `what` when an image was not scored."""
    missing = sorted({stem for fold in folds for stem in fold} - set(per_image))
    if missing:
        raise ValueError(f"{what} has no score for {len(missing)} dev image(s), e.g. {', '.join(missing[:3])}; "
                         "it was scored on other images: delete it to score it again")
    return [summed(per_image[stem] for stem in fold) for fold in folds]


def total(sums: Iterable[ScoreSums]) -> ScoreSums:
    return sum(sums, ScoreSums.empty())


@dataclass(frozen=True)
class Selection:
    chosen: list[str]  # for each fold, the candidate chosen on the other folds
    held_out: ScoreSums  # each fold scored by the candidate chosen without it, summed over the folds


def select(candidates: Mapping[str, Sequence[ScoreSums]]) -> Selection:
    """Nested selection over `candidates` (name -> the sums of each fold): for each fold, the highest max-F on
    the other folds (ties: the earlier candidate) is scored on that fold alone."""
    names = list(candidates)
    k = len(candidates[names[0]])
    chosen, held_out = [], ScoreSums.empty()
    for fold in range(k):
        def others(name: str, fold: int = fold) -> float:
            return total(s for i, s in enumerate(candidates[name]) if i != fold).scores().max_f

        best = max(names, key=others)  # the first of equal maxima
        chosen.append(best)
        held_out = held_out + candidates[best][fold]
    return Selection(chosen, held_out)


def mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for fewer than two values)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class Difference:
    mean: float  # mean over seeds of (a - b) on all dev images
    seed_sd: float | None  # standard deviation of the per-seed differences (None: one seed)
    fold_se: float  # per seed, the standard deviation of the per-fold differences / sqrt(k); mean over seeds


def paired_difference(a: Sequence[Sequence[ScoreSums]], b: Sequence[Sequence[ScoreSums]],
                      metric: str = "max_f") -> Difference:
    """Candidate a minus candidate b in `metric`, each given as per-seed lists of fold sums (the same seeds,
    the same folds)."""
    def value(sums: ScoreSums) -> float:
        return getattr(sums.scores(), metric)

    whole = [value(total(x)) - value(total(y)) for x, y in zip(a, b, strict=True)]
    spreads = []
    for x, y in zip(a, b, strict=True):
        _, sd = mean_sd([value(p) - value(q) for p, q in zip(x, y, strict=True)])
        spreads.append((sd or 0.0) / math.sqrt(len(x)))
    mean, seed_sd = mean_sd(whole)
    return Difference(mean, seed_sd, sum(spreads) / len(spreads))
