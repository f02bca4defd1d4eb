"""The deterministic build plan: seeded shuffle of the sorted inputs, then shard assignment. It needs no
image decoding, so every rank computes the same plan on its own; a shard's digest (its inputs and the
settings that shape its bytes) is the digest of its unit in the job engine (shards.job).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii

import numpy as np

from relicv2.shards.sources import SourceImage
from relicv2.shards.tario import BLOCK
from relicv2.shards.writer import shard_name

PLAN_VERSION = 1
# Per-sample tar overhead besides the image: headers of jpg/cls/json plus the json payload block.
SAMPLE_OVERHEAD = 5 * BLOCK


@dataclass(frozen=True)
class ShardPlan:
    """One planned shard: its number, file name, inputs in write order, digest."""

    number: int
    name: str
    images: tuple[SourceImage, ...]
    digest: str


def _settings_hash(settings: dict):
    return hashlib.sha256(json.dumps({"plan_version": PLAN_VERSION, **settings}, sort_keys=True).encode())


def reference_digest(images: list[SourceImage], settings: dict) -> str:
    """The digest as the plan format defines it (what existing sets' done records hold): the settings, then
    `json.dumps([key, source, label, class_name, size])` of each input. `shard_digest` writes the same bytes
    faster; the tests and `benchmarks/bench_shards.py` compare the two."""
    h = _settings_hash(settings)
    for im in images:
        h.update(json.dumps([im.key, im.source, im.label, im.class_name, im.size]).encode("utf-8"))
    return h.hexdigest()


def shard_digest(images: list[SourceImage], settings: dict) -> str:
    """SHA-256 over the settings and each input's key, source, label, class and size: the bytes of
    `reference_digest`, written out with json's own string encoder and no json.dumps call an input
    (~30 us each: ~40 s of every rank's planning at ImageNet's size)."""
    h = _settings_hash(settings)
    h.update("".join(
        f"[{encode_basestring_ascii(im.key)}, {encode_basestring_ascii(im.source)}, "
        f"{'null' if im.label is None else int(im.label)}, "
        f"{'null' if im.class_name is None else encode_basestring_ascii(im.class_name)}, {int(im.size)}]"
        for im in images).encode("utf-8"))
    return h.hexdigest()


def plan_shards(images: list[SourceImage], settings: dict) -> list[ShardPlan]:
    """Shuffle the inputs (sorted by source) with `settings["seed"]` and cut them into shards of at
    most `max_bytes` (estimated) and `max_count` samples; a single oversized image still gets a shard
    of its own. `settings` (shards.build.settings_of) also go into every shard's digest."""
    prefix, max_bytes, max_count = settings["prefix"], settings["max_bytes"], settings["max_count"]
    groups: list[list[SourceImage]] = []
    current: list[SourceImage] = []
    current_bytes = 0
    for i in np.random.default_rng(settings["seed"]).permutation(len(images)):
        im = images[i]
        # Tar bytes of the sample: exact for pass-through JPEGs, approximate for converted images.
        size = -(-im.size // BLOCK) * BLOCK + SAMPLE_OVERHEAD
        if current and (current_bytes + size > max_bytes or (max_count is not None and len(current) >= max_count)):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(im)
        current_bytes += size
    if current:
        groups.append(current)
    return [
        ShardPlan(n, shard_name(prefix, n), tuple(g), shard_digest(g, {**settings, "name": shard_name(prefix, n)}))
        for n, g in enumerate(groups)
    ]


def plan_digest(shards: list[ShardPlan]) -> str:
    return hashlib.sha256("".join(s.digest for s in shards).encode()).hexdigest()
