"""Batch job: handcrafted saliency maps for an image folder or a shard set (its inputs: ``iter_items``).

Writes ``<output>/<method>/<name>.png`` (8-bit, single channel, same size as the image),
where ``<name>`` is the image file's stem or the shard sample's key (untrusted: validated by
``shards.keys``: a key that would name a file outside the output folder is a rejected input).
Restartable: maps that already exist are skipped (each map is written under a temporary name
and renamed), so a killed job resumes with the same command. The job holds the output folder's
lock for its whole life and first removes the temporaries a killed run left. A corrupt input or
a map that cannot be written is reported and skipped; a full or read-only output folder stops
the job with one clear error (finished maps are kept, the rerun goes on from there).
"""

from __future__ import annotations

import contextlib
import errno
import math
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from relicv2.jobs.atomic import remove_stale_temps
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.jobs.workers import one_thread, single_threaded, worker_pool
from relicv2.saliency.handcrafted.methods import METHODS
from relicv2.saliency.images import list_images, map_path, read_rgb, write_map
from relicv2.shards.images import ImageLoadError, load_rgb
from relicv2.shards.keys import UnsafeKeyError
from relicv2.shards.manifest import MANIFEST_NAME
from relicv2.shards.reader import ReadReport, iter_samples
from relicv2.shards.shardset import (
    BRACE,
    list_shard_files,
    listed_shards,
    resolve_shard_set,
    shard_tars,
)

JOB_NAME = "saliency handcrafted"
OUTPUT_FULL = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
"""Write errors after which no further map can be written: the job stops instead of failing every input."""


class OutputWriteError(RuntimeError):
    """The output folder cannot take any more maps (full, read-only, not creatable)."""


@dataclass(frozen=True)
class FailureLimit:
    """``--max-failures``: how many failed inputs (corrupt photos in a web crawl) a job accepts and still
    succeeds, a count or a fraction of the inputs (a job in which every input failed never succeeds)."""

    count: int | None = 0
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> FailureLimit:
        """``"10"`` -> at most 10 failures; ``"0.05"`` or ``"5%"`` -> at most 5% of the inputs."""
        value = str(text).strip()
        if re.fullmatch(r"\d+", value):
            return cls(count=int(value), fraction=None)
        try:
            fraction = float(value[:-1]) / 100.0 if value.endswith("%") else float(value)
        except ValueError:
            fraction = math.nan
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(
                f"--max-failures {text!r}: give a count (e.g. 10), a fraction of the inputs (e.g. 0.05)"
                " or a percentage (e.g. 5%)"
            )
        return cls(count=None, fraction=fraction)

    def allows(self, failed: int, inputs: int) -> bool:
        """True when ``failed`` failures out of ``inputs`` inputs are within the limit."""
        if inputs == 0 or failed >= inputs:
            return False
        if self.count is not None:
            return failed <= self.count
        return failed <= (self.fraction or 0.0) * inputs

    def describe(self) -> str:
        return str(self.count) if self.count is not None else f"{100 * (self.fraction or 0.0):g}%"


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
    if is_shard_source(source):
        for sample in iter_samples(source, report=read):
            yield Item(name=str(sample["key"]), data=sample["image"])
        return
    if not source.exists():
        raise FileNotFoundError(f"input {source} does not exist; pass an image folder or a shard set")
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
    try:
        if not (folder / MANIFEST_NAME).is_file():  # a plain set: its index files (derived once into the index cache)
            return resolve_shard_set(source).samples
        # With a manifest, its count is what the job must read (the reader compares the two).
        listed, _ = listed_shards(folder, allow_lost=True)
        names = None if source.is_dir() else {tar.name for tar in shard_tars(source)[0]}  # one tar or a pattern
        return sum(count for tar, count in listed.items() if names is None or tar.name in names)
    except (OSError, ValueError):
        return None  # a broken set is the reader's (and `shards verify`'s) to report; here it only sizes a bar


@dataclass(frozen=True)
class HandcraftedConfig:
    """One ``relicv2 saliency handcrafted`` job."""

    methods: tuple[str, ...]  # names of METHOD_NAMES (`resolve_methods` checks what a user gives)
    input: Path
    output: Path
    workers: int = 1
    overwrite: bool = False
    progress: bool = True
    max_failures: FailureLimit = FailureLimit()


@dataclass
class BatchReport:
    """What a job did: maps written per method, inputs already complete, inputs that failed."""

    inputs: int = 0
    written: Counter = field(default_factory=Counter)
    already_done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    stale_removed: int = 0
    expected: int | None = None  # inputs the shard set's manifest lists, when it has one
    read: ReadReport = field(default_factory=ReadReport)  # what the shard reader refused or lost

    @property
    def missing(self) -> int:
        """Inputs never read (a truncated or unreadable shard): those the manifest lists beyond the ones read;
        without a manifest, one at least for each shard the reader lost or read in part."""
        return max(0, self.expected - self.inputs) if self.expected is not None else len(self.read.lost_shards)

    def failure(self, limit: FailureLimit) -> str | None:
        """Why the job counts as failed (it did nothing, or lost more inputs than ``limit``
        allows), or None when it succeeded."""
        total, lost = self.inputs + self.missing, len(self.failed) + self.missing  # lost: inputs without maps
        if total == 0:
            return "no inputs were found"
        if lost == 0 or limit.allows(lost, total):
            return None
        if lost >= total:
            return "every input failed"
        return f"{lost} inputs without maps exceed --max-failures {limit.describe()}"

    def summary(self, methods: Iterable[str]) -> str:
        """One line: inputs, maps written per method, complete, failed, never read."""
        written = ", ".join(f"{m} {self.written[m]}" for m in methods)
        unread = "listed in the manifest but not read" if self.expected is not None else "shard(s) read in part or not at all"
        missing = f", {self.missing} {unread}" if self.missing else ""
        return (f"{self.inputs} inputs: maps written ({written}), {self.already_done} already complete, "
                f"{len(self.failed)} failed{missing}")


