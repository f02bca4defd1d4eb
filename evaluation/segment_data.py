"""The labelled pixels of `relicv2 eval segment`: image / index-mask pairs listed from a PASCAL VOC or
Cityscapes layout (torchvision's `VOCSegmentation` / `Cityscapes` list the files, with download=False) or a
folder (`images/NAME.jpg|png|...` beside `masks/NAME.png`), every pair checked (both files there, the mask of
its image's size) before any training; then their train views (random scale, crop, flip: the MoCo/DeepLab
recipe) and test views (the whole image). 255 in a mask marks pixels that are ignored.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from relicv2.evaluation.views import epoch_batches as labelled_batches
from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.shards.images import (
    ImageLoadError,
    header_size,
    load_gray,
    load_index_mask,
    load_rgb,
    read_bytes,
)
from relicv2.shards.sources import IMAGE_EXTENSIONS
from relicv2.shards.subset import read_key_list

IGNORE = 255  # the mask value of pixels that are not scored and give no loss
LAYOUTS = ("folder", "voc", "cityscapes")
CLASSES = {"voc": 21, "cityscapes": 19}  # background + 20 objects; Cityscapes' 19 evaluated train ids
VOC_AUG = "train_aug"  # the 10,582 images of SBD + VOC train (DeepLab's SegmentationClassAug layout)


class SegmentDataError(ValueError):
    """A segmentation set that cannot be used as given: one line naming the file and the fix."""


@dataclass(frozen=True)
class Pair:
    key: str
    image: Path
    mask: Path


def list_pairs(layout: str, root: Path, split: str, *, year: str = "2012") -> list[Pair]:
    """The checked pairs of `split` in `root`: for `voc` an image set (train, val, trainval or train_aug), for
    `cityscapes` train or val (fine annotations), for `folder` a subfolder of `root` or a file of NAMEs
    (empty: every pair in `root`)."""
    root = Path(root)
    if not root.is_dir():
        raise SegmentDataError(f"{root} is not a folder; pass the data set's root with --data")
    if layout == "folder":
        pairs = _folder_pairs(root, split)
    elif layout == "voc":
        pairs = _voc_pairs(root, split, year)
    elif layout == "cityscapes":
        pairs = _cityscapes_pairs(root, split)
    else:
        raise SegmentDataError(f"layout {layout!r} is none of {', '.join(LAYOUTS)}")
    if not pairs:
        raise SegmentDataError(f"{root}: split {split or 'all'!r} lists no image; check the split")
    for pair in pairs:
        for path, what in ((pair.image, "image"), (pair.mask, "mask")):
            if not path.is_file():
                raise SegmentDataError(f"{path}: the {what} of {pair.key} is missing; every image needs its mask "
                                       "(255 marks pixels to ignore)")
        try:
            image_size, mask_size = header_size(pair.image), header_size(pair.mask)
        except ImageLoadError as error:
            raise SegmentDataError(f"{error}; remove the pair or replace the file") from None
        if image_size != mask_size:
            raise SegmentDataError(f"{pair.mask}: the mask is {mask_size[0]}x{mask_size[1]} but its image "
                                   f"{pair.image.name} is {image_size[0]}x{image_size[1]}; give each image a "
                                   "mask of its own size")
    return pairs


def _folder_pairs(root: Path, split: str) -> list[Pair]:
    if split and (root / split).is_dir():  # a subfolder of its own images/ and masks/
        root, split = root / split, ""
    images, masks = root / "images", root / "masks"
    if not images.is_dir() or not masks.is_dir():
        raise SegmentDataError(f"{root} holds no images/ and masks/ folders; a folder set is images/NAME.jpg "
                               "(or .png, ...) with masks/NAME.png")
    found: dict[str, Path] = {}
    for path in sorted(images.iterdir()):
        if path.suffix.lower() in IMAGE_EXTENSIONS:
            if path.stem in found:
                raise SegmentDataError(f"{path} and {found[path.stem].name} share the name {path.stem}; keep one")
            found[path.stem] = path
    if split and not Path(split).is_file():
        raise SegmentDataError(f"split {split!r} is neither a subfolder of {root} (with images/ and masks/) nor a "
                               "file of image names; give one of them")
    keys = sorted(read_key_list(split, "split file")) if split else sorted(found)
    if unknown := [key for key in keys if key not in found]:
        raise SegmentDataError(f"{split}: {len(unknown)} name(s) have no image in {images} (e.g. {unknown[0]}); "
                               "list the images' names without their extension")
    return [Pair(key, found[key], masks / f"{key}.png") for key in keys]


def _voc_pairs(root: Path, split: str, year: str) -> list[Pair]:
    from torchvision.datasets import VOCSegmentation

    aug = split == VOC_AUG
    try:
        listing = VOCSegmentation(root, year=year, image_set="train" if aug else split, download=False)
    except (RuntimeError, OSError, ValueError) as error:
        raise SegmentDataError(f"{root}: not a PASCAL VOC {year} layout with the {split!r} image set ({error}); "
                               "pass the folder holding VOCdevkit/") from None
    if not aug:
        return [Pair(Path(image).stem, Path(image), Path(mask)) for image, mask in zip(listing.images, listing.masks,
                                                                                        strict=True)]
    voc = Path(listing.images[0]).parent.parent if listing.images else root
    names = voc / "ImageSets" / "Segmentation" / f"{VOC_AUG}.txt"
    try:
        keys = [line.strip() for line in names.read_text().splitlines() if line.strip()]
    except OSError:
        raise SegmentDataError(f"{names} is missing: train_aug needs SBD's list there and its masks in "
                               "SegmentationClassAug/") from None
    return [Pair(key, voc / "JPEGImages" / f"{key}.jpg", voc / "SegmentationClassAug" / f"{key}.png")
            for key in keys]


def _cityscapes_pairs(root: Path, split: str) -> list[Pair]:
    from torchvision.datasets import Cityscapes

    try:
        listing = Cityscapes(root, split=split, mode="fine", target_type="semantic")
    except (RuntimeError, OSError, ValueError) as error:
        raise SegmentDataError(f"{root}: not a Cityscapes layout with the fine {split!r} split ({error}); pass the "
                               "folder holding leftImg8bit/ and gtFine/") from None
    pairs = [Pair(Path(image).name.split("_leftImg8bit")[0], Path(image), Path(targets[0]))
             for image, targets in zip(listing.images, listing.targets, strict=True)]
    return sorted(pairs, key=lambda pair: pair.key)


def train_ids() -> np.ndarray:
    """Cityscapes' label ids (what gtFine's labelIds PNGs hold) -> its 19 train ids, the rest IGNORE."""
    from torchvision.datasets import Cityscapes

    table = np.full(256, IGNORE, dtype=np.uint8)
    for label in Cityscapes.classes:
        if label.id >= 0 and 0 <= label.train_id < IGNORE:
            table[label.id] = label.train_id
    return table


def read_pair(pair: Pair, *, num_classes: int, binarise: int = 0, table: np.ndarray | None = None,
              ) -> tuple[np.ndarray, np.ndarray]:
    """(RGB HxWx3, class indices HxW) of a pair: the mask's values as they are, mapped through `table`, or, with
    `binarise`, 1 where a grey mask is >= binarise and 0 elsewhere. ValueError naming the file otherwise."""
    image = load_rgb(read_bytes(pair.image), str(pair.image))
    data = read_bytes(pair.mask)
    if binarise:
        mask = (load_gray(data, str(pair.mask)) >= binarise).astype(np.uint8)
    else:
        mask = load_index_mask(data, str(pair.mask))
    if table is not None:
        mask = table[mask]
    if mask.shape != image.shape[:2]:
        raise SegmentDataError(f"{pair.mask}: the mask is not of its image's size")
    beyond = mask[(mask != IGNORE) & (mask >= num_classes)]
    if beyond.size:
        raise SegmentDataError(f"{pair.mask}: class index {int(beyond.max())} is beyond the {num_classes} classes "
                               "(255 marks pixels to ignore); set num_classes, or binarise a grey mask")
    return image, mask


def _resized(image: Tensor, mask: Tensor, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    image = TF.resize(image, list(size), interpolation=TF.InterpolationMode.BILINEAR, antialias=True)
    return image, TF.resize(mask[None], list(size), interpolation=TF.InterpolationMode.NEAREST)[0]


def _short_side(height: int, width: int, side: int) -> tuple[int, int]:
    scale = side / min(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


@dataclass(eq=False)
class SegmentViews(Dataset):
    """(image [3, H, W] normalised, mask [H, W] long) per pair; an unusable pair yields its key (reported,
    then left out by `collate`). Train views: scaled by a factor drawn from `scale`, padded (mask with IGNORE)
    to `crop_size`, a random crop, a flip; test views: the whole image. With `resize`, every image (and its mask,
    nearest) first has its short side resized to it."""

    pairs: Sequence[Pair]
    _: KW_ONLY
    train: bool
    num_classes: int
    crop_size: int
    scale: tuple[float, float] = (0.5, 2.0)
    resize: int = 0
    binarise: int = 0
    table: np.ndarray | None = None
    seed: int = 0
    epoch: int = 0  # set before each epoch: train views are drawn from (seed, epoch, position)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor] | str:
        pair = self.pairs[index]
        try:
            rgb, labels = read_pair(pair, num_classes=self.num_classes, binarise=self.binarise, table=self.table)
        except (OSError, ValueError) as error:  # ImageLoadError and SegmentDataError among them
            print(f"skipping {pair.key}: {error}", file=sys.stderr)
            return pair.key
        image, mask = torch.tensor(rgb).permute(2, 0, 1), torch.tensor(labels)
        if self.resize:
            image, mask = _resized(image, mask, _short_side(*mask.shape, self.resize))
        if self.train:
            image, mask = self._augment(image, mask, np.random.default_rng([self.seed, self.epoch, index]))
        image = TF.normalize(TF.to_dtype(image, torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)
        return image, mask.long()

    def _augment(self, image: Tensor, mask: Tensor, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
        factor = rng.uniform(*self.scale)
        height, width = mask.shape
        image, mask = _resized(image, mask, (max(1, round(height * factor)), max(1, round(width * factor))))
        pad_h, pad_w = max(0, self.crop_size - mask.shape[0]), max(0, self.crop_size - mask.shape[1])
        if pad_h or pad_w:  # the image's padding is black before normalisation, the mask's ignored
            image = F.pad(image, (0, pad_w, 0, pad_h), value=0)
            mask = F.pad(mask, (0, pad_w, 0, pad_h), value=IGNORE)
        top = int(rng.integers(0, mask.shape[0] - self.crop_size + 1))
        left = int(rng.integers(0, mask.shape[1] - self.crop_size + 1))
        image = image[:, top:top + self.crop_size, left:left + self.crop_size]
        mask = mask[top:top + self.crop_size, left:left + self.crop_size]
        if rng.random() < 0.5:
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


def epoch_batches(views: SegmentViews, epoch: int, *, batch_size: int, workers: int) -> DataLoader:
    """The batches of one epoch (`views.epoch_batches`: images, masks, the keys of the unusable pairs); test
    views come one image a batch: their sizes differ."""
    return labelled_batches(views, epoch, batch_size=batch_size if views.train else 1, workers=workers,
                            drop_last=views.train and len(views) >= batch_size)
