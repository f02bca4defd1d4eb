"""The inputs of a saliency job: an image folder or a shard set. Images are named by file stem, shard
samples by key (untrusted: callers turn names into paths only through ``shards.keys``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from relicv2.saliency.images import list_images, read_rgb
from relicv2.shards.images import load_rgb
from relicv2.shards.manifest import MANIFEST_NAME
from relicv2.shards.reader import ReadReport, iter_samples
from relicv2.shards.shardset import BRACE, list_shard_files, resolve_shard_set, shard_tars


@dataclass(frozen=True)
class Item:
    """One input: its output name and either a file path or encoded bytes (shard sample)."""

    name: str
    path: Path | None = None
    data: bytes | None = None

    def rgb(self) -> np.ndarray:
        """The image as uint8 HxWx3 RGB as displayed; shards.images.ImageLoadError names a bad one."""
        # A shard sample always has its image: the shard reader refuses one without (no_image).
        return read_rgb(self.path) if self.path is not None else load_rgb(self.data or b"", self.name)


def is_shard_source(source: Path) -> bool:
    """True for one ``.tar``, a folder of shards (``*-NNNN.tar``, 4-6 digits) without images of its own,
    or a brace pattern of tars (``train-{0000..0099}.tar``)."""
    source = Path(source)
    if source.is_file():
        return source.suffix == ".tar"
    if source.is_dir():
        return not list_images(source) and bool(list_shard_files(source))
    return bool(BRACE.search(str(source)))


def iter_items(source: Path, read: ReadReport) -> Iterator[Item]:
    """Inputs of a folder of images, or of a shard set (keys as names). Shard members and shards the
    reader refuses (unsafe keys, links, truncated tars, bad json) are recorded in ``read``, never yielded."""
    source = Path(source)
    if not is_shard_source(source) and not source.exists():
        raise FileNotFoundError(f"input {source} does not exist; pass an image folder or a shard set")
    if is_shard_source(source):
        for sample in iter_samples(source, report=read):
            yield Item(name=str(sample["key"]), data=sample["image"])
        return
    if not source.is_dir():
        raise ValueError(f"input {source} is neither an image folder nor a shard (.tar) set")
    paths = list_images(source)
    if not paths:
        raise FileNotFoundError(f"no images (jpg/png/...) or shards (*-NNNNNN.tar) in {source}")
    clashes = sorted(stem for stem, n in Counter(p.stem for p in paths).items() if n > 1)
    if clashes:
        raise ValueError(
            f"{source}: several images share a name stem ({', '.join(clashes[:5])}); their maps would"
            " overwrite each other, rename them or split the folder"
        )
    for path in paths:
        yield Item(name=path.stem, path=path)


def count_inputs(source: Path) -> int | None:
    """How many inputs ``source`` holds, when that is known without decoding it: the number of images
    of a folder, or the samples of a shard set (its manifest, or its index files); None when unknown."""
    source = Path(source)
    if not is_shard_source(source):
        return len(list_images(source)) if source.is_dir() else None
    folder = source if source.is_dir() else source.parent
    if not (folder / MANIFEST_NAME).is_file():
        try:  # a plain set: its index files (derived once into the index cache)
            return resolve_shard_set(source).samples
        except (OSError, ValueError):
            return None  # a broken set is the reader's (and `shards verify`'s) to report
    # With a manifest, its count is what the job must read (the reader compares the two).
    try:
        shards = pq.read_table(folder / MANIFEST_NAME, columns=["shard"]).column("shard").to_pylist()
    except (OSError, pa.ArrowException):
        return None  # a broken manifest is `shards verify`'s to report; here it only sizes a bar
    if source.is_dir():
        return len(shards)
    try:  # one tar or a brace pattern of this set's tars
        names = {tar.name for tar in shard_tars(source)[0]}
    except ValueError:
        return None
    return sum(1 for s in shards if s in names)
