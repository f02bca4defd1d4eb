"""Labelled train / test views for the linear and fine-tuning protocols (PIL path, torch DataLoader); test
views are the kNN monitor's `preprocess`. Every draw is seeded by (seed, epoch, sample position), so a
resumed run sees the same views.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import UnidentifiedImageError
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, default_collate

from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.pretrain.knn import classes
from relicv2.pretrain.knn.extract import preprocess
from relicv2.pretrain.views.config import CROP_RATIO, FULL_CROP_SCALE
from relicv2.pretrain.views.reference import random_resized_crop
from relicv2.shards.images import load_image
from relicv2.shards.reader import SampleRef
from relicv2.shards.sample_set import load_sample_set, require_class_labels
from relicv2.shards.sample_table import SampleTable
from relicv2.shards.shardset import Spec


def labelled_samples(source: str | Path, keys: set[str] | None = None) -> tuple[SampleTable, set[str]]:
    """(usable samples of a labelled shard set, optionally only `keys`, in reader order; the keys left out).

    Structurally broken samples (truncated, missing members) are left out by `load_sample_set`,
    which names them in a warning; their keys (of the listed ones, with `keys`) are returned so
    outputs report them.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped keys are printed below instead
        sample_set = load_sample_set(source)
    if sample_set.skipped_keys:
        print(f"{source}: left out {len(sample_set.skipped_keys)} broken samples {dict(sample_set.skipped)}, "
              f"e.g. {sample_set.skipped_keys[:5]}", file=sys.stderr)
    samples = sample_set.samples
    if keys is not None:
        samples = samples.select([i for i, key in enumerate(samples.keys()) if key in keys])
    if not samples:
        what = "none of the listed keys is" if keys is not None else "no usable sample is"
        raise ValueError(f"{what} in {source}; check the shard set (and the key list)")
    missing = sorted(keys - set(samples.keys()) - set(sample_set.skipped_keys)) if keys is not None else []
    if missing:
        raise ValueError(f"{len(missing)} listed keys are not in {source} (e.g. {missing[:3]}); "
                         "the key list belongs to another shard set")
    return samples, {key for key in sample_set.skipped_keys if keys is None or key in keys}


def train_view(jpeg: bytes, *, crop_size: int, scale: tuple[float, float], rng: np.random.Generator) -> Tensor:
    """Random-resized-crop (torchvision's algorithm, seeded) to crop_size + horizontal flip, normalised,
    of the displayed image (EXIF orientation applied); a bad image raises ImageLoadError (a ValueError)."""
    image = load_image(jpeg, "image")
    left, top, width, height = random_resized_crop(image.width, image.height, scale, CROP_RATIO, rng)
    view = TF.resized_crop(TF.pil_to_tensor(image), top, left, height, width, [crop_size, crop_size],
                           antialias=True)
    if rng.random() < 0.5:
        view = TF.horizontal_flip(view)
    return TF.normalize(TF.to_dtype(view, torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)


def class_count(*labelled: tuple[Sequence[SampleRef], Spec]) -> int:
    """The classes of (samples, their set) pairs (`pretrain.knn.classes.class_count`); ValueError naming an
    unlabelled sample or a label outside the classes."""
    return classes.class_count(*((source, require_class_labels(samples, source)) for samples, source in labelled))


@dataclass(eq=False)
class LabelledViews(Dataset):
    """(view, label) per sample; an undecodable image yields its key (reported, then dropped by `collate`)."""

    samples: Sequence[SampleRef]
    _: KW_ONLY
    train: bool
    crop_size: int
    resize_size: int
    scale: tuple[float, float] = FULL_CROP_SCALE
    seed: int = 0
    epoch: int = 0  # set before each epoch: train views are drawn from (seed, epoch, position)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int] | str:
        sample = self.samples[index]
        try:
            label = sample.label  # a class index: `class_count` checked every sample
            jpeg = sample.read_image()
            if self.train:
                rng = np.random.default_rng([self.seed, self.epoch, index])
                view = train_view(jpeg, crop_size=self.crop_size, scale=self.scale, rng=rng)
            else:
                view = preprocess(jpeg, crop_size=self.crop_size, resize_size=self.resize_size)
        except (OSError, UnidentifiedImageError, ValueError, AttributeError) as error:
            print(f"skipping {sample.key} in {sample.tar}: {error}", file=sys.stderr)
            return sample.key
        return view, label


def collate(items: list[tuple[Tensor, int | Tensor] | str]) -> tuple[Tensor, Tensor, list[str]]:
    """(images, labels or label masks, the keys of the undecodable items)."""
    kept = [item for item in items if not isinstance(item, str)]
    bad = [item for item in items if isinstance(item, str)]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), bad
    images, labels = default_collate(kept)
    return images, labels, bad


def epoch_batches(views: LabelledViews | Any, epoch: int, *, batch_size: int, workers: int, rank: int = 0,
                  world: int = 1, drop_last: bool = False) -> DataLoader:
    """This rank's batches of `views` (any dataset with `train`, `seed` and `epoch`) for one epoch: every W-th
    from `rank` of a permutation seeded by (seed, epoch) for train views, of 0..N-1 for test views."""
    views.epoch = epoch
    order = (torch.randperm(len(views), generator=torch.Generator().manual_seed(views.seed * 100003 + epoch))
             if views.train else torch.arange(len(views)))
    return DataLoader(torch.utils.data.Subset(views, order[rank::world].tolist()), batch_size=batch_size,
                      shuffle=False, num_workers=workers, collate_fn=collate, drop_last=drop_last,
                      persistent_workers=False)