@dataclass(frozen=True)
class Result:
    """What :func:`process_item` did with one input."""

    name: str
    written: tuple[str, ...] = ()
    error: str | None = None
    output_full: bool = False


_ADDRESS = re.compile(r" object at 0x[0-9a-fA-F]+")  # kept out of failure reasons (<_io.BytesIO object at 0x7f..>)


def process_item(item: Item, methods: tuple[str, ...], output: Path) -> Result:
    """Compute and write the requested maps of one input. Decoding and write errors are this input's
    failure; anything else is a bug and propagates (a method must give a map for every image)."""
    try:
        rgb = item.rgb()
    except ImageLoadError as error:
        return Result(item.name, error=_ADDRESS.sub("", str(error)))
    written: list[str] = []
    for method in methods:
        saliency = METHODS[method](rgb)
        path = map_path(output, method, item.name)
        try:
            write_map(path, saliency)
        except OSError as error:
            reason = f"cannot write {path}: {error.strerror or error}"
            return Result(item.name, tuple(written), reason, output_full=error.errno in OUTPUT_FULL)
        written.append(method)
    return Result(item.name, tuple(written))


def _work(config: HandcraftedConfig, report: BatchReport, bar: Phase) -> Iterator[tuple[Item, tuple[str, ...]]]:
    """The inputs that still need maps; counts the others (complete, or with a bad key) on the way."""
    for item in iter_items(config.input, report.read):
        report.inputs += 1
        try:
            paths = {m: map_path(config.output, m, item.name) for m in config.methods}
        except UnsafeKeyError as error:
            report.failed.append((repr(item.name), f"rejected key: {error}"))
            bar.write(f"skipped {item.name!r}: rejected key: {error}", file=sys.stderr)
            bar.update(1)
            continue
        # The methods whose map of the item is still to be written.
        methods = tuple(m for m, path in paths.items() if config.overwrite or not path.exists())
        if methods:
            yield item, methods
        else:
            report.already_done += 1
            bar.update(1)


def _compute_serial(config: HandcraftedConfig, work: Iterator) -> Iterator[Result]:
    with single_threaded():  # --workers 1 means one core
        for item, methods in work:
            yield process_item(item, methods, config.output)


def _compute_pooled(config: HandcraftedConfig, work: Iterator) -> Iterator[Result]:
    # spawn, not fork: forking a process whose BLAS/OpenCV thread pools are running can
    # leave the children deadlocked on a lock held by a thread that no longer exists.
    # Stopped early (full disk, Ctrl-C), the pool drops the queued inputs as it exits (jobs.workers).
    in_flight: set[Future] = set()
    with worker_pool(config.workers, start_method="spawn", initializer=one_thread) as pool:
        for item, methods in work:
            in_flight.add(pool.submit(process_item, item, methods, config.output))
            # Bounded submission: a shard set can be far larger than memory.
            if len(in_flight) >= 4 * config.workers:
                done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
        for future in in_flight:
            yield future.result()


def run_handcrafted(config: HandcraftedConfig) -> BatchReport:
    """Run the job (see the module docstring). FileNotFoundError/ValueError for a bad input,
    ``jobs.lock.FolderLockedError`` when another job holds the output folder, :class:`OutputWriteError`
    when the output folder can take no more maps."""
    source = Path(config.input)
    if not is_shard_source(source) and not source.exists():
        raise FileNotFoundError(f"input {source} does not exist; pass an image folder or a shard set")
    total = count_inputs(source)
    report = BatchReport(expected=total if is_shard_source(source) else None)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(config.output, JOB_NAME))
        except OSError as error:
            raise OutputWriteError(
                f"cannot use the output folder {config.output}: {error.strerror or error};"
                " choose another --output"
            ) from error
        # Under the lock no other writer is at work there. ".png.tmp": the temporaries of the map writer
        # before jobs.atomic (`.<stem>.<random>.png.tmp`).
        report.stale_removed = sum(remove_stale_temps(config.output / method, lambda final: final.endswith(".png"),
                                                      recursive=True, older_suffix=".png.tmp")
                                   for method in config.methods)
        bar = stack.enter_context(Phase("saliency maps", total, unit="img", enabled=config.progress))
        compute = _compute_serial if config.workers <= 1 else _compute_pooled
        for result in compute(config, _work(config, report, bar)):
            report.written.update(result.written)
            if result.error is not None:
                report.failed.append((result.name, result.error))
                bar.write(f"skipped {result.name}: {result.error}", file=sys.stderr)
            if result.output_full:
                raise OutputWriteError(
                    f"{result.error}; the output folder is full or read-only: free space (or choose"
                    " another --output) and rerun the same command, finished maps are kept"
                )
            bar.update(1)
        _count_refused_by_reader(report, bar)
    return report


def _count_refused_by_reader(report: BatchReport, bar: Phase) -> None:
    """Samples and shards the shard reader left out are failed inputs, named with their reason."""
    report.inputs += len(report.read.rejected)
    for tar, what, reason in report.read.rejected:
        why = f"refused by the shard reader in {Path(tar).name}: {reason}"
        report.failed.append((repr(what), why))
        bar.write(f"skipped {what!r}: {why}", file=sys.stderr)
    for tar, reason in report.read.lost_shards:
        bar.write(f"lost data in {tar}: {reason}", file=sys.stderr)
    if report.read.unused:  # not a loss: said, so that nothing in the input goes unseen
        bar.write(f"members no job reads, left as they are: {dict(report.read.unused)}", file=sys.stderr)
