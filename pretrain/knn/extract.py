"""Features of a labelled shard set through a frozen encoder, on the evaluation's test view (`preprocess`),
which the kNN monitor, `relicv2 eval knn` and the linear `fast` protocol all take. In a job of several
ranks each extracts its `part` of a set; `join_parts` puts the ranks' parts together.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as TF
from torch import Tensor, nn

from relicv2.jobs.progress import tracked
from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.pretrain.knn.outcome import LostSamples, refuse_lost
from relicv2.pretrain.knn.view import test_view_image
from relicv2.shards import ReadReport, ShardSet, iter_samples
from relicv2.shards.images import ImageLoadError
from relicv2.shards.sample import label_refusal


def preprocess(jpeg: bytes, *, crop_size: int, resize_size: int = 0, name: str = "image") -> Tensor:
    """Image bytes -> the normalised test view, float [3, crop, crop] (`test_view_image`)."""
    image = test_view_image(jpeg, crop_size=crop_size, resize_size=resize_size, name=name)
    return TF.normalize(TF.to_dtype(TF.pil_to_tensor(image), torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)


def _labelled_images(
    source: ShardSet, *, crop_size: int, resize_size: int, skipped: list[str], part: tuple[int, int],
    report: ReadReport, allow_lost: bool, progress: bool = False,
) -> Iterator[tuple[Tensor, int, str]]:
    index, parts = part
    samples = tracked(iter_samples(source, report=report), f"kNN features {Path(str(source)).name}", source.samples,
                      unit="img", enabled=progress)
    for position, sample in enumerate(samples):
        if not allow_lost:  # every rank reads the whole set, so every rank stops here alike
            refuse_lost(source, report, finished=False)
        if position % parts != index:
            continue
        if sample["label"] is None:
            raise ValueError(label_refusal(f"{sample['key']} in {sample['shard']}", sample.get("label_text"), "evaluation"))
        try:
            image = preprocess(sample["image"], crop_size=crop_size, resize_size=resize_size,
                               name=f"{sample['key']} in {sample['shard']}")
        except ImageLoadError as error:  # a corrupt image is reported and skipped, never fatal; a bug surfaces
            skipped.append(sample["key"])
            print(f"kNN: skipping {error}", file=sys.stderr)
            continue
        yield image, sample["label"], sample["key"]


class _Rows:
    """Feature rows filled batch by batch into one tensor allocated for the rows expected: the bank is held
    once, where a list of batches and then their concatenation would hold it twice (2 x 10 GiB at ImageNet's
    1.28 M x 2048). More rows than expected (a set that grew) double it; fewer leave a view of its start."""

    def __init__(self, expected: int, device: torch.device) -> None:
        self.expected, self.device = expected, device
        self.filled = 0
        self.buffer: Tensor | None = None

    def add(self, batch: Tensor) -> None:
        count = batch.shape[0]
        if self.buffer is None:
            self.buffer = self._allocate(max(self.expected, count), batch)
        elif self.filled + count > self.buffer.shape[0]:
            grown = self._allocate(max(2 * self.buffer.shape[0], self.filled + count), batch)
            grown[: self.filled] = self.buffer[: self.filled]
            self.buffer = grown
        self.buffer[self.filled : self.filled + count] = batch
        self.filled += count

    def _allocate(self, rows: int, like: Tensor) -> Tensor:
        size = rows * like.shape[1] * like.element_size()
        if self.device.type == "cuda" and size > torch.cuda.mem_get_info(self.device)[0] // 2:
            # Half the free memory at most: the search's blocks and, in a training's monitor, the run need the rest.
            print(f"kNN: {rows:,} features ({size / 2**30:.1f} GiB) do not fit beside the work on {self.device}; "
                  "they are kept and searched on the CPU", file=sys.stderr)
            self.device = torch.device("cpu")
        return torch.empty((rows, like.shape[1]), dtype=like.dtype, device=self.device)

    def tensor(self) -> Tensor | None:
        return None if self.buffer is None else self.buffer[: self.filled]


@torch.no_grad()
def extract_features(
    encoder: nn.Module,
    source: ShardSet,
    *,
    crop_size: int,
    resize_size: int = 0,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    skipped: list[str] | None = None,
    part: tuple[int, int] = (0, 1),
    progress: bool = False,
    allow_lost: bool = False,
    lost: list[LostSamples] | None = None,
    keep_on: str | torch.device = "cpu",
    keys: list[str] | None = None,
) -> tuple[Tensor, Tensor]:
    """(features [N, F] float32, labels [N]) of every decodable sample of a labelled shard set, both on
    `keep_on` (the CPU when they would take over half of a GPU's free memory).

    part = (index, parts): only the samples at positions p with p % parts == index, so `parts` ranks
    together extract each sample once; only a split set's part may be empty. The keys of undecodable
    images are appended to `skipped`. A set that loses samples while read (`shards.ReadReport`) raises
    LostSamplesError, or with `allow_lost` goes on and appends what it lost to `lost`. The key of each
    row is appended to `keys` when given.
    """
    device = torch.device(device)
    was_training = encoder.training
    encoder.eval()
    labels: list[int] = []
    skipped = [] if skipped is None else skipped
    report = ReadReport()
    features = _Rows(len(range(part[0], source.samples, part[1])), torch.device(keep_on))  # this part's samples
    pairs = _labelled_images(source, crop_size=crop_size, resize_size=resize_size, skipped=skipped, part=part,
                             report=report, allow_lost=allow_lost, progress=progress)
    try:
        while batch := list(itertools.islice(pairs, batch_size)):
            images, batch_labels, batch_keys = zip(*batch, strict=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                features.add(encoder(torch.stack(images).to(device)).float())
            labels.extend(batch_labels)
            if keys is not None:
                keys.extend(batch_keys)
    finally:
        encoder.train(was_training)
    if not allow_lost:
        refuse_lost(source, report, finished=True)
    elif (entry := LostSamples.of(source, report)) is not None and lost is not None:
        lost.append(entry)
    bank = features.tensor()
    if bank is None:
        if part[1] > 1:  # the other ranks may hold this set's images; evaluate_knn checks the union
            return torch.empty(0, 0), torch.empty(0, dtype=torch.long)
        raise ValueError(f"no decodable labelled images in {source}")
    return bank, torch.tensor(labels, dtype=torch.long, device=bank.device)


def join_parts(parts: list[tuple[Tensor, Tensor]], source: ShardSet, device: torch.device) -> tuple[Tensor, Tensor]:
    """The ranks' (features, labels) in rank order as one bank on `device`; parts without images are left
    out. `parts` is emptied as they are copied, so the bank is held about once, not parts + their join."""
    kept = [(features, labels) for features, labels in parts if labels.numel()]
    parts.clear()
    if not kept:
        raise ValueError(f"no decodable labelled images in {source}")
    labels = torch.cat([part_labels for _, part_labels in kept])
    rows = _Rows(len(labels), device)
    while kept:
        rows.add(kept.pop(0)[0])
    bank = rows.tensor()
    assert bank is not None  # kept was not empty
    return bank, labels.to(bank.device)
