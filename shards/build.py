"""`relicv2 shards build`: input images -> shuffled, decode-verified, resumable WebDataset shards.

The job plans everything up front (shards.plan), then builds each unfinished shard of this rank:
images are decode-verified (and converted when needed) in a process pool, written in plan order
into the shard's tar, and a done-marker named after the shard's digest is written last. Killing the
job at any point and rerunning the same command skips finished shards and redoes the rest, giving
the same bytes. Rank 0 then merges the per-shard records into manifest.parquet, rejected.parquet
and info.json (shards.merge).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import multiprocessing
import shutil
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from shards.atomic import atomic_write_bytes, remove_stale_temps
from shards.images import PreparedImage, Rejection, prepare_file
from shards.index import index_path
from shards.manifest import MANIFEST_NAME, REJECTED_NAME, rejected_table, write_table
from shards.merge import (
    MergeReport,
    done_marker,
    merge_shard_set,
    plan_file,
    work_dir,
)
from shards.plan import ShardPlan, plan_digest, plan_shards, rank_shards
from shards.ranks import Ranks, ranks_from_env  # noqa: F401 (re-exported for callers of shards.build)
from shards.sample import ShardSample
from shards.sources import InputError, Listing, SourceImage, list_inputs
from shards.version import package_version
from shards.writer import SampleRecord, TarShard, sample_record

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
    command: str = ""


@dataclass(frozen=True)
class BuildReport:
    """What one rank did, and the merged totals when this rank merged."""

    shards_planned: int
    shards_built: int
    shards_kept: int
    written: int
    rejected: int
    merge: MergeReport | None


def settings_of(config: BuildConfig) -> dict:
    """The settings that shape the output bytes (part of every shard digest)."""
    return {
        "prefix": config.prefix,
        "seed": config.seed,
        "max_bytes": config.max_bytes,
        "max_count": config.max_count,
        "min_side": config.min_side,
        "quality": config.quality,
    }


def check_config(config: BuildConfig) -> None:
    """Raise InputError for settings that cannot work."""
    if config.max_bytes <= 0 or (config.max_count is not None and config.max_count <= 0):
        raise InputError("--max-bytes and --max-count must be positive")
    if not 1 <= config.quality <= 100:
        raise InputError(f"--quality {config.quality} must be within 1..100")
    if config.min_side < 1:
        raise InputError(f"--min-side {config.min_side} must be at least 1")
    if not config.prefix or "." in config.prefix or "/" in config.prefix:
        raise InputError(f"--prefix {config.prefix!r} must be a plain name without dots or slashes")


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
        "version": package_version(),
    }


def claim_out_dir(config: BuildConfig, record: dict, ranks: Ranks) -> None:
    """Make sure out_dir holds nothing but this build (or an unfinished run of it)."""
    out, plan = config.out_dir, plan_file(config.out_dir)
    previous = json.loads(plan.read_text()) if plan.is_file() else None
    foreign = previous is not None and previous["digest"] != record["digest"]
    unknown = previous is None and out.is_dir() and any(
        (out / n).exists() for n in (MANIFEST_NAME, REJECTED_NAME, "info.json")
    )
    if (foreign or unknown) and not config.overwrite:
        what = "a build of other inputs or settings" if foreign else "a shard set this command did not plan"
        raise InputError(f"{out} already holds {what}; choose a new --out folder or pass --overwrite")
    if (foreign or unknown) and config.overwrite:
        if ranks.world_size > 1:
            raise InputError(f"--overwrite is not supported under torchrun; empty {out} before the build")
        shutil.rmtree(work_dir(out), ignore_errors=True)
        for p in out.iterdir():
            if p.name in (MANIFEST_NAME, REJECTED_NAME, "info.json") or p.suffix in (".tar", ".idx"):
                p.unlink()
    work_dir(out).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(plan, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())


def shard_is_done(out: Path, shard: ShardPlan) -> bool:
    """A shard is finished when its done-marker (named after its digest) exists and so do its files
    (an all-rejected shard has a marker and no files)."""
    marker = done_marker(out, shard)
    if not marker.is_file():
        return False
    empty = json.loads(marker.read_text())["empty"]
    tar = out / shard.name
    return empty or (tar.is_file() and index_path(tar).is_file())


def prepared_stream(images: list[SourceImage], config: BuildConfig) -> Iterator[SampleRecord | Rejection]:
    """Decode-verify and serialise the images in order, in `config.workers` processes (inline for 1)."""
    prepare = functools.partial(prepare_many, min_side=config.min_side, quality=config.quality)
    chunks = (tuple(images[i : i + CHUNK]) for i in range(0, len(images), CHUNK))
    if config.workers <= 1:
        for chunk in chunks:
            yield from prepare(chunk)
        return
    # PIL registers its format plugins on first use; doing it once here means forked workers inherit
    # them instead of each paying the import (~0.1 s) on its first image.
    Image.init()
    # fork: workers start in milliseconds and do not re-import the CLI (and torch) as spawn would.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with cf.ProcessPoolExecutor(config.workers, mp_context=multiprocessing.get_context(method)) as pool:
        # A bounded window of chunks in flight keeps memory flat when writing lags behind decoding.
        window: deque[cf.Future] = deque()
        for chunk in chunks:
            window.append(pool.submit(prepare, chunk))
            if len(window) >= 4 * config.workers:
                yield from window.popleft().result()
        while window:
            yield from window.popleft().result()


def prepare_many(images: tuple[SourceImage, ...], *, min_side: int, quality: int) -> list[SampleRecord | Rejection]:
    """Worker task: decode-verify a chunk of files and serialise each as tar blocks."""
    results: list[SampleRecord | Rejection] = []
    for image in images:
        prepared = prepare_file(image.path, min_side=min_side, quality=quality)
        results.append(prepared if isinstance(prepared, Rejection) else sample_record(sample_of(image, prepared)))
    return results


def sample_of(image: SourceImage, prepared: PreparedImage) -> ShardSample:
    """The shard sample of a prepared input, with its json metadata."""
    meta = {
        "source": image.source,
        "width": prepared.width,
        "height": prepared.height,
        "status": "converted" if prepared.converted else "passthrough",
        "source_format": prepared.source_format,
    }
    if image.class_name is not None:
        meta["class_name"] = image.class_name
    return ShardSample(image.key, {"jpg": prepared.jpg}, image.label, meta)


def build_one(out: Path, shard: ShardPlan, results: Iterator[SampleRecord | Rejection]) -> tuple[int, int]:
    """Write one shard from its images' results, then its done-marker; return (written, rejected)."""
    tar: TarShard | None = None
    rejected = []
    try:
        for image in shard.images:
            result = next(results)
            if isinstance(result, Rejection):
                rejected.append({"source": image.source, "reason": result.reason, "detail": result.detail})
                continue
            if tar is None:  # opened lazily: a shard whose every input is rejected gets no file
                tar = TarShard(out / shard.name)
            tar.add_record(result)
    except BaseException:
        if tar is not None:
            tar.abort()
        raise
    rows = tar.close() if tar is not None else []
    marker = {"shard": shard.name, "digest": shard.digest, "empty": not rows, "manifest": rows, "rejected": rejected}
    atomic_write_bytes(done_marker(out, shard), json.dumps(marker, sort_keys=True).encode())
    return len(rows), len(rejected)


