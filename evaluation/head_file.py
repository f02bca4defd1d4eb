"""The trained linear head as a file (`trained-head.pt`, written by `relicv2 eval linear --output DIR` under
both protocols), and its scoring of other labelled sets with the same frozen encoder, with no training.

The file holds the head's weights, the digest of the encoder it was trained on (`features.encoder_digest`,
over the encoder's weights), the class names of its training set (name i is output i; empty when that set
recorded none), the feature normalisation it was trained with and the evaluation view. Normalisation: the
`fast` protocol standardises features with the train set's mean/std before the head ("standardised", both
stored); the `paper` protocol feeds the encoder's features as they are ("none": mean 0, std 1 stored).
A head from another encoder, or scored on a set whose classes it does not name, is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from relicv2.evaluation.features import FeatureSpec, cached_features, encoder_digest
from relicv2.models.torchfile import StateDict, TorchFileError, TorchFormat
from relicv2.pretrain.distributed import DistributedContext
from relicv2.pretrain.knn.classes import class_names
from relicv2.pretrain.views.config import resize_of
from relicv2.shards.shardset import ShardSet

TRAINED_HEAD_FILE = "trained-head.pt"


class HeadMismatchError(TorchFileError):
    """A head file that does not fit the encoder or the set it is asked to score."""


HEAD = TorchFormat(
    "linear head file", fix="train a head for this encoder with `relicv2 eval linear --output DIR`",
    tag="relicv2-trained-head", version=1, error=HeadMismatchError,
    fields={"head": StateDict, "encoder_digest": str, "classes": list, "normalisation": str,
            "feature_mean": Tensor, "feature_std": Tensor, "crop_size": int, "resize_size": int, "protocol": str})


@dataclass(frozen=True)
class TrainedHead:
    """A loaded head file: `logits(features)` applies its normalisation, then the linear layer."""

    linear: nn.Linear
    encoder_digest: str
    classes: list[str]
    normalisation: str  # "standardised" (fast) or "none" (paper)
    mean: Tensor
    std: Tensor
    crop_size: int
    resize_size: int  # the short side before the centre crop (resolved, never 0)
    protocol: str
    path: Path | None = None

    @property
    def num_classes(self) -> int:
        return self.linear.out_features

    @torch.no_grad()
    def logits(self, features: Tensor) -> Tensor:
        return self.linear((features.float().cpu() - self.mean) / self.std)

    def check_encoder(self, encoder: nn.Module, described: str) -> None:
        """Refuse an encoder other than the one the head was trained on."""
        found = encoder_digest(encoder)
        if found != self.encoder_digest:
            raise HeadMismatchError(
                f"{self.path} was trained on another encoder (digest {self.encoder_digest[:12]}), not {described} "
                f"({found[:12]}); give the encoder it was trained on, or train a head for this one with "
                "`relicv2 eval linear --output DIR`")

    def check_classes(self, names: list[str] | None, source: object) -> None:
        """Refuse a set whose recorded class names are not the head's (a subset needs a class mapping)."""
        if names is None or not self.classes or names == self.classes:
            return
        first = next((i for i, (a, b) in enumerate(zip(self.classes, names, strict=False)) if a != b),
                     min(len(names), len(self.classes)))
        says = repr(names[first]) if first < len(names) else "absent"
        head_says = repr(self.classes[first]) if first < len(self.classes) else "absent"
        raise HeadMismatchError(
            f"{source} has {len(names)} classes, the head {self.path} {len(self.classes)}: class {first} is {says} "
            f"there, {head_says} in the head; score a set built from the head's class folders")


def save_head(path: str | Path, linear: nn.Linear, *, encoder: nn.Module, classes: list[str] | None,
              mean: Tensor | None, std: Tensor | None, crop_size: int, resize_size: int, protocol: str) -> Path:
    """Write a head file; `mean`/`std` None: the head takes the features as they are."""
    width = linear.in_features
    return HEAD.save(path, {
        "head": {k: v.detach().cpu() for k, v in linear.state_dict().items()},
        "encoder_digest": encoder_digest(encoder), "classes": list(classes or []),
        "normalisation": "none" if mean is None else "standardised",
        "feature_mean": torch.zeros(width) if mean is None else mean.detach().float().cpu(),
        "feature_std": torch.ones(width) if std is None else std.detach().float().cpu(),
        "crop_size": crop_size, "resize_size": resize_of(crop_size, resize_size), "protocol": protocol})


