"""Batch job: handcrafted saliency maps for an image folder or a shard set.

Writes ``<output>/<method>/<name>.png`` (8-bit, single channel, same size as the image),
where ``<name>`` is the image file's stem or the shard sample's key. Restartable: maps that
already exist are skipped (each map is written under a temporary name and renamed), so a
killed job resumes with the same command. A corrupt input is reported and skipped.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from saliency.handcrafted.methods import METHODS
from saliency.images import ImageReadError, decode_rgb, list_images, read_rgb, write_map


@dataclass(frozen=True)
class HandcraftedConfig:
    """One ``relicv2 saliency handcrafted`` job."""

    methods: tuple[str, ...]
    input: Path
    output: Path
    workers: int = 1
    overwrite: bool = False
    progress: bool = True


@dataclass(frozen=True)
class Item:
    """One input: its output name and either a file path or encoded bytes (shard sample)."""

    name: str
    path: Path | None = None
    data: bytes | None = None


@dataclass
class BatchReport:
    """What a job did: maps written per method, inputs already complete, inputs that failed."""

    inputs: int = 0
    written: Counter = field(default_factory=Counter)
    already_done: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)


def _is_shard_source(source: Path) -> bool:
    if source.is_file():
        return source.suffix == ".tar"
    return source.is_dir() and not list_images(source) and any(source.glob("*-[0-9]*.tar"))


def iter_items(source: Path) -> Iterator[Item]:
    """Inputs of a folder of images, or of a shard folder / single ``.tar`` (keys as names)."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"input {source} does not exist; pass an image folder or a shard set")
    if _is_shard_source(source):
        from shards import iter_samples

        for sample in iter_samples(source):
            yield Item(name=str(sample["key"]), data=sample["jpg"])
        return
    if not source.is_dir():
        raise ValueError(f"input {source} is neither an image folder nor a shard (.tar) set")
    paths = list_images(source)
    if not paths:
        raise FileNotFoundError(f"no images (jpg/png/...) or shards (*-NNNNNN.tar) in {source}")
    stems = Counter(p.stem for p in paths)
    clashes = sorted(s for s, n in stems.items() if n > 1)
    if clashes:
        raise ValueError(
            f"{source}: several images share a name stem ({', '.join(clashes[:5])}); their maps would"
            " overwrite each other, rename them or split the folder"
        )
    for path in paths:
        yield Item(name=path.stem, path=path)


def map_path(output: Path, method: str, name: str) -> Path:
    """Where the map of input ``name`` by ``method`` is written."""
    return Path(output) / method / f"{name}.png"


def process_item(item: Item, methods: tuple[str, ...], output: Path) -> tuple[str, list[str], str | None]:
    """Compute and write the requested maps of one input; returns (name, written, error)."""
    try:
        rgb = read_rgb(item.path) if item.path is not None else decode_rgb(item.data or b"", item.name)
    except ImageReadError as error:
        return item.name, [], str(error)
    written = []
    for method in methods:
        try:
            saliency = METHODS[method](rgb)
        except Exception as error:  # a method bug must not end a long job: report and go on
            return item.name, written, f"{item.name}: {method} failed ({type(error).__name__}: {error})"
        write_map(map_path(output, method, item.name), saliency)
        written.append(method)
    return item.name, written, None


def _init_worker() -> None:
    # One worker = one core: keep BLAS/OpenCV from spawning threads that fight each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import cv2
        from threadpoolctl import threadpool_limits

        cv2.setNumThreads(1)
        threadpool_limits(1)
    except ImportError:
        pass


def run_handcrafted(config: HandcraftedConfig) -> BatchReport:
    """Run the job described by ``config``; see the module docstring."""
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown or not config.methods:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    report = BatchReport()
    source = Path(config.input)
    # A folder's size is known up front; a shard set's is not without reading its manifest.
    total = len(list_images(source)) if source.is_dir() and not _is_shard_source(source) else None
    bar = tqdm(desc="saliency maps", unit="img", total=total, disable=not config.progress)

    def pending(item: Item) -> tuple[str, ...]:
        if config.overwrite:
            return config.methods
        return tuple(
            m for m in config.methods if not map_path(config.output, m, item.name).exists()
        )

    def record(result: tuple[str, list[str], str | None]) -> None:
        name, written, error = result
        report.written.update(written)
        if error is not None:
            report.failed.append((name, error))
            bar.write(f"skipped {error}")
        bar.update(1)

    def todo() -> Iterator[tuple[Item, tuple[str, ...]]]:
        for item in iter_items(config.input):
            report.inputs += 1
            methods = pending(item)
            if methods:
                yield item, methods
            else:
                report.already_done += 1
                bar.update(1)

    if config.workers <= 1:
        for item, methods in todo():
            record(process_item(item, methods, config.output))
    else:
        # Bounded submission: a shard set can be far larger than memory.
        in_flight: set[Future] = set()
        # spawn, not fork: forking a process whose BLAS/OpenCV thread pools are running can
        # leave the children deadlocked on a lock held by a thread that no longer exists.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(config.workers, mp_context=context, initializer=_init_worker) as pool:
            for item, methods in todo():
                in_flight.add(pool.submit(process_item, item, methods, config.output))
                if len(in_flight) >= 4 * config.workers:
                    done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    for future in done:
                        record(future.result())
            for future in in_flight:
                record(future.result())
    bar.close()
    return report