def build_shards(config: BuildConfig, ranks: Ranks = Ranks()) -> BuildReport:
    """Build this rank's shards of the planned set, resuming finished ones; rank 0 then merges."""
    check_config(config)
    listing = list_inputs(config.input, config.layout)
    shards = plan_shards(
        listing.images,
        seed=config.seed,
        prefix=config.prefix,
        max_bytes=config.max_bytes,
        max_count=config.max_count,
        settings=settings_of(config),
    )
    config.out_dir.mkdir(parents=True, exist_ok=True)
    claim_out_dir(config, plan_record(config, listing, shards), ranks)
    if ranks.rank == 0:
        write_table(rejected_table(listing.rejected), work_dir(config.out_dir) / "plan-rejected.parquet")
    mine = [shards[n] for n in rank_shards(len(shards), ranks.rank, ranks.world_size)]
    pending = [s for s in mine if not shard_is_done(config.out_dir, s)]
    names = {s.name for s in pending} | {index_path(Path(s.name)).name for s in pending}
    remove_stale_temps(config.out_dir, names)
    images = [im for s in pending for im in s.images]
    written = rejected = 0
    with tqdm(
        total=len(images),
        unit="img",
        desc=f"rank {ranks.rank}/{ranks.world_size}" if ranks.world_size > 1 else "shards",
        disable=not config.progress,
        smoothing=0.1,
    ) as bar:
        results = prepared_stream(images, config)
        try:
            counted = counting(results, bar)
            for shard in pending:
                w, r = build_one(config.out_dir, shard, counted)
                written, rejected = written + w, rejected + r
        finally:
            results.close()  # shuts the worker pool down now, not at garbage collection
    merge = None
    if ranks.rank == 0:
        merge = merge_shard_set(config.out_dir, wait_s=config.merge_timeout_s if ranks.world_size > 1 else 0)
        if merge.written == 0:
            raise InputError(
                f"none of the {merge.rejected} input file(s) could be written; "
                f"see {config.out_dir / REJECTED_NAME} for the reasons"
            )
    return BuildReport(len(shards), len(pending), len(mine) - len(pending), written, rejected, merge)


def counting(results: Iterator, bar: tqdm) -> Iterator:
    """Pass results through, advancing the progress bar."""
    for item in results:
        bar.update(1)
        yield item

