"""`relicv2 shards build`: input images -> shuffled, decode-verified, resumable WebDataset shards.

Everything is planned up front (shards.plan); each planned shard is a unit of the shard-job engine
(shards.driver), its images decode-verified (converted when needed) in a process pool and written in plan
order. A rerun skips finished shards and redoes the rest, giving the same bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks
from relicv2.jobs.version import package_version
from relicv2.jobs.workers import worker_pool
from relicv2.shards.driver import JobReport, UnitOutput, run_shard_job
from relicv2.shards.images import PreparedImage, Rejection, prepare_file
from relicv2.shards.job import INPUT_CHECKS, MergeReport, ShardJob, input_files_identity
from relicv2.shards.limits import DEFAULT_MAX_PIXELS, ImageLimits
from relicv2.shards.manifest import REJECTED_NAME, rejected_table, write_table
from relicv2.shards.merge import (
    PLAN_REJECTED,
    build_job,
    merge_build,
    rejected_listing_command,
    unfinished_hint,
)
from relicv2.shards.outdir import claim_out_dir
from relicv2.shards.plan import ShardPlan, plan_digest, plan_shards
from relicv2.shards.sample import ShardSample
from relicv2.shards.shardset import ShardSet, list_shard_files, resolve_shard_set
from relicv2.shards.sources import InputError, Listing, SourceImage, list_inputs
from relicv2.shards.writer import SampleRecord, TarShard, sample_record

CHUNK = 16  # images per worker task: amortises inter-process overhead, keeps order cheap


@dataclass(frozen=True)
class BuildConfig:
    """Settings of one shard build (the CLI options of `relicv2 shards build`)."""

    input: Path
    out_dir: Path
    prefix: str = "images"
    seed: int = 0
    max_bytes: int = 1 << 30
    max_count: int | None = None
    min_side: int = 32
    quality: int = 95
    layout: str = "auto"
    workers: int = 1
    overwrite: bool = False
    progress: bool = True
    merge_timeout_s: float = 3600.0
    max_pixels: int = DEFAULT_MAX_PIXELS
    input_check: str = "time"  # how a rerun tells an edited input (shards.job.input_files_identity)
    rehash_shards: bool = False  # a rerun hashes the finished tars, rebuilding those that changed (bit rot)
    command: str = ""


def settings_of(config: BuildConfig) -> dict:
    """The settings that shape the output bytes (part of every shard digest)."""
    names = ("prefix", "seed", "max_bytes", "max_count", "min_side", "quality")
    settings = {name: getattr(config, name) for name in names}
    # Only when changed: the digests (and resumability) of builds planned before the option existed stay.
    if config.max_pixels != DEFAULT_MAX_PIXELS:
        settings["max_pixels"] = config.max_pixels
    return settings


def check_config(config: BuildConfig) -> None:
    """Raise InputError for settings that cannot work, and for an output that is not a folder (or not yet
    one) or is the input itself."""
    if config.max_bytes <= 0 or (config.max_count is not None and config.max_count <= 0):
        raise InputError("--max-bytes and --max-count must be positive")
    if not 1 <= config.quality <= 100:
        raise InputError(f"--quality {config.quality} must be within 1..100")
    for option, value in (("--workers", config.workers), ("--max-pixels", config.max_pixels),
                          ("--min-side", config.min_side)):
        if value < 1:
            raise InputError(f"{option} {value} must be at least 1")
    if config.input_check not in INPUT_CHECKS:
        raise InputError(f"--input-check {config.input_check!r} must be one of {', '.join(INPUT_CHECKS)}")
    if not config.prefix or "." in config.prefix or "/" in config.prefix:
        raise InputError(f"--prefix {config.prefix!r} must be a plain name without dots or slashes")
    out = config.out_dir
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is an existing file, not a folder; choose a folder path")
    if config.input.is_dir() and out.resolve() == config.input.resolve():
        raise InputError(f"--out {out} is the input folder itself; choose another folder")


def plan_record(config: BuildConfig, listing: Listing, shards: list[ShardPlan]) -> dict:
    """plan.json: identical on every rank; what merge needs besides the done-markers."""
    return {
        "digest": plan_digest(shards),
        "shards": [{"name": s.name, "digest": s.digest, "images": len(s.images)} for s in shards],
        "settings": settings_of(config),
        "classes": listing.classes,
        "layout": listing.layout,
        "inputs": len(listing.images) + len(listing.rejected),
        "command": config.command,
        "out": str(config.out_dir),  # as the command names it
        "version": package_version(),
    }


def prepared_stream(images: list[SourceImage], config: BuildConfig) -> Iterator[SampleRecord | Rejection]:
    """Decode-verify and serialise the images in order, in `config.workers` processes (inline for 1)."""
    limits = ImageLimits(max_pixels=config.max_pixels)
    prepare = functools.partial(prepare_many, min_side=config.min_side, quality=config.quality, limits=limits)
    chunks = (tuple(images[i : i + CHUNK]) for i in range(0, len(images), CHUNK))
    if config.workers <= 1:
        yield from itertools.chain.from_iterable(map(prepare, chunks))
        return
    # PIL registers its format plugins on first use; doing it once here means forked workers inherit
    # them instead of each paying the import (~0.1 s) on its first image.
    Image.init()
    with worker_pool(config.workers) as pool:
        # A bounded window of chunks in flight keeps memory flat when writing lags behind decoding.
        window: deque[cf.Future] = deque()
        for chunk in chunks:
            window.append(pool.submit(prepare, chunk))
            if len(window) >= 4 * config.workers:
                yield from window.popleft().result()
        while window:
            yield from window.popleft().result()


def prepare_many(
    images: tuple[SourceImage, ...], *, min_side: int, quality: int, limits: ImageLimits
) -> list[SampleRecord | Rejection]:
    """Worker task: decode-verify a chunk of files and serialise each as tar blocks."""
    prepared = [(image, prepare_file(image.path, min_side=min_side, quality=quality, limits=limits)) for image in images]
    return [p if isinstance(p, Rejection) else sample_record(sample_of(image, p)) for image, p in prepared]


def sample_of(image: SourceImage, prepared: PreparedImage) -> ShardSample:
    """The shard sample of a prepared input, with its json metadata."""
    meta = {
        "source": image.source,
        "width": prepared.width,
        "height": prepared.height,
        "status": "converted" if prepared.converted else "passthrough",
        "source_format": prepared.source_format,
    }
    if prepared.orientation != 1:
        meta["exif_orientation"] = prepared.orientation  # applied: the stored image is upright
    if image.class_name is not None:
        meta["class_name"] = image.class_name
    return ShardSample(image.key, {"jpg": prepared.jpg}, image.label, meta)


def write_shard(path: Path, shard: ShardPlan, results: Iterator[SampleRecord | Rejection], bar: Phase) -> UnitOutput:
    """Write one shard from its images' results (counted on `bar`): its closed tar (None when every
    image was rejected) and its rejections."""
    tar: TarShard | None = None
    rejected = []
    try:
        for image in shard.images:
            result = next(results)
            bar.update(1)
            if isinstance(result, Rejection):
                rejected.append({"source": image.source, "reason": result.reason, "detail": result.detail})
                continue
            if tar is None:  # opened lazily: a shard whose every input is rejected gets no file
                tar = TarShard(path)
            tar.add_record(result)
    except BaseException:
        if tar is not None:
            tar.abort()
        raise
    if tar is not None:
        tar.close()
    return UnitOutput(tar, rejected)


@dataclass(frozen=True)
class BuildWork:
    """`shards build`'s part of the shard-job engine (`shards.driver.UnitWork`): a unit is a planned shard."""

    config: BuildConfig
    listing: Listing
    shards: list[ShardPlan]
    plan: dict  # plan_record's

    def claim(self, job: ShardJob, ranks: Ranks) -> None:
        removed = claim_out_dir(job.out, self.plan, overwrite=self.config.overwrite, multi_rank=ranks.world_size > 1)
        if removed:
            shown = ", ".join(removed[:4]) + (f" and {len(removed) - 4} more" if len(removed) > 4 else "")
            print(f"--overwrite: removed {len(removed)} file(s) of the previous build in {job.out} ({shown}) "
                  "and its work folder", file=sys.stderr)
        if ranks.rank == 0:
            write_table(rejected_table(self.listing.rejected), job.work / PLAN_REJECTED)

    def inputs(self, number: int) -> dict:
        # The shard's digest covers its images' sources, keys, labels and sizes, and the settings.
        return input_files_identity([(im.path, im.mtime_ns) for im in self.shards[number].images],
                                    self.config.input_check)

    def items(self, number: int) -> int:
        return len(self.shards[number].images)

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        shards = [self.shards[n] for n in numbers]
        results = prepared_stream([im for s in shards for im in s.images], self.config)
        try:
            for shard in shards:
                yield write_shard(self.config.out_dir / shard.name, shard, results, bar)
        finally:
            results.close()  # shuts the worker pool down now, not at garbage collection

    def merge(self, job: ShardJob, records: list[dict]) -> MergeReport:
        return merge_build(job.out, self.plan, records)


