"""Labelled train / test views for linear evaluation through DALI (CPU or GPU decoding): the set's usable
samples (`shards.sample_set.load_sample_set`) read by DALI's webdataset reader over their index files.
Train views: random-resized-crop + flip; test views: short side bicubic + centre crop.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.types as types
import torch
from nvidia.dali import pipeline_def
from nvidia.dali.plugin.base_iterator import LastBatchPolicy
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from relicv2.models.normalization import IMAGENET_MEAN, IMAGENET_STD
from relicv2.pretrain.views.config import CROP_RATIO, FULL_CROP_SCALE, resize_of
from relicv2.pretrain.views.dali import find_undecodable
from relicv2.shards.sample import IMAGE_MEMBERS, LABEL_MEMBER, MAX_LABEL_BYTES, class_index
from relicv2.shards.sample_set import SampleSet, load_sample_set

READER = "eval"
# The eval pipeline has no recovery from a decode failure (pretraining's view loader has): every image of
# a set from another tool is decoded once first (sets from `shards build` / `build-masks` were when written).
DECODE = {"decode_check": find_undecodable, "decode_foreign_only": True}


@pipeline_def
def _eval_pipeline(tars, index_files, *, train: bool, crop_size: int, resize_size: int, scale, gpu: bool,
                   rank: int, world: int, reader_seed: int):
    jpeg, cls = fn.readers.webdataset(paths=tars, index_paths=index_files, ext=[";".join(IMAGE_MEMBERS), LABEL_MEMBER], name=READER,
                                      shard_id=rank, num_shards=world, random_shuffle=train, initial_fill=1024,
                                      seed=reader_seed, pad_last_batch=True)
    device = "mixed" if gpu else "cpu"
    if train:
        images = fn.decoders.image_random_crop(jpeg, device=device, output_type=types.RGB,
                                               random_area=list(scale), random_aspect_ratio=list(CROP_RATIO),
                                               num_attempts=10)
        images = fn.resize(images, size=[crop_size, crop_size], antialias=True)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpeg, device=device, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=resize_of(crop_size, resize_size), interp_type=types.INTERP_CUBIC,
                           antialias=True)
        mirror = 0
    images = fn.crop_mirror_normalize(images, crop=(crop_size, crop_size), mirror=mirror, dtype=types.FLOAT,
                                      output_layout="CHW", mean=[m * 255 for m in IMAGENET_MEAN],
                                      std=[s * 255 for s in IMAGENET_STD])
    # Labels stay bytes (class indices in ASCII, checked by `class_count`), space-padded to one length.
    return images, fn.pad(cls, shape=[MAX_LABEL_BYTES], fill_value=32)


def eval_sample_set(source: str | Path) -> SampleSet:
    """The usable samples of a set, each image decoded once when the set is foreign (`DECODE`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # left-out samples are counted and reported by the caller
        return load_sample_set(source, **DECODE)


class DaliViews:
    """Batches of one shard set's views for every epoch; its `sample_set` lists the undecodable samples."""

    def __init__(self, source: str | Path | SampleSet, *, train: bool, crop_size: int, resize_size: int, batch_size: int,
                 scale: tuple[float, float] = FULL_CROP_SCALE, seed: int = 0, rank: int = 0, world: int = 1,
                 threads: int = 2, device: torch.device | None = None) -> None:
        self.sample_set = source if isinstance(source, SampleSet) else eval_sample_set(source)
        gpu = device is not None and device.type == "cuda"
        self.pipe = _eval_pipeline(
            [str(p) for p in self.sample_set.tars], [str(p) for p in self.sample_set.index_files],
            train=train, crop_size=crop_size, resize_size=resize_size, scale=scale, gpu=gpu, rank=rank,
            world=world, reader_seed=seed, batch_size=batch_size, num_threads=max(1, threads),
            device_id=(device.index or 0) if gpu else None, seed=seed * 7919 + rank + 1)
        self.pipe.build()
        self.iterator = DALIGenericIterator(self.pipe, ["images", "cls"], reader_name=READER,
                                            last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def epoch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        """One pass over this rank's share: (images, labels, []) like the PIL loader's batches (undecodable
        images were left out before: no batch holds one)."""
        for batch in self.iterator:
            codes = batch[0]["cls"].cpu().numpy().astype(np.uint8)
            labels = torch.tensor([class_index(bytes(row)) for row in codes])
            yield batch[0]["images"], labels, []
