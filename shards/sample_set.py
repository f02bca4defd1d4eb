"""The usable samples of a shard set: its index, checked (`shards.checks`), and the index files that list them.

Refused and failing samples are left out of a filtered copy of the index files (the tars are not
touched), counted by reason in `SampleSet.skipped`, and reported once as a warning with a few keys; so
are those a decoder still fails on during a run (`exclude_samples`). A sample without a `mask.png`
member is never masked (counted in `without_mask`); one whose `cls` is not a class index (a class name,
as some WebDataset tools write) is unlabelled, which evaluation refuses (`require_class_labels`).
"""

from __future__ import annotations

import tempfile
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relicv2.jobs.progress import tracked
from relicv2.shards.checks import CHECKS_FOLDER, DecodeCheck, check_tar, resolve_checks
from relicv2.shards.index import format_index, index_path
from relicv2.shards.reader import SampleRef
from relicv2.shards.sample import LABEL_MEMBER, MASK_MEMBER, label_refusal, label_text
from relicv2.shards.sample_table import SampleTable, SampleTableBuilder
from relicv2.shards.shardset import INDEX_CACHE_ENV, ShardSet, Spec

PROGRESS_FROM = 100_000  # samples: a set this large takes seconds to check (a minute with headers)
DECODE_PROGRESS_FROM = 2_000  # samples: decoding them takes seconds


@dataclass
class SampleSet:
    """The usable samples of a shard set in reader order, and the index files that list them."""

    source: ShardSet  # the set as the job resolved it: every tar, filtered or not
    tars: list[Path]  # the tars the index files list (without tars left empty by filtering)
    index_files: list[Path]
    samples: SampleTable
    skipped: Counter = field(default_factory=Counter)
    skipped_keys: list[str] = field(default_factory=list)
    has_masks: bool = False
    without_mask: int = 0  # usable samples that have no mask member (never masked)
    _tmp: tempfile.TemporaryDirectory | None = None  # owns filtered index files

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def directory(self) -> Path:
        """The set's folder (of its first tar for a pattern or a list)."""
        return self.source.directory or self.source.tars[0].parent


def load_sample_set(spec: Spec, *, decode_check: DecodeCheck | None = None, decode_foreign_only: bool = False,
                    index_cache: Path | None = None) -> SampleSet:
    """Read and check a shard set; write filtered index files when samples must be left out.

    `spec` is anything `shards.resolve_shard_set` takes (a resolved `shards.ShardSet`, the job's one
    resolution, is used as it is; missing `.idx` files of plain tars are derived into `index_cache`).
    `decode_check(samples) -> {key: reason}` (e.g. `pretrain.views.dali.find_undecodable`) is run on
    the structurally sound samples when given; with `decode_foreign_only` only on sets without a
    manifest (sets from `shards build` and `saliency build-masks` decoded every image when writing it).
    The verdicts are kept per tar in the index cache (`check_tar`).
    """
    cache, shard_set, decode_check = resolve_checks(spec, index_cache, decode_check, decode_foreign_only)
    directory = shard_set.directory or shard_set.tars[0].parent
    tars = list(shard_set.tars)
    table = SampleTableBuilder()
    skipped: Counter = Counter()
    skipped_keys: list[str] = []
    headers = shard_set.manifest is None
    progress_from = PROGRESS_FROM if decode_check is None else DECODE_PROGRESS_FROM
    unstored = 0
    for tar, idx in tracked(zip(tars, shard_set.index_files, strict=True), f"checking the samples of {directory}",
                            len(tars), unit="tar", enabled=shard_set.samples >= progress_from):
        check = check_tar(tar, idx, headers=headers, cache=cache, decode_check=decode_check)
        left_out = [(check.samples[i].key, reason) for i, reason in sorted(check.left_out.items())]
        for name, reason in [*check.refused, *left_out]:
            skipped[reason] += 1
            skipped_keys.append(name)
        table.extend(s for i, s in enumerate(check.samples) if i not in check.left_out)
        unstored += not check.stored
    if unstored and shard_set.samples >= progress_from:
        warnings.warn(f"cannot keep the sample checks of {directory} in {cache / CHECKS_FOLDER}: every start "
                      f"checks the set again; set ${INDEX_CACHE_ENV} to a writable folder", stacklevel=2)
    samples = table.build()
    if not samples:
        raise ValueError(f"no usable samples in {spec} (left out: {dict(skipped)}); rebuild the shard set")
    sample_set = SampleSet(shard_set, tars, list(shard_set.index_files), samples, skipped, skipped_keys)
    masked = samples.with_member(MASK_MEMBER)
    sample_set.has_masks, sample_set.without_mask = bool(masked.any()), int((~masked).sum())
    if skipped:
        warnings.warn(f"{directory}: left out {sum(skipped.values())} bad samples {dict(skipped)}, "
                      f"e.g. {skipped_keys[:5]}; rebuild the shards to recover them", stacklevel=2)
        write_filtered_indexes(sample_set)
    return sample_set


def require_class_labels(samples: Sequence[SampleRef], source: Path | str) -> list[int]:
    """Every sample's class index; ValueError naming the first sample without one and the fix."""
    labels = []
    for sample in samples:
        label = sample.label
        if label is None:
            raw = sample.read(LABEL_MEMBER)
            text = None if raw is None else label_text(raw)
            raise ValueError(f"{source}: {label_refusal(f'{sample.key} in {sample.tar.name}', text, 'evaluation')}")
        labels.append(label)
    return labels


def exclude_samples(sample_set: SampleSet, bad: dict[str, str]) -> None:
    """Leave the samples named in `bad` ({key: reason}) out of the set and its index files."""
    bad = {k: r for k, r in bad.items() if k not in sample_set.skipped_keys}
    if not bad:
        return
    sample_set.skipped.update(bad.values())
    sample_set.skipped_keys += sorted(bad)
    sample_set.samples = sample_set.samples.select([i for i, key in enumerate(sample_set.samples.keys())
                                                    if key not in bad])
    write_filtered_indexes(sample_set)


def write_filtered_indexes(sample_set: SampleSet) -> None:
    """Index files listing only the set's kept samples, in a temporary folder owned by the set.

    Tars left empty are dropped: DALI's reader rejects an index with no samples.
    """
    sample_set._tmp = tempfile.TemporaryDirectory(prefix="relicv2-index-")
    per_tar = sample_set.samples.by_tar()
    tars = [tar for tar in sample_set.source.tars if tar in per_tar]
    indexes = [Path(sample_set._tmp.name) / index_path(tar).name for tar in tars]
    for tar, path in zip(tars, indexes, strict=True):
        path.write_text(format_index([s.entries for s in per_tar[tar]]), encoding="utf-8")
    sample_set.tars, sample_set.index_files = tars, indexes
