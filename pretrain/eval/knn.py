"""Weighted cosine kNN evaluation of an encoder on labelled shard sets (train = bank, val = queries).

The classifier of Wu et al. 2018 as used by DINO and lightly's benchmarks: l2-normalised
features, the k most similar bank items vote for their class with weight exp(cos / T);
defaults k = 20, T = 0.07. Images are decoded, the short side resized (bicubic), centre-cropped
and normalised with the ImageNet mean/std, as in the linear-evaluation test transform.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch import Tensor, nn
from torchvision.transforms import InterpolationMode

from pretrain.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from pretrain.config import from_dict
from pretrain.distributed import DistributedContext, gather_object
from pretrain.model.resnet import ResNet, resnet
from shards import iter_samples

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class KnnResult:
    top1: float
    num_train: int
    num_val: int
    skipped: int  # samples that could not be decoded (reported on stderr)


def knn_predict(
    bank_features: Tensor,
    bank_labels: Tensor,
    query_features: Tensor,
    *,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> Tensor:
    """Predicted class [Q] of each query: the k nearest bank items (cosine) vote with weight exp(cos / T).

    Queries are processed in chunks so memory stays O(chunk_size * bank size).
    """
    if bank_features.shape[0] == 0:
        raise ValueError("the kNN bank is empty")
    bank = F.normalize(bank_features.float(), dim=1)
    queries = F.normalize(query_features.float(), dim=1)
    k = min(k, bank.shape[0])
    predictions = []
    for start in range(0, queries.shape[0], chunk_size):
        similarity = queries[start : start + chunk_size] @ bank.T
        top_similarity, top_index = similarity.topk(k, dim=1)
        votes = torch.zeros(similarity.shape[0], num_classes, device=similarity.device)
        votes.scatter_add_(1, bank_labels[top_index], (top_similarity / temperature).exp())
        predictions.append(votes.argmax(dim=1))
    return torch.cat(predictions) if predictions else torch.empty(0, dtype=torch.long)


def preprocess(jpeg: bytes, *, crop_size: int, resize_size: int) -> Tensor:
    """JPEG bytes -> normalised float [3, crop, crop]: resize short side (bicubic), centre crop."""
    with Image.open(io.BytesIO(jpeg)) as decoded:
        image = decoded.convert("RGB")
    image = TF.resize(image, [resize_size], interpolation=InterpolationMode.BICUBIC, antialias=True)
    image = TF.center_crop(image, [crop_size, crop_size])
    return TF.normalize(TF.to_dtype(TF.pil_to_tensor(image), torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)


def _labelled_images(
    source: str | Path, *, crop_size: int, resize_size: int, skipped: list[str], part: tuple[int, int]
) -> Iterator[tuple[Tensor, int]]:
    index, parts = part
    for position, sample in enumerate(iter_samples(Path(source))):
        if position % parts != index:
            continue
        if sample["label"] is None:
            raise ValueError(
                f"sample {sample['key']} in {sample['shard']} has no class label; kNN needs shard sets "
                "built from a labelled folder (class sub-folders)"
            )
        try:
            image = preprocess(sample["jpg"], crop_size=crop_size, resize_size=resize_size)
        except Exception as error:  # a corrupt image is reported and skipped, never fatal
            skipped.append(sample["key"])
            print(f"kNN: skipping {sample['key']} in {sample['shard']}: {error}", file=sys.stderr)
            continue
        yield image, sample["label"]


@torch.no_grad()
def extract_features(
    encoder: nn.Module,
    source: str | Path,
    *,
    crop_size: int,
    resize_size: int = 0,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    skipped: list[str] | None = None,
    part: tuple[int, int] = (0, 1),
) -> tuple[Tensor, Tensor]:
    """(features [N, F] float32 on CPU, labels [N]) of every decodable sample of a labelled shard set.

    part = (index, parts): only the samples at positions p (shard-set order) with p % parts ==
    index, so `parts` ranks together extract each sample once. Only a split set's part may be empty.
    """
    if not 0 <= part[0] < part[1]:
        raise ValueError(f"part must be (index, parts) with 0 <= index < parts, got {part}")
    resize_size = resize_size or round(crop_size / 0.875)
    device = torch.device(device)
    was_training = encoder.training
    encoder.eval()
    features, labels, images, batch_labels = [], [], [], []
    skipped = [] if skipped is None else skipped

    def flush() -> None:
        batch = torch.stack(images).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features.append(encoder(batch).float().cpu())
        labels.extend(batch_labels)
        images.clear()
        batch_labels.clear()

    try:
        for image, label in _labelled_images(source, crop_size=crop_size, resize_size=resize_size,
                                             skipped=skipped, part=part):
            images.append(image)
            batch_labels.append(label)
            if len(images) == batch_size:
                flush()
        if images:
            flush()
    finally:
        encoder.train(was_training)
    if not features:
        if part[1] > 1:  # the other ranks may hold this set's images; evaluate_knn checks the union
            return torch.empty(0, 0), torch.empty(0, dtype=torch.long)
        raise ValueError(f"no decodable labelled images in {source}")
    return torch.cat(features), torch.tensor(labels, dtype=torch.long)


def evaluate_knn(
    encoder: nn.Module,
    train_shards: str | Path,
    val_shards: str | Path,
    *,
    k: int = 20,
    temperature: float = 0.07,
    crop_size: int = 224,
    resize_size: int = 0,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    ctx: DistributedContext | None = None,
) -> KnnResult | None:
    """Top-1 accuracy on `val_shards` of the kNN classifier whose bank is `train_shards`' features.

    With a multi-rank `ctx` every rank must call it: each extracts the features of 1/W of the
    samples, rank 0 gathers them, classifies and returns the result; the other ranks return None.
    """
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    skipped: list[str] = []
    options = {"crop_size": crop_size, "resize_size": resize_size, "batch_size": batch_size,
               "device": device, "skipped": skipped, "part": (rank, world)}
    bank, bank_labels = extract_features(encoder, train_shards, **options)
    queries, query_labels = extract_features(encoder, val_shards, **options)
    skipped_count = len(skipped)
    if world > 1:
        gathered = gather_object((bank, bank_labels, queries, query_labels, skipped_count), ctx)
        if gathered is None:
            return None
        bank, bank_labels = _join_parts([(g[0], g[1]) for g in gathered], train_shards)
        queries, query_labels = _join_parts([(g[2], g[3]) for g in gathered], val_shards)
        skipped_count = sum(g[4] for g in gathered)
    num_classes = int(max(bank_labels.max(), query_labels.max())) + 1
    predicted = knn_predict(bank, bank_labels, queries, num_classes=num_classes, k=k, temperature=temperature)
    top1 = float((predicted == query_labels).float().mean())
    return KnnResult(top1=top1, num_train=len(bank_labels), num_val=len(query_labels), skipped=skipped_count)


def _join_parts(parts: list[tuple[Tensor, Tensor]], source: str | Path) -> tuple[Tensor, Tensor]:
    """Concatenate the ranks' (features, labels); parts without images are left out."""
    kept = [(features, labels) for features, labels in parts if labels.numel()]
    if not kept:
        raise ValueError(f"no decodable labelled images in {source}")
    return torch.cat([f for f, _ in kept]), torch.cat([labels for _, labels in kept])


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself, or the newest checkpoint-*.pt when `path` is a run's output folder."""
    path = Path(path)
    if not path.is_dir():
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(f"no checkpoint-*.pt in {path}; pass a checkpoint file or a pretraining output folder")
    return newest


def encoder_from_checkpoint(path: str | Path, *, network: str = "online") -> ResNet:
    """The ResNet encoder of a pretraining checkpoint ("online" or "target" network), on CPU.

    `path` is a checkpoint file or a run's output folder (its newest checkpoint is used).
    """
    if network not in ("online", "target"):
        raise ValueError(f"network must be 'online' or 'target', got {network!r}")
    from pretrain.eval.export import (  # an exported file (relicv2 export)
        is_encoder_file,
        load_encoder_file,
    )

    if is_encoder_file(path):
        return load_encoder_file(path)
    path = resolve_checkpoint(path)
    payload = load_checkpoint(path)
    config = from_dict(payload["config"], source=f"the config embedded in {path}")
    encoder = resnet(config.model.depth, config.model.width)
    prefix = "encoder."
    state = {name[len(prefix):]: value for name, value in payload[network].items() if name.startswith(prefix)}
    encoder.load_state_dict(state)
    return encoder


def random_encoder(depth: int, width: int = 1, *, seed: int = 0) -> ResNet:
    """A randomly initialised encoder (torchvision's initialisation): the baseline kNN score."""
    torch.manual_seed(seed)
    return resnet(depth, width)
