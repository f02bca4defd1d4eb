"""Frozen-encoder features of a labelled shard set, with an on-disk cache.

Extraction is the kNN monitor's (`pretrain.knn.extract.extract_features`), so kNN and the linear `fast`
protocol see the same test views. The cache file name is a digest of the encoder's weights, the shard
set's files (name, size, mtime) and the view spec: a changed checkpoint or a rebuilt shard set never
reuses stale features. A cache keeps the keys of the undecodable images and what the set lost while read,
so a cached result reports them too.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from relicv2.models.torchfile import TorchFileError, TorchFormat
from relicv2.pretrain.distributed import DistributedContext, all_gather_object
from relicv2.pretrain.knn.extract import extract_features, join_parts
from relicv2.pretrain.knn.outcome import LostSamples, LostSamplesError
from relicv2.pretrain.views.config import IMAGE_SIZE
from relicv2.shards.shardset import ShardSet, shard_tars

# The version is part of the cache file name, not of the file: version 2 records the skipped keys and the
# samples lost while reading, so files of version 1 (which may hide a loss) are never read again; version 3
# the key of each row (transfer carves a val split from train by key).
CACHE_VERSION = 3
CACHE = TorchFormat("feature cache", fix="extracting its features again", tag="relicv2-feature-cache",
                    fields={"features": torch.Tensor, "labels": torch.Tensor, "skipped": int})


@dataclass(frozen=True)
class FeatureSpec:
    """The test view the features are taken on (the linear protocol's: 256 bicubic -> centre 224)."""

    crop_size: int = IMAGE_SIZE
    resize_size: int = 0  # 0: crop_size / 0.875
    batch_size: int = 256


@dataclass(frozen=True)
class FeatureSet:
    features: Tensor  # [N, F] float32
    labels: Tensor  # [N] int64
    skipped: int = 0  # undecodable samples left out (named on stderr when extracted)
    skipped_keys: tuple[str, ...] = ()  # their keys, sorted
    lost: tuple[LostSamples, ...] = ()  # samples the set lost while read (only when allowed)
    keys: tuple[str, ...] = ()  # the sample key of each row

    def __len__(self) -> int:
        return int(self.labels.numel())


def encoder_digest(encoder: nn.Module) -> str:
    """sha256 of the encoder's parameters and buffers (names, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(encoder.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digest.update(f"{type(encoder).__qualname__} {getattr(encoder, 'padding', 'torch')}".encode())
    return digest.hexdigest()


def shard_set_fingerprint(source: ShardSet) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of every tar of a shard set: changes whenever the set is rebuilt."""
    return [(tar.name, tar.stat().st_size, tar.stat().st_mtime_ns) for tar in shard_tars(source)[0]]


def cache_path(cache_dir: str | Path, encoder: nn.Module, source: ShardSet, spec: FeatureSpec) -> Path:
    key = json.dumps({"version": CACHE_VERSION, "encoder": encoder_digest(encoder),
                      "shards": str(Path(str(source)).resolve()),
                      "files": shard_set_fingerprint(source), "spec": asdict(spec)}, sort_keys=True)
    return Path(cache_dir) / f"features-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _read_cache(path: Path) -> FeatureSet | None:
    try:
        payload = CACHE.load(path)
    except TorchFileError as error:  # a cache is never worth a failed job
        print(error, file=sys.stderr)
        return None
    return FeatureSet(payload["features"], payload["labels"], payload["skipped"],
                      tuple(payload.get("skipped_keys", ())),
                      tuple(LostSamples(**entry) for entry in payload.get("lost", ())), tuple(payload.get("keys", ())))


def cached_features(
    encoder: nn.Module,
    source: ShardSet,
    spec: FeatureSpec,
    *,
    cache_dir: str | Path | None,
    device: str | torch.device = "cpu",
    ctx: DistributedContext | None = None,
    allow_lost: bool = False,
    progress: bool = False,
) -> FeatureSet:
    """Features of every decodable sample, read from / written to `cache_dir` when one is given (rank 0
    writes); with a multi-rank ctx each rank extracts 1/W and all get the union.

    A set that loses samples while read, or features cached from one, raise LostSamplesError unless
    `allow_lost`."""
    path = cache_path(cache_dir, encoder, source, spec) if cache_dir is not None else None
    cached = _read_cache(path) if path is not None and path.is_file() else None
    if cached is not None:
        if cached.lost and not allow_lost:
            raise LostSamplesError(
                f"shard set {source} lost samples when its cached features {path.name} were taken "
                f"({cached.lost[0].detail}): check it with `relicv2 shards verify {source}` and rebuild it")
        return cached
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    skipped: list[str] = []
    lost: list[LostSamples] = []  # every rank reads the whole set: the same on every rank
    keys: list[str] = []
    features, labels = extract_features(encoder, source, **asdict(spec), device=device, skipped=skipped,
                                        part=(rank, world), allow_lost=allow_lost, lost=lost,
                                        progress=progress and rank == 0, keys=keys)
    if world > 1:  # join_parts keeps the rank order: so do the keys
        parts = all_gather_object((features, labels, skipped, keys), ctx)
        pairs, skipped = [(f, lab) for f, lab, _, _ in parts], [key for _, _, bad, _ in parts for key in bad]
        keys = [key for *_, part_keys in parts for key in part_keys]
        del parts, features, labels  # let go as they are copied into the joined features
        features, labels = join_parts(pairs, source, torch.device("cpu"))
    result = FeatureSet(features, labels, len(skipped), tuple(sorted(skipped)), tuple(lost), tuple(keys))
    if path is not None and rank == 0:
        CACHE.save(path, {"features": result.features, "labels": result.labels, "skipped": result.skipped,
                          "skipped_keys": list(result.skipped_keys), "lost": [asdict(entry) for entry in result.lost],
                          "keys": list(result.keys),
                          "source": str(source), "spec": asdict(spec)})
    return result
