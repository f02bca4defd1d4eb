"""A corrupted copy of a labelled shard set, as ImageNet-C was made from ImageNet's val set: each sample's
evaluation view (resize and centre crop, before normalisation) corrupted by one corruption at one severity
(`corruptions.corrupt_image`, seeded per image) and stored as a JPEG (ImageNet-C's quality, 85).

A shard job of the engine (`shards.driver`): one output tar per input tar, resumable per tar, counted on a
progress bar, its images corrupted in `workers` processes and written in input order, so the set is the same
bytes whatever the worker count. The set's info.json carries the source's class names.
"""

from __future__ import annotations

import contextlib
import io
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from relicv2.evaluation.corruptions import CorruptionError, check_corruption, corrupt_image
from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks
from relicv2.jobs.workers import worker_pool
from relicv2.pretrain.knn.classes import class_names
from relicv2.pretrain.knn.view import test_view_image
from relicv2.shards.driver import JobReport, TarUnits, UnitOutput, run_shard_job
from relicv2.shards.images import ImageLoadError, Rejection
from relicv2.shards.job import (
    MergeReport,
    ShardJob,
    check_plan,
    merge_records,
    tar_job,
)
from relicv2.shards.reader import ReadReport, read_samples
from relicv2.shards.sample import ShardSample
from relicv2.shards.shardset import ShardSet
from relicv2.shards.sources import reject
from relicv2.shards.writer import SampleRecord, TarShard, sample_record, shard_name

PREFIX = "corrupted"
STATE_DIR = ".corrupt"
CHUNK = 16  # images per worker task


@dataclass(frozen=True)
class CorruptionSpec:
    """What one corrupted set is made of: everything that changes its bytes."""

    corruption: str
    severity: int
    seed: int
    crop_size: int
    resize_size: int  # the short side before the centre crop (resolved)
    quality: int = 85

    def __post_init__(self) -> None:
        check_corruption(self.corruption, self.severity)


def corrupt_chunk(spec: CorruptionSpec, items: list[tuple[str, bytes, int | None, str | None]]
                  ) -> list[SampleRecord | Rejection]:
    """Worker task: (key, image bytes, label, class name) -> the corrupted sample's tar blocks, or why not."""
    out: list[SampleRecord | Rejection] = []
    for key, data, label, class_name in items:
        try:
            view = test_view_image(data, crop_size=spec.crop_size, resize_size=spec.resize_size, name=key)
            rgb = corrupt_image(np.asarray(view), spec.corruption, spec.severity, seed=spec.seed, key=key)
        except ImageLoadError as error:
            out.append(Rejection(error.reason, str(error)))
            continue
        except CorruptionError as error:
            out.append(Rejection("not_corruptible", str(error)))
            continue
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format="JPEG", quality=spec.quality)
        meta = {"corruption": spec.corruption, "severity": spec.severity, "width": spec.crop_size,
                "height": spec.crop_size, **({"class_name": class_name} if class_name else {})}
        out.append(sample_record(ShardSample(key, {"jpg": buffer.getvalue()}, label, meta)))
    return out


def corruption_pool(workers: int) -> contextlib.AbstractContextManager[Executor | None]:
    """`workers` processes to corrupt images in (None: this process, for 1). Spawned, not forked: the job's
    process runs torch's thread pools (and maybe CUDA), which a fork can hang."""
    if workers <= 1:
        return contextlib.nullcontext()
    return worker_pool(workers, start_method="spawn", initializer=one_opencv_thread)


def one_opencv_thread() -> None:
    """Worker set-up: OpenCV (some corruptions use it) on one thread, as the workers are the parallelism."""
    cv2.setNumThreads(1)


def _in_order(spec: CorruptionSpec, chunks: list[list], pool: Executor | None, workers: int) -> Iterator[list]:
    """Each chunk's results in order: in `pool` with a bounded window of chunks in flight, else here."""
    if pool is None:
        yield from (corrupt_chunk(spec, chunk) for chunk in chunks)
        return
    window: deque = deque()
    for chunk in chunks:
        window.append(pool.submit(corrupt_chunk, spec, chunk))
        if len(window) >= 4 * workers:
            yield window.popleft().result()
    while window:
        yield window.popleft().result()


@dataclass
class CorruptWork(TarUnits):
    """The corrupted set's part of the shard-job engine (`shards.driver.UnitWork`): a unit is one input tar."""

    spec: CorruptionSpec
    source: ShardSet
    out: Path
    plan: dict
    workers: int
    pool: Executor | None = None  # the caller's (one for many sets: a spawned worker starts in seconds)

    def run(self, numbers: list[int], bar: Phase) -> Iterator[UnitOutput]:
        with contextlib.nullcontext(self.pool) if self.pool is not None else corruption_pool(self.workers) as pool:
            for number in numbers:
                yield self._unit(number, bar, pool)

    def _unit(self, number: int, bar: Phase, pool: Executor | None) -> UnitOutput:
        tar, report, rejected = self.source.tars[number], ReadReport(), []
        samples = [(s.key, s.members[s.image_ext], s.label, s.meta.get("class_name") if isinstance(s.meta, dict)
                    else None) for s in read_samples(tar, report, index=self.source.index_files[number])]
        rejected += [*report.rows(), *(reject(f"{tar.name}:(rest of the tar)", "truncated", why)
                                       for _, why in report.lost_shards)]
        bar.update(len(report.rejected))
        shard = TarShard(self.out / shard_name(PREFIX, number))
        try:
            chunks = [samples[i : i + CHUNK] for i in range(0, len(samples), CHUNK)]
            for chunk, results in zip(chunks, _in_order(self.spec, chunks, pool, self.workers), strict=True):
                for (key, *_), result in zip(chunk, results, strict=True):
                    if isinstance(result, Rejection):
                        rejected.append(reject(f"{tar.name}:{key}", result.reason, result.detail))
                    else:
                        shard.add_record(result)
                    bar.update(1)
        except BaseException:
            shard.abort()
            raise
        if not shard.rows:
            shard.abort()
            return UnitOutput(None, rejected)
        shard.close()
        return UnitOutput(shard, rejected)

    def merge(self, job: ShardJob, records: list[dict]) -> MergeReport:
        return merge_records(job.out, records, info={
            "prefix": PREFIX, "source": str(self.source), "classes": class_names(self.source) or [],
            **asdict(self.spec)})


def corrupt_shard_set(source: ShardSet, out: Path, spec: CorruptionSpec, *, workers: int = 1,
                      progress: bool = True, pool: Executor | None = None) -> JobReport:
    """Write (or resume) the corrupted copy of `source` into `out`, in `pool` when given (`corruption_pool`),
    else in `workers` processes of its own. A folder holding another corrupted set is refused (PlanError)."""
    out = Path(out)
    plan = {**asdict(spec), "input_shards": [t.name for t in source.tars], "prefix": PREFIX}
    job = tar_job(out, STATE_DIR, source.tars, PREFIX, asdict(spec))
    check_plan(job, plan, other="a corrupted set made from another set or with other settings")
    name = f"corrupt {spec.corruption} {spec.severity}"
    return run_shard_job(job, CorruptWork(spec, source, out, plan, workers, pool), Ranks(), name=name, progress=progress)