def load_head(path: str | Path) -> TrainedHead:
    """A head file, checked (HeadMismatchError naming the file when it cannot be used)."""
    path = Path(path)
    payload = HEAD.load(path)
    weight = payload["head"].get("weight")
    if weight is None or weight.ndim != 2 or set(payload["head"]) != {"weight", "bias"} or \
            payload["feature_mean"].shape != (weight.shape[1],) or payload["feature_std"].shape != (weight.shape[1],) \
            or len(payload["classes"]) not in (0, weight.shape[0]):
        raise HEAD.fail(path, "is damaged or hand-made: its weights, normalisation and classes disagree in size")
    linear = nn.Linear(weight.shape[1], weight.shape[0])
    linear.load_state_dict(payload["head"])
    return TrainedHead(linear.eval(), payload["encoder_digest"], [str(c) for c in payload["classes"]],
                       payload["normalisation"], payload["feature_mean"], payload["feature_std"],
                       payload["crop_size"], payload["resize_size"], payload["protocol"], path)


@dataclass(frozen=True)
class HeadScore:
    top1: float
    num_images: int
    skipped_keys: tuple[str, ...]
    per_class_top1: dict[int, float]  # by the set's class index
    predictions: Tensor  # [N] the head's predicted class per image (among the targets' union when restricted)
    labels: Tensor  # [N] the set's class index per image
    correct: Tensor  # [N] bool, per image in the set's order: what an interval over images resamples


def score_head(
    head: TrainedHead, encoder: nn.Module, source: ShardSet, *, targets: list[list[int]] | None = None,
    crop_size: int | None = None, resize_size: int | None = None, batch_size: int = 256,
    device: str | torch.device = "cpu", ctx: DistributedContext | None = None, allow_lost: bool = False,
    encoder_name: str = "the given encoder", progress: bool = False,
) -> HeadScore:
    """Top-1 of `head` on the frozen `encoder`'s features of a labelled shard set (the head's own view unless
    `crop_size`/`resize_size` say another: a set of stored views is read uncropped with resize = crop).

    `targets[i]`: the head outputs that count as correct for the set's class i. Given, the logits are
    restricted to the union of all targets (ImageNet-R's 200 classes of a 1,000-way head); None: the set's
    classes are the head's (checked by name when both record names).
    The encoder must be the head's (HeadMismatchError)."""
    head.check_encoder(encoder, encoder_name)
    if targets is None:
        head.check_classes(class_names(source), source)
    elif not any(targets):
        raise HeadMismatchError(f"none of the classes of {source} maps to one of the head's")
    spec = FeatureSpec(crop_size=crop_size or head.crop_size,
                       resize_size=head.resize_size if resize_size is None else resize_size, batch_size=batch_size)
    features = cached_features(encoder, source, spec, cache_dir=None, device=device, ctx=ctx, allow_lost=allow_lost,
                               progress=progress)
    logits, labels = head.logits(features.features), features.labels
    if int(labels.max()) >= (len(targets) if targets is not None else head.num_classes):
        raise HeadMismatchError(f"{source} has class index {int(labels.max())}, beyond the "
                                f"{len(targets) if targets is not None else head.num_classes} classes scored")
    if targets is None:
        predictions = logits.argmax(dim=1)
        correct = predictions == labels
    else:  # the images of a class with no target (ObjectNet's classes outside ImageNet) are left out
        kept = torch.tensor([bool(targets[label]) for label in labels.tolist()], dtype=torch.bool)
        logits, labels = logits[kept], labels[kept]
        if not len(labels):
            raise HeadMismatchError(f"{source} has no image of a class the head scores")
        allowed = torch.tensor(sorted({t for row in targets for t in row}))
        predictions = allowed[logits[:, allowed].argmax(dim=1)]
        hit = torch.zeros(len(targets), head.num_classes, dtype=torch.bool)
        for i, row in enumerate(targets):
            hit[i, row] = True
        correct = hit[labels, predictions]
    per_class = {int(c): float(correct[labels == c].float().mean()) for c in labels.unique()}
    return HeadScore(float(correct.float().mean()), len(labels), features.skipped_keys, per_class, predictions,
                     labels, correct)
