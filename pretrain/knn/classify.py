"""Weighted cosine kNN evaluation of an encoder on labelled shard sets (train = bank, val = queries): the
classifier of Wu et al. 2018 as used by DINO and lightly's benchmarks, with `pretrain.config.KnnConfig`'s
defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from relicv2.pretrain.config import KnnConfig
from relicv2.pretrain.distributed import (
    DistributedContext,
    all_gather_rows,
    gather_object,
    gather_tensor,
)
from relicv2.pretrain.knn.classes import check_same_classes, class_count
from relicv2.pretrain.knn.extract import extract_features
from relicv2.pretrain.knn.outcome import LostSamples, figure, lost_fields
from relicv2.pretrain.views.config import resize_of
from relicv2.shards import resolve_shard_set
from relicv2.shards.shardset import ShardSet, Spec, shard_tars


@dataclass(frozen=True)
class KnnResult:
    top1: float
    num_train: int
    num_val: int
    skipped: int  # samples that could not be decoded (reported on stderr)
    skipped_keys: list[str] = field(default_factory=list)  # their keys, sorted
    lost: list[LostSamples] = field(default_factory=list)  # samples lost while reading (only with allow_lost)
    # The protocol that gave the figure: image_size, resize_size, k, temperature, bank (the train
    # set), split (the set classified); two figures compare only where these agree.
    settings: dict[str, Any] = field(default_factory=dict)

    def as_json(self, *, checkpoint: str | None, random_init: int | None, extra: dict | None = None) -> dict:
        return {"protocol": "knn", "checkpoint": checkpoint, "random_init": random_init, "top1": figure(self.top1),
                "top5": None, "num_train": self.num_train, "num_val": self.num_val, "skipped": self.skipped,
                "skipped_keys": self.skipped_keys, **lost_fields(self.lost), "settings": self.settings,
                **(extra or {})}


def shared_tars(bank: ShardSet, queries: ShardSet) -> list[Path]:
    """The tars two shard sets have in common: a kNN classifier whose bank holds its queries scores
    each image against itself (a figure near 1 that says nothing)."""
    return sorted({t.resolve() for t in shard_tars(bank)[0]} & {t.resolve() for t in shard_tars(queries)[0]})


def at_trained_size(config: Any, trained: dict[str, Any], given: Collection[str]) -> Any:
    """A linear or fine-tuning config (`crop_size`, `resize_size`) at the image size that fits the
    encoder (`pretrain.config.trained_protocol`), where the user did not set one; unchanged when nothing is known."""
    if "crop_size" not in trained or "crop_size" in given:
        return config
    changes = {"crop_size": trained["crop_size"]}
    if "resize_size" not in given:
        changes["resize_size"] = resize_of(trained["crop_size"], trained.get("resize_size", 0))
    return dataclasses.replace(config, **changes)


# The similarities of one chunk of queries against the whole bank are at most this many bytes: at
# ImageNet's 1.28 M-sample bank, 1,024 queries at once would be 5.2 GB of float32.
SIMILARITY_BYTES = 2**28


def knn_predict(
    bank_features: Tensor,
    bank_labels: Tensor,
    query_features: Tensor,
    *,
    num_classes: int,
    k: int = KnnConfig.k,
    temperature: float = KnnConfig.temperature,
    chunk_size: int = 1024,
) -> Tensor:
    """Predicted class [Q] of each query: the k nearest bank items (cosine) vote with weight exp(cos / T).

    The search runs where the bank is (a GPU's matmul for a bank on the GPU), and so do its predictions.
    """
    if bank_features.shape[0] == 0:
        raise ValueError("the kNN bank is empty")
    similarity, labels = nearest(bank_features, bank_labels, query_features, k=k, chunk_size=chunk_size)
    return vote(similarity, labels, num_classes=num_classes, temperature=temperature, chunk_size=chunk_size)


def nearest(bank_features: Tensor, bank_labels: Tensor, query_features: Tensor, *, k: int,
            chunk_size: int = 1024) -> tuple[Tensor, Tensor]:
    """(cosine similarity, label) [Q, min(k, N)] of each query's nearest items of the bank [N, F], most similar
    first, where the bank is. Queries are processed in chunks of at most `chunk_size`, fewer when a chunk's
    similarities would exceed SIMILARITY_BYTES, so memory stays the bank's plus O(SIMILARITY_BYTES)."""
    bank = bank_features.float()  # no copy for a float32 bank
    # Cosine as (q / |q|) . b / |b|: a normalised copy of the bank would double its memory (10.5 GB more at
    # 1.28 M x 2048); the norms are one float an item. The clamp is F.normalize's.
    bank_norms = bank.norm(dim=1).clamp_min(1e-12)
    queries = F.normalize(query_features.to(bank.device).float(), dim=1)
    bank_labels = bank_labels.to(bank.device)
    k = min(k, bank.shape[0])
    if k == 0 or len(queries) == 0:  # k == 0: a rank's empty part of a split bank
        return torch.empty(len(queries), k, device=bank.device), bank_labels.new_empty(len(queries), k)
    chunk_size = max(1, min(chunk_size, SIMILARITY_BYTES // (4 * bank.shape[0])))
    similarities, labels = [], []
    for start in range(0, queries.shape[0], chunk_size):
        similarity = (queries[start : start + chunk_size] @ bank.T).div_(bank_norms)
        top_similarity, top_index = similarity.topk(k, dim=1)
        del similarity
        similarities.append(top_similarity)
        labels.append(bank_labels[top_index])
    return torch.cat(similarities), torch.cat(labels)


def vote(similarity: Tensor, labels: Tensor, *, num_classes: int, temperature: float,
         chunk_size: int = 1024) -> Tensor:
    """Predicted class [Q] of queries whose neighbours have `similarity` and `labels` [Q, k]: each neighbour
    votes for its class with weight exp(cos / T); chunks of `chunk_size` queries hold their [chunk, classes] votes."""
    predictions = []
    for chunk_similarity, chunk_labels in zip(similarity.split(chunk_size), labels.split(chunk_size), strict=True):
        votes = torch.zeros(chunk_labels.shape[0], num_classes, device=chunk_labels.device)
        votes.scatter_add_(1, chunk_labels, (chunk_similarity / temperature).exp())
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions)


def merge_ranks(similarity: Tensor, labels: Tensor, *, k: int, ctx: DistributedContext) -> tuple[Tensor, Tensor] | None:
    """On rank 0, the k most similar of every rank's `nearest` neighbours [Q, <= k] of the same queries: the
    neighbours in the union of the ranks' banks. None on the other ranks."""
    # A part with fewer than k items pads its neighbours with -inf, never chosen over a real one (cos >= -1).
    width = k - similarity.shape[1]
    similarity, labels = F.pad(similarity, (0, width), value=float("-inf")), F.pad(labels, (0, width))
    similarity, labels = gather_tensor(similarity, ctx), gather_tensor(labels, ctx)  # [W, Q, k]
    if similarity is None or labels is None:
        return None
    similarity, labels = (t.transpose(0, 1).flatten(1) for t in (similarity, labels))  # [Q, W * k]
    similarity, index = similarity.topk(k, dim=1)
    return similarity, labels.gather(1, index)


def evaluate_knn(
    encoder: nn.Module,
    train_shards: Spec,
    val_shards: Spec,
    *,
    settings: KnnConfig | None = None,
    device: str | torch.device = "cpu",
    ctx: DistributedContext | None = None,
    progress: bool = False,
    allow_lost: bool = False,
    **overrides: int | float,
) -> KnnResult | None:
    """Top-1 accuracy on `val_shards` of the kNN classifier whose bank is `train_shards`' features.

    A spec is resolved here, once, with `allow_lost`. `settings` (default `KnnConfig()`; its shard fields
    unused) gives k, T, the sizes and the batch size; keyword `overrides` replace single fields of it.
    The bank is kept and searched on `device`. With a multi-rank `ctx` every rank must call it: each
    keeps the features of 1/W of the bank and searches them for every query, rank 0 merges the ranks'
    k nearest, votes and returns the result; the others return None. Sets whose class names differ are
    refused first (ClassMismatchError); a set that loses samples while read raises LostSamplesError
    unless `allow_lost` (then the result lists the loss).
    """
    settings = dataclasses.replace(settings or KnnConfig(), **overrides)
    k, temperature = settings.k, settings.temperature
    train_shards, val_shards = (resolve_shard_set(spec, allow_lost=True) for spec in (train_shards, val_shards))
    check_same_classes(train_shards, val_shards)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    skipped: list[str] = []
    lost: list[LostSamples] = []  # every rank reads every sample, so each rank's list is the whole set's
    options = {"crop_size": settings.crop_size, "resize_size": settings.resize_size,
               "batch_size": settings.batch_size, "device": device, "skipped": skipped, "part": (rank, world),
               "progress": progress and rank == 0, "allow_lost": allow_lost, "lost": lost,
               "keep_on": device}
    bank, bank_labels = extract_features(encoder, train_shards, **options)
    queries, query_labels = extract_features(encoder, val_shards, **options)
    num_train, bank_classes = len(bank_labels), bank_labels.unique().tolist()
    if world > 1:  # each rank searches its part of the bank for every query; rank 0 merges and votes
        parts = gather_object((skipped, num_train, bank_classes), ctx)
        queries, query_labels = (all_gather_rows(t.to(device), ctx) for t in (queries, query_labels))
    candidates = nearest(bank, bank_labels, queries, k=k)
    if world > 1:
        candidates = merge_ranks(*(t.to(device) for t in candidates), k=k, ctx=ctx)
        if parts is None or candidates is None:
            return None
        skipped, num_train = [key for keys, _, _ in parts for key in keys], sum(count for _, count, _ in parts)
        bank_classes = [label for *_, labels in parts for label in labels]
    for source, count in ((train_shards, num_train), (val_shards, len(query_labels))):
        if count == 0:
            raise ValueError(f"no decodable labelled images in {source}")
    similarity, labels = candidates
    num_classes = class_count((train_shards, bank_classes), (val_shards, query_labels.cpu()))
    predicted = vote(similarity, labels, num_classes=num_classes, temperature=temperature)
    top1 = int((predicted.cpu() == query_labels.cpu()).sum()) / len(query_labels)
    protocol = {"image_size": settings.crop_size, "resize_size": resize_of(settings.crop_size, settings.resize_size),
                "k": k, "temperature": temperature, "bank": str(train_shards), "split": str(val_shards)}
    return KnnResult(top1=top1, num_train=num_train, num_val=len(query_labels), skipped=len(skipped),
                     skipped_keys=sorted(skipped), lost=lost, settings=protocol)
