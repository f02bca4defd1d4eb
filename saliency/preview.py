"""Contact sheets for eyeballing saliency: image | each method | GT, or, for a masked shard set (from
`saliency build-masks`), image | mask | background removed (grey, as the masked pretraining views)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from relicv2.saliency.batch import is_shard_source, iter_items
from relicv2.saliency.handcrafted.methods import METHODS
from relicv2.saliency.images import list_images, map_path, map_to_uint8, read_gray, write_png
from relicv2.shards import ReadReport, iter_samples
from relicv2.shards.images import ImageLoadError, load_rgb
from relicv2.shards.sample import MASK_FOREGROUND_LEVEL, MASK_MEMBER

HEADER = 22
TILE_HEIGHT = 160
BACKGROUND_GREY = 128

Row = list[tuple[str, np.ndarray]]


@dataclass(frozen=True)
class PreviewConfig:
    """One ``relicv2 saliency preview`` job."""

    input: Path
    output: Path
    methods: tuple[str, ...]
    count: int = 6
    gt: Path | None = None
    maps: Path | None = None  # read maps written by `handcrafted` instead of computing them


def _tile(image: np.ndarray, height: int) -> np.ndarray:
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    width = max(1, round(image.shape[1] * height / image.shape[0]))
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)


def _label(tile: np.ndarray, text: str) -> np.ndarray:
    header = np.full((HEADER, tile.shape[1], 3), 255, np.uint8)
    cv2.putText(header, text, (4, HEADER - 7), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([header, tile], axis=0)


def contact_sheet(rows: list[Row], tile_height: int = TILE_HEIGHT) -> np.ndarray:
    """Stack labelled tiles (title, uint8 image or map) into one RGB sheet, rows left-aligned."""
    built = []
    for row in rows:
        tiles = [_label(_tile(image, tile_height), title) for title, image in row]
        gap = np.full((tile_height + HEADER, 4, 3), 255, np.uint8)
        parts = [p for t in tiles for p in (t, gap)][:-1]
        built.append(np.concatenate(parts, axis=1))
    width = max(r.shape[1] for r in built)
    padded = [np.pad(r, ((0, 4), (0, width - r.shape[1]), (0, 0)), constant_values=255) for r in built]
    return np.concatenate(padded, axis=0)


def is_masked_shard_set(source: Path) -> bool:
    """True for a shard set whose first sample carries a ``mask.png`` member."""
    if not is_shard_source(source):
        return False
    first = next(iter(iter_samples(source, report=ReadReport())), None)  # a look at one sample: losses are the jobs' to count
    return first is not None and MASK_MEMBER in first


def masked_rows(config: PreviewConfig, read: ReadReport) -> Iterator[Row]:
    """Rows of image | soft mask | image with the background (mask < 0.5) replaced by grey."""
    for sample in iter_samples(config.input, report=read):
        try:
            rgb = load_rgb(sample["image"], sample["key"])
            mask = load_rgb(sample[MASK_MEMBER], f"{sample['key']}.{MASK_MEMBER}")[..., 0]
        except (ImageLoadError, KeyError) as error:
            warnings.warn(f"preview skips {sample['key']}: {error}", stacklevel=2)
            continue
        if mask.shape != rgb.shape[:2]:
            warnings.warn(f"preview skips {sample['key']}: mask {mask.shape} and image {rgb.shape[:2]} differ", stacklevel=2)
            continue
        removed = np.where((mask >= MASK_FOREGROUND_LEVEL)[..., None], rgb, np.uint8(BACKGROUND_GREY))
        coverage = sample["meta"].get("mask_coverage")
        title = f"mask {coverage:.0%}" if isinstance(coverage, int | float) else "mask"
        yield [(sample["key"], rgb), (title, mask), ("background removed", removed)]


def map_rows(config: PreviewConfig, read: ReadReport) -> Iterator[Row]:
    """Rows of image | each method's map (computed, or read from ``config.maps``) | GT (with ``config.gt``)."""
    masks = {p.stem: p for p in list_images(config.gt)} if config.gt else {}
    for item in iter_items(config.input, read):
        try:
            rgb = item.rgb()
        except ImageLoadError as error:
            warnings.warn(f"preview skips {error}", stacklevel=2)
            continue
        row = [(item.name, rgb)]
        for method in config.methods:
            stored = map_path(config.maps, method, item.name) if config.maps else None
            computed = stored is None or not stored.exists()
            row.append((method, map_to_uint8(METHODS[method](rgb)) if computed else read_gray(stored)))
        if item.name in masks:
            row.append(("GT", read_gray(masks[item.name])))
        yield row


def build_preview(config: PreviewConfig) -> np.ndarray:
    """The sheet of the first ``count`` inputs and their maps; of a masked shard set, image | mask |
    background removed."""
    masked = is_masked_shard_set(config.input)
    read = ReadReport()
    rows = list(itertools.islice((masked_rows if masked else map_rows)(config, read), config.count))
    if read.rejected or read.lost_shards:  # (not the samples after the first few: a preview stops early)
        warnings.warn(f"preview of {config.input}: {read.summary()}", stacklevel=2)
    if not rows:
        raise ValueError(f"no readable {'masked sample' if masked else 'image'} in {config.input}")
    return contact_sheet(rows)


def write_preview(config: PreviewConfig) -> Path:
    """Build the sheet and write it as a PNG at ``config.output``."""
    write_png(config.output, build_preview(config))
    return Path(config.output)
