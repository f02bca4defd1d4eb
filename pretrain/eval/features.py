"""Frozen-encoder features of a labelled shard set, with an on-disk cache.

Extraction is the kNN monitor's (`pretrain.eval.knn.extract_features`: decode, resize the short
side bicubic, centre crop, ImageNet mean/std), so kNN and the linear `fast` protocol see the same
test views. The cache file name is a digest of the encoder's weights, the shard set's files (name,
size, mtime) and the view spec: a changed checkpoint or a rebuilt shard set never reuses stale
features. Cache files are written atomically and read with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from pretrain.distributed import DistributedContext, all_gather_object
from pretrain.eval.knn import extract_features
from shards.atomic import atomic_output
from shards.shardset import shard_tars

CACHE_FORMAT = "relicv2-feature-cache"


@dataclass(frozen=True)
class FeatureSpec:
    """The test view the features are taken on (the linear protocol's: 256 bicubic -> centre 224)."""

    crop_size: int = 224
    resize_size: int = 0  # 0: crop_size / 0.875
    batch_size: int = 256


@dataclass(frozen=True)
class FeatureSet:
    features: Tensor  # [N, F] float32
    labels: Tensor  # [N] int64
    skipped: int = 0  # undecodable samples left out (named on stderr when extracted)

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


def shard_set_fingerprint(source: str | Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of every tar of a shard set: changes whenever the set is rebuilt."""
    return [(tar.name, tar.stat().st_size, tar.stat().st_mtime_ns) for tar in shard_tars(source)[0]]


def cache_path(cache_dir: str | Path, encoder: nn.Module, source: str | Path, spec: FeatureSpec) -> Path:
    key = json.dumps({"encoder": encoder_digest(encoder), "shards": str(Path(source).resolve()),
                      "files": shard_set_fingerprint(source), "spec": asdict(spec)}, sort_keys=True)
    return Path(cache_dir) / f"features-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _read_cache(path: Path) -> FeatureSet | None:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        print(f"feature cache {path} is unreadable ({type(error).__name__}); extracting again", file=sys.stderr)
        return None
    if not isinstance(payload, dict) or payload.get("format") != CACHE_FORMAT:
        print(f"feature cache {path} is not a relicv2 feature cache; extracting again", file=sys.stderr)
        return None
    return FeatureSet(payload["features"], payload["labels"], int(payload["skipped"]))


def extract_feature_set(
    encoder: nn.Module,
    source: str | Path,
    spec: FeatureSpec,
    *,
    device: str | torch.device = "cpu",
    ctx: DistributedContext | None = None,
) -> FeatureSet:
    """Features of every decodable sample; with a multi-rank ctx each rank extracts 1/W and all get the union."""
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    skipped: list[str] = []
    features, labels = extract_features(encoder, source, crop_size=spec.crop_size, resize_size=spec.resize_size,
                                        batch_size=spec.batch_size, device=device, skipped=skipped,
                                        part=(rank, world))
    if world > 1:
        parts = all_gather_object((features, labels, len(skipped)), ctx)
        kept = [(f, lab) for f, lab, _ in parts if lab.numel()]
        if not kept:
            raise ValueError(f"no decodable labelled images in {source}")
        features = torch.cat([f for f, _ in kept])
        labels = torch.cat([lab for _, lab in kept])
        return FeatureSet(features, labels, sum(count for _, _, count in parts))
    return FeatureSet(features, labels, len(skipped))


def cached_features(
    encoder: nn.Module,
    source: str | Path,
    spec: FeatureSpec,
    *,
    cache_dir: str | Path | None,
    device: str | torch.device = "cpu",
    ctx: DistributedContext | None = None,
) -> FeatureSet:
    """`extract_feature_set`, read from / written to `cache_dir` when one is given (rank 0 writes)."""
    if cache_dir is None:
        return extract_feature_set(encoder, source, spec, device=device, ctx=ctx)
    path = cache_path(cache_dir, encoder, source, spec)
    if path.is_file():
        cached = _read_cache(path)
        if cached is not None:
            return cached
    result = extract_feature_set(encoder, source, spec, device=device, ctx=ctx)
    if ctx is None or ctx.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            torch.save({"format": CACHE_FORMAT, "features": result.features, "labels": result.labels,
                        "skipped": result.skipped, "source": str(source), "spec": asdict(spec)}, tmp)
    return result
