"""The training images of `saliency train`: a seeded sample of the shard set and its handcrafted maps.

The sample is written once as a small shard set `OUT/sample/` (prefix `sample`) and its maps by the
handcrafted batch job into `OUT/maps/<method>/<key>.png`; a restarted job reuses both. Images
whose EXIF orientation rotates them are stored re-encoded in the displayed orientation, so that
the maps, the network input and the masks built later all see the image the view pipeline sees.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from relicv2.saliency.batch import HandcraftedConfig, run_handcrafted
from relicv2.saliency.images import map_path, read_gray
from relicv2.saliency.network.images import resize_map, resize_square, sample_locations
from relicv2.saliency.network.mask_shard import output_member
from relicv2.shards import ReadReport, ShardSample, iter_samples, write_shard_set
from relicv2.shards.images import ImageLoadError, exif_orientation, load_rgb
from relicv2.shards.reader import SampleRef

SAMPLE_PREFIX = "sample"


@dataclass
class TrainingImages:
    """The usable sampled images at the network's input size, and their handcrafted maps."""

    keys: list[str]
    images: torch.Tensor  # uint8 [N, 3, S, S]
    maps: dict[str, torch.Tensor]  # method -> float16 [N, S, S] in [0, 1]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, reason)


def _sample_stream(locations: list[SampleRef], skipped: list) -> Iterator[ShardSample]:
    for location in locations:
        data = location.read_image()
        try:
            rgb = load_rgb(data, f"{location.key} in {location.tar.name}")
        except ImageLoadError as error:
            skipped.append((location.key, str(error)))
            print(f"saliency train: skipping {error}", file=sys.stderr)
            continue
        member = output_member(location.image_ext)
        if exif_orientation(data) != 1:  # pixels stored rotated
            buffer = io.BytesIO()
            Image.fromarray(rgb).save(buffer, "JPEG", quality=95)
            data, member = buffer.getvalue(), "jpg"
        meta = {"source_shard": location.tar.name, "width": rgb.shape[1], "height": rgb.shape[0]}
        yield ShardSample(location.key, {member: data}, location.label, meta)


def write_sample_set(shards: Path | str, out: Path, count: int, seed: int, index_cache: Path | None = None,
                     locations: list[SampleRef] | None = None) -> tuple[Path, list]:
    """`OUT/sample/`: the seeded sample of `shards` (kept when it exists: the plan is deterministic).
    `locations`: the sample `sample_locations` already drew, so that the set's indexes are not read twice."""
    folder = Path(out) / "sample"
    skipped: list[tuple[str, str]] = []
    if not (folder / "info.json").is_file():
        if locations is None:
            locations = sample_locations(shards, count, seed, index_cache=index_cache)
        write_shard_set(_sample_stream(locations, skipped), folder, prefix=SAMPLE_PREFIX, max_count=1000)
    return folder, skipped


def handcrafted_maps(images: Path, output: Path, methods: tuple[str, ...], workers: int, progress: bool) -> list:
    """Run (or resume) the handcrafted batch job; returns its failures [(key, reason)]."""
    config = HandcraftedConfig(methods=methods, input=images, output=output, workers=workers, progress=progress)
    return list(run_handcrafted(config).failed)


def load_training_images(
    shards: Path | str, out: Path, *, count: int, seed: int, size: int, methods: tuple[str, ...], workers: int,
    progress: bool = True, index_cache: Path | None = None, locations: list[SampleRef] | None = None,
) -> TrainingImages:
    """Sample, compute maps (cached), and load everything at `size` x `size` into memory."""
    sample_dir, skipped = write_sample_set(shards, out, count, seed, index_cache, locations)
    failed = dict(handcrafted_maps(sample_dir, Path(out) / "maps", methods, workers, progress))
    keys, images, maps = [], [], {m: [] for m in methods}
    read = ReadReport()
    for sample in iter_samples(sample_dir, report=read):
        key = sample["key"]
        if key in failed:
            skipped.append((key, failed[key]))
            continue
        try:
            rgb = load_rgb(sample["image"], key)
            raw = {m: read_gray(map_path(Path(out) / "maps", m, key)) for m in methods}
        except ImageLoadError as error:
            skipped.append((key, str(error)))
            continue
        keys.append(key)
        images.append(torch.from_numpy(resize_square(rgb, size)).permute(2, 0, 1))
        for m in methods:
            maps[m].append(torch.from_numpy(resize_map(raw[m] / 255.0, size, size)).clamp_(0, 1).half())
    skipped += [(name, detail) for _, name, detail in read.rejected] + [(tar, why) for tar, why in read.lost_shards]
    if not keys:
        raise ValueError(f"no usable image in the sample of {shards}; every sampled image failed ({skipped[:3]})")
    return TrainingImages(keys, torch.stack(images), {m: torch.stack(v) for m, v in maps.items()}, skipped)