def build_shards(config: BuildConfig, ranks: Ranks = Ranks()) -> JobReport:
    """Build this rank's shards of the planned set, resuming finished ones; rank 0 holds the output folder's
    lock for the whole job (the other ranks write into it), then merges. Raises InputError for bad settings
    or inputs, OutputError when the output cannot be written."""
    check_config(config)
    out = config.out_dir
    with Phase("shards build: listing inputs", None, unit="file", enabled=config.progress) as phase:
        listing = list_inputs(config.input, config.layout, exclude=out)
        phase.update(len(listing.images) + len(listing.rejected))
    shards = plan_shards(listing.images, settings_of(config))
    work = BuildWork(config, listing, shards, plan_record(config, listing, shards))
    job = build_job(out, [(s.name, s.digest) for s in shards], work.plan)
    report = run_shard_job(job, work, ranks, name="shards build", progress=config.progress,
                           merge_timeout_s=config.merge_timeout_s, rerun=unfinished_hint(out),
                           rehash=config.rehash_shards)
    if report.merge is not None and report.merge.written == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in report.merge.rejected_by_reason.items())
        raise InputError(
            f"none of the {report.merge.rejected} input file(s) could be written ({reasons}); each file and "
            f"why is in {out / REJECTED_NAME}; list them with: {rejected_listing_command(out / REJECTED_NAME)}"
        )
    return report


def shards_of(folder: Path, out: Path, command: str) -> ShardSet:
    """A shard set as it is, or a folder of images (class sub-folders give labels) built into shards in
    `out` by `command` (a rerun resumes the build)."""
    if not folder.is_dir() or list_shard_files(folder):
        return resolve_shard_set(folder)
    print(f"building {folder} into shards in {out}", file=sys.stderr)
    build_shards(BuildConfig(input=folder, out_dir=out, command=command))
    return resolve_shard_set(out)
