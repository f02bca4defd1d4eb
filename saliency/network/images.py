"""Resized squares for the network, and seeded sampling of training images from a shard set."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import cv2
import numpy as np

from relicv2.shards.index import split_member_name
from relicv2.shards.reader import ReadReport, SampleRef, locate_samples
from relicv2.shards.sample import IMAGE_MEMBERS, unwritable_key
from relicv2.shards.shardset import resolve_shard_set


def resize_square(rgb: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [size, size, 3], bicubic (docs/design.md: fixed square input, no augmentation)."""
    return cv2.resize(rgb, (size, size), interpolation=cv2.INTER_CUBIC)


def resize_map(values: np.ndarray, width: int, height: int) -> np.ndarray:
    """A float map to (height, width), bilinear."""
    return cv2.resize(np.asarray(values, dtype=np.float32), (width, height), interpolation=cv2.INTER_LINEAR)


def _writable(ref: SampleRef, report: ReadReport) -> bool:
    """Whether a sample's key can name a written sample (1-80 of [A-Za-z0-9_-]); else a rejection."""
    key = split_member_name(ref.entries[0][3])[0]
    if (problem := unwritable_key(key)) is not None:
        report.reject(ref.tar, key, "bad_key", problem)
    return problem is None


def sample_locations(shards: Path | str, count: int, seed: int, *, index_cache: Path | None = None) -> list[SampleRef]:
    """`count` samples drawn without replacement (seeded) from any shard set `resolve_shard_set` takes; all
    when it has fewer. The reader's refusals are said on stderr; ValueError naming a set without images."""
    shard_set = resolve_shard_set(shards, index_cache=index_cache)
    report = ReadReport()
    everything = [ref for tar, idx in zip(shard_set.tars, shard_set.index_files, strict=True)
                  for ref in locate_samples(tar, report, index=idx) if _writable(ref, report)]
    if report.rejected:
        print(f"saliency: {shards}: left out {len(report.rejected)} sample(s) {dict(report.reasons)}, e.g. "
              f"{report.rejected[0][1]!r}: {report.rejected[0][2]}", file=sys.stderr)
    if not everything:
        raise ValueError(f"{shards} holds no samples with an image member ({', '.join(IMAGE_MEMBERS)})")
    chosen = sorted(random.Random(seed).sample(range(len(everything)), min(count, len(everything))))
    return [everything[i] for i in chosen]
