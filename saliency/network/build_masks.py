"""`relicv2 saliency build-masks`: a masked shard set from a shard set and a trained saliency model.

Input: any shard set `shards.shardset.resolve_shard_set` takes: a folder from `shards build`, a folder
of plain WebDataset tars (webdataset.ShardWriter, `tar`: no manifest, no index, names like
`train-0000.tar`), a brace pattern (`train-{0000..0099}.tar`) or one tar. Indexes missing beside the
tars are derived once into the index cache (`--index-cache`); nothing is written beside the input.

Output `OUT/masked-NNNNNN.tar` (+ `.idx`), one per input shard (numbered by the input's order), each
sample holding the input's image bytes unchanged (a `jpg` or `jpeg` member as `{key}.jpg`, a `png` or
`webp` one under its own name), its `.cls` when it has one, its json plus `mask_coverage` /
`mask_status`, and `{key}.mask.png`: the 8-bit soft mask at the displayed image's size (EXIF
orientation applied, as DALI's decoder applies it). Then `manifest.parquet`, `rejected.parquet` and
`info.json`.

- Streaming: one batch being decoded (worker processes), one in the network, one being encoded and
  written; memory is a few batches whatever the data set size (the batches in flight live in a
  shared-memory ring, `mask_work.SlotRing`: 3 x batch x size^2 x 7 bytes, 250 MiB at 64 x 432 px).
- Resumable: each finished output shard is recorded in `OUT/.build-masks/NNNNNN.json` (its rows,
  rejections and size); a rerun keeps shards whose record and files agree and redoes the rest.
  Batches never span input shards and inference is deterministic, so the result is byte-identical
  to an uninterrupted run.
- Refusals: an --out holding files this job did not write (a user's, another tool's) is refused,
  naming them, before anything is written; a refused job (bad model, foreign files) leaves no --out.
- Multi-node: under torchrun each rank takes a contiguous range of input shards; rank 0 writes the
  manifest once every shard's record is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
from tqdm import tqdm

from saliency.network.config import resolve_device
from saliency.network.images import member_key
from saliency.network.mask_work import (
    MIN_COVERAGE,
    RawSample,
    RingSpaceError,
    SlotRing,
    check_shm_space,
    finish_chunk,
    forget_ring,
    init_worker,
    prepare_chunk,
    ring_bytes,
    use_ring,
)
from saliency.network.model_file import resolve_model_path
from saliency.network.predictor import MaskPredictor, launch_forward
from shards.atomic import atomic_write_bytes, remove_stale_temps
from shards.build import Ranks, ranks_from_env
from shards.images import Rejection
from shards.index import index_path, read_index
from shards.keys import UnsafeKeyError, check_key
from shards.lock import folder_lock
from shards.manifest import (
    MANIFEST_NAME,
    REJECTED_NAME,
    rejected_table,
    write_manifest,
    write_table,
)
from shards.outdir import SET_FILES, other_entries, output_folder, shard_files
from shards.sample import (
    IMAGE_MEMBERS,
    KEY_PATTERN,
    LABEL_MEMBER,
    class_index,
    image_member_name,
    label_text,
)
from shards.shardset import resolve_shard_set, shard_tars
from shards.tario import Skipped, TarReadError, iter_tar
from shards.workers import local_ranks, rank_cores, worker_pool
from shards.writer import TarShard, package_version, shard_name, write_info

PREFIX = "masked"
STATE_DIR = ".build-masks"


class MasksError(ValueError):
    """A build-masks input, output folder or machine the job cannot use, or a job that could not go on."""


@dataclass(frozen=True)
class BuildMasksConfig:
    """One `relicv2 saliency build-masks` job."""

    model: Path
    shards: Path
    out: Path
    workers: int | None = None  # processes; None: default_workers(); 0: all in the job's own process
    batch_size: int = 32
    device: str = "auto"  # CUDA when a GPU is visible (this rank's under torchrun), else the CPU
    progress: bool = True
    merge_timeout: float = 3600.0  # rank 0 waits this long for the other ranks' shards
    # Where indexes of input tars without one are derived; None: shards.shardset.default_index_cache.
    index_cache: Path | None = None


def default_workers() -> int:
    """Worker processes when --workers is not given: this rank's share of the cores, less one for the
    job's own process (reading, the network, tar writing)."""
    return max(1, rank_cores() - 1)


class InlineExecutor(Executor):
    """The pool's interface with every task run at once in the calling process (--workers 0: for a
    debugger, or a machine where starting processes costs more than it gives)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def output_member(ext: str) -> str:
    """The member name the masked set stores an input image member under: `jpeg` is our `jpg`;
    the others keep their name, so that a png is never announced as a JPEG."""
    return "jpg" if ext == "jpeg" else ext


def read_input_shard(tar: Path, idx: Path | None = None) -> Iterator[RawSample | tuple[str, str, str]]:
    """Samples of one input tar via its DALI index (`idx`, default beside the tar); unusable ones as
    (source, reason, detail)."""
    idx = index_path(tar) if idx is None else Path(idx)
    if not idx.is_file():
        raise MasksError(f"{idx} is missing; rebuild the index with shards.write_index({tar.name}) or rebuild the shards")
    # The index leaves out members the reader refuses (links, unsafe names, oversized): name them here,
    # from the tar's headers only, so that no sample is lost without a line in the rejected list.
    try:
        for item in iter_tar(tar, read_data=False):
            if isinstance(item, Skipped):
                name = item.name if item.name is not None else "(rest of the tar)"
                reason = "unsafe_key" if item.reason == "unsafe_member" else item.reason
                yield f"{tar.name}:{name}", reason, item.detail
    except TarReadError as error:
        raise MasksError(f"{tar}: {error}; rebuild or remove this shard") from None
    with open(tar, "rb") as handle:
        for entries in read_index(idx, tar):
            key = member_key(entries[0][3])
            source = f"{tar.name}:{key}"
            try:
                check_key(key)
            except UnsafeKeyError as error:
                yield source, "unsafe_key", str(error)
                continue
            if not KEY_PATTERN.fullmatch(key):
                yield source, "bad_key", f"key {key!r} is not 1-80 characters of [A-Za-z0-9_-]"
                continue
            members = {ext: os.pread(handle.fileno(), size, off) for ext, off, size, _ in entries}
            image = image_member_name(members)
            if image is None:
                yield source, "no_image", f"sample has no image member ({', '.join(IMAGE_MEMBERS)})"
                continue
            try:
                meta = json.loads(members["json"]) if "json" in members else {}
            except ValueError as error:
                yield source, "corrupt", f"unreadable json member ({error})"
                continue
            meta = meta if isinstance(meta, dict) else {}
            label, text_label = read_label(members.get(LABEL_MEMBER))
            if text_label is not None:  # a class name (other tools write them): kept in the json, not lost
                meta = {**meta, "source_cls": text_label}
            yield RawSample(key, members[image], label, meta, output_member(image))


def read_label(cls: bytes | None) -> tuple[int | None, str | None]:
    """(class index, None) for a decimal `cls` member; (None, its text) for a class name; (None, None)
    without one. Masks need no label, so a named class is carried in the json rather than refused."""
    if cls is None:
        return None, None
    label = class_index(cls)
    return (label, None) if label is not None else (None, label_text(cls))


@dataclass
class MainThreadClock:
    """Where the job's main thread spent its time (seconds): in the forward pass (launching it and
    waiting for it; on the CPU, running it), waiting for the pool (decode, mask encoding), and in all.
    The rest is its own work: reading input and writing tars. A GPU run with much waiting on the pool
    is host-bound. Also how long after the clock's start the first batch was decoded: the one-time
    start of the worker processes, which a short benchmark should not count as throughput."""

    forward: float = 0.0
    waiting_for_pool: float = 0.0
    total: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    first_batch: float | None = None

    def report(self) -> dict:
        first = None if self.first_batch is None else round(self.first_batch, 3)
        return {"forward_s": round(self.forward, 3), "waiting_for_pool_s": round(self.waiting_for_pool, 3),
                "main_thread_s": round(self.total, 3), "first_batch_s": first}


def _chunks(count: int, parts: int) -> list[slice]:
    """`count` items as at most `parts` contiguous slices of near-equal length."""
    step = max(1, -(-count // max(1, parts)))  # none for no items (a batch the reader rejected whole)
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def mask_shard(tar: Path, out_tar: Path, predictor: MaskPredictor, pool: Executor, ring: SlotRing, bar,
               index_file: Path | None = None, workers: int = 1, clock: MainThreadClock | None = None) -> dict:
    """Write the masked copy of one input shard; returns its record (rows, rejected, tar size).

    Batch n lives in ring slot n % 3 from its decode to its finish. In the loop's turn for batch n the
    job reads batch n+1 and hands it to the workers, launches batch n, collects the records of batch
    n-1 and writes them while the network runs, then hands batch n's maps to the workers. Batch n-1's
    records are all in before batch n+2 is read into its slot, so three slots never collide. Each batch
    goes to the pool as `workers` chunks, not a task per image (a task costs a pickled call and a pipe
    round trip).
    """
    spec, parts = ring.spec, max(1, workers)
    rejected: list[dict] = []
    shard = TarShard(out_tar)
    writing: list[Future] = []  # the finish chunks of the batch before, in sample order
    clock = clock or MainThreadClock()
    began = time.perf_counter()

    def pool_result(future: Future) -> list:
        waited = time.perf_counter()
        result = future.result()
        clock.waiting_for_pool += time.perf_counter() - waited
        return result

    def write_finished() -> None:
        for future in writing:
            for record in pool_result(future):
                shard.add_record(record)
                bar.update(1)
        writing.clear()

    def prepared_batches():
        for number, raw_batch in enumerate(_batches(read_input_shard(tar, index_file), spec.batch)):
            samples = []
            for item in raw_batch:
                if isinstance(item, tuple):
                    rejected.append({"source": item[0], "reason": item[1], "detail": item[2]})
                    bar.update(1)
                else:
                    samples.append(item)
            slot = number % spec.slots
            yield slot, samples, [pool.submit(prepare_chunk, spec, slot, part.start, samples[part])
                                  for part in _chunks(len(samples), parts)]

    try:
        batches = prepared_batches()
        current = next(batches, None)
        while current is not None:
            following = next(batches, None)  # decode the next batch while this one is in the network
            slot, samples, futures = current
            results = [result for future in futures for result in pool_result(future)]
            if clock.first_batch is None:
                clock.first_batch = time.perf_counter() - clock.started
            ready, kept = [], []
            for position, (sample, result) in enumerate(zip(samples, results, strict=True)):
                if isinstance(result, Rejection):
                    rejected.append({"source": f"{tar.name}:{sample.key}", "reason": result.reason,
                                     "detail": result.detail})
                    bar.update(1)
                else:
                    kept.append(position)
                    ready.append((sample, *result))
            if ready:
                squares = ring.squares(slot)[: len(samples)]
                launched = time.perf_counter()
                maps = ring.probabilities(slot)[: len(ready)]
                fill_maps = launch_forward(predictor, squares if len(kept) == len(samples) else squares[kept], maps)
                clock.forward += time.perf_counter() - launched
                write_finished()  # the previous batch's records, written while this one is in the network
                waited = time.perf_counter()
                fill_maps()
                clock.forward += time.perf_counter() - waited
                writing.extend(pool.submit(finish_chunk, spec, slot, part.start, ready[part])
                               for part in _chunks(len(ready), parts))
            current = following
        write_finished()
        clock.total += time.perf_counter() - began
        if not shard.rows:
            shard.abort()
            return {"rows": [], "rejected": rejected, "tar_size": None}
        rows = shard.close()
    except BaseException:
        shard.abort()
        raise
    return {"rows": rows, "rejected": rejected, "tar_size": out_tar.stat().st_size}


@contextlib.contextmanager
def _workers(count: int, batch: int, predictor) -> Iterator[tuple[Executor, SlotRing]]:
    """The job's pool and its ring of batches: `count` worker processes, or the job's own process for
    0; OpenCV on one thread in either. Spawned, not forked: a fork of a process running CUDA or torch's
    thread pools can hang. On a GPU the ring is page-locked for the predictor's DMA (see
    `MaskPredictor.register_host_memory`; `ring.page_locked` says whether it is). The ring goes when
    the workers have gone."""
    ring = SlotRing.create(batch, predictor.size)
    opencv_threads = cv2.getNumThreads()
    try:
        register = getattr(predictor, "register_host_memory", None)
        ring.page_locked = register is not None and register(*ring.address())
        init_worker()  # OpenCV as in a worker: with --workers 0 this process runs the tasks
        use_ring(ring)
        if count == 0:
            yield InlineExecutor(), ring
        else:
            with worker_pool(count, start_method="spawn", initializer=init_worker) as pool:
                yield pool, ring
    finally:
        forget_ring(ring)
        cv2.setNumThreads(opencv_threads)
        if ring.page_locked:
            predictor.unregister_host_memory()
        ring.release()


def _record_path(out: Path, number: int) -> Path:
    return Path(out) / STATE_DIR / f"{number:06d}.json"


def _record_valid(out: Path, number: int) -> dict | None:
    """A finished shard's record when the record and its files agree, else None (redo the shard)."""
    path = _record_path(out, number)
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    tar = Path(out) / shard_name(PREFIX, number)
    if record.get("tar_size") is None:
        return record if not tar.exists() else None
    if not tar.is_file() or tar.stat().st_size != record["tar_size"] or not index_path(tar).is_file():
        return None
    return record


def _input_tars(config: BuildMasksConfig) -> list[Path]:
    """The input set's tars in order; a set with a manifest is checked against it (cheap: its index
    files lie beside its tars). Plain sets are not indexed here (see `build_masks`)."""
    tars, directory = shard_tars(config.shards)
    if directory is not None and (directory / MANIFEST_NAME).is_file():
        return list(resolve_shard_set(config.shards, index_cache=config.index_cache).tars)
    return tars


def check_input(tars: list[Path], out: Path) -> None:
    """Refuse an input that names a tar twice (its samples would be written twice) or lies in `out`
    (the masked tars, `masked-NNNNNN.tar`, would join the input set)."""
    resolved = [t.resolve() for t in tars]
    twice = next((t for i, t in enumerate(resolved) if t in resolved[:i]), None)
    if twice is not None:
        raise MasksError(f"the input names {twice} more than once; give each shard once")
    if any(t.parent == out.resolve() for t in resolved):
        raise MasksError(f"--out {out} holds input shards; choose an output folder apart from --shards")


def _settings(model: Path, tars: list[Path]) -> dict:
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    return {"model_sha256": digest, "input_shards": [t.name for t in tars], "prefix": PREFIX}


def _settings_path(out: Path) -> Path:
    return Path(out) / STATE_DIR / "settings.json"


def _check_settings(out: Path, settings: dict) -> None:
    """Refuse an --out folder holding a masked set of another model or input (read only)."""
    path = _settings_path(out)
    if path.is_file() and json.loads(path.read_text()) != settings:
        raise MasksError(
            f"{out} holds a masked set built from another model or input; choose another --out or delete it"
        )


def _write_settings(out: Path, settings: dict) -> None:
    """Mark `out` as this job's, before any of its outputs (see `check_out_folder`)."""
    path = _settings_path(out)
    if not path.is_file():  # every rank may write it: the content is the same, and the write is atomic
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(settings, sort_keys=True) + "\n").encode())


def _summary(records: list[dict], seconds: float) -> dict:
    rows = [r for rec in records for r in rec["rows"]]
    coverage = np.array([r["mask_coverage"] for r in rows], dtype=np.float64)
    histogram = np.histogram(coverage, bins=10, range=(0.0, 1.0))[0].tolist() if len(rows) else [0] * 10
    return {
        "written": len(rows),
        "rejected": sum(len(rec["rejected"]) for rec in records),
        "below_min_coverage": int((coverage < MIN_COVERAGE).sum()),
        "min_coverage": MIN_COVERAGE,
        "coverage_histogram": histogram,
        "mean_coverage": float(coverage.mean()) if len(rows) else None,
        "seconds": round(seconds, 2),
    }


def check_out_folder(out: Path, count: int) -> None:
    """Refuse an --out folder holding files this job did not write: anything, when no build-masks run
    began there (`STATE_DIR/settings.json`); otherwise anything but its shards and set files. Like
    `shards build`, a job never overwrites, nor writes among, a user's own files."""
    if out.exists() and not out.is_dir():
        raise MasksError(f"--out {out} is a file; choose an empty or new folder")
    ours = shard_files([shard_name(PREFIX, n) for n in range(count)]) | set(SET_FILES)
    # Listed before the settings are looked at: under torchrun, rank 0 writes the settings before any
    # output, so an output seen here always comes with the settings that make it ours.
    visible = other_entries(out, set())
    if not visible:
        return
    started = _settings_path(out).is_file()
    others = [name for name in visible if name not in ours] if started else visible
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise MasksError(f"--out {out} holds files this job did not write ({shown}); choose an empty or new folder")


def build_masks(config: BuildMasksConfig, ranks: Ranks | None = None, predictor=None) -> dict | None:
    """Run (or resume) the job; rank 0 returns the summary, the other ranks None.

    `predictor` (tests, benchmarks): used instead of the model file's network, with a `.size` and either
    `MaskPredictor`'s `.launch` or a call (uint8 squares -> probabilities; see `launch_forward`); the file
    is still read and fingerprinted.
    """
    ranks = ranks or ranks_from_env()
    tars = _input_tars(config)
    out = Path(config.out)
    check_input(tars, out)
    model = resolve_model_path(config.model)
    settings = _settings(model, tars)
    _check_settings(out, settings)
    check_out_folder(out, len(tars))
    # The model is read before --out is created: a refused model leaves no folder behind.
    if predictor is None:
        device = resolve_device(config.device)
        predictor = MaskPredictor(model, device)
        print(f"saliency build-masks: rank {ranks.rank} predicts on {device}", file=sys.stderr, flush=True)
    workers = default_workers() if config.workers is None else config.workers
    try:  # before --out exists, like the other refusals (the ring itself is made with the workers)
        check_shm_space(ring_bytes(config.batch_size, predictor.size) * local_ranks())  # every rank of the node has one
    except RingSpaceError as error:
        raise MasksError(str(error)) from None
    with output_folder(out), folder_lock(out, "relicv2 saliency build-masks", enabled=ranks.rank == 0):
        _write_settings(out, settings)
        mine = range(len(tars) * ranks.rank // ranks.world_size, len(tars) * (ranks.rank + 1) // ranks.world_size)
        todo = [n for n in mine if _record_valid(out, n) is None]
        # Shards of the other ranks with a record now were finished by an earlier run (a record one of
        # them writes in the moments since it started would be counted as kept: a report, not a decision).
        kept = sum(n not in mine and _record_path(out, n).is_file() for n in range(len(tars))) + len(mine) - len(todo)
        # Partial tars a killed run left under temporary names (only this rank's shards).
        remove_stale_temps(out, {shard_name(PREFIX, n) for n in todo} | {index_path(Path(shard_name(PREFIX, n))).name for n in todo})
        # Only the tars this rank reads are indexed here: a plain set's missing index is derived by
        # the one rank that masks the tar, not by every rank of the job.
        indexed = resolve_shard_set([tars[n] for n in todo], index_cache=config.index_cache) if todo else None
        index_files = dict(zip(todo, indexed.index_files, strict=True)) if indexed else {}
        total = indexed.samples if indexed else 0
        started, processed, clock = time.monotonic(), 0, MainThreadClock()
        bar = tqdm(total=total, desc="build-masks", unit="img", disable=not config.progress or not todo,
                   dynamic_ncols=True)
        with _workers(workers, config.batch_size, predictor) as (pool, ring):
            page_locked = ring.page_locked
            for number in todo:
                try:
                    record = mask_shard(tars[number], out / shard_name(PREFIX, number), predictor, pool, ring,
                                        bar, index_files[number], workers, clock)
                except BrokenProcessPool as error:
                    raise MasksError(
                        f"a worker process died while masking {tars[number]} (killed by the system for memory? "
                        "see dmesg); finished shards are kept: rerun the same command to resume"
                    ) from error
                record["input"] = tars[number].name
                processed += len(record["rows"]) + len(record["rejected"])
                _record_path(out, number).parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(_record_path(out, number), (json.dumps(record, sort_keys=True) + "\n").encode())
        seconds = time.monotonic() - started
        bar.close()
        if ranks.rank != 0:
            return None
        records = _wait_for_records(out, len(tars), config.merge_timeout)
        rows = [r for rec in records for r in rec["rows"]]
        rejected = [r for rec in records for r in rec["rejected"]]
        if rows:
            write_manifest(rows, out)
        write_table(rejected_table(rejected), out / REJECTED_NAME)
        summary = _summary(records, time.monotonic() - started)
        written = [shard_name(PREFIX, n) for n, rec in enumerate(records) if rec["tar_size"] is not None]
        write_info(out, {
            "prefix": PREFIX, "shards": len(written), "samples": len(rows), "labelled": sum(r["label"] is not None for r in rows),
            "rejected": len(rejected), "empty_shards": [shard_name(PREFIX, n) for n, rec in enumerate(records) if rec["tar_size"] is None],
            "bytes": sum(rec["tar_size"] or 0 for rec in records), "source": str(config.shards),
            "model": settings["model_sha256"], "mask": {k: summary[k] for k in ("below_min_coverage", "min_coverage", "coverage_histogram")},
            "version": package_version(),
        })
        summary["shards_kept"], summary["shards_built"] = kept, len(tars) - kept
        summary["rejected_file"] = str(out / REJECTED_NAME)
        summary["workers"], summary["ring_page_locked"] = workers, page_locked
        summary["images_per_s"] = round(processed / seconds, 2) if processed and seconds > 0 else None
        summary.update(clock.report())  # this rank's
        return summary


def _wait_for_records(out: Path, count: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        records = [_record_valid(out, n) for n in range(count)]
        missing = [n for n, r in enumerate(records) if r is None]
        if not missing:
            return records  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise MasksError(
                f"{len(missing)} shards (e.g. {shard_name(PREFIX, missing[0])}) were not finished by the other "
                "ranks in time; rerun the same command to complete them"
            )
        time.sleep(2.0)


def format_summary(summary: dict) -> str:
    """A human summary: counts, shards kept and built, coverage histogram, the masks below the minimum
    coverage, and where the rejected samples are listed."""
    bars = "  ".join(f"{i * 10}-{i * 10 + 10}%: {n}" for i, n in enumerate(summary["coverage_histogram"]))
    rate = f" ({summary['images_per_s']} img/s this run)" if summary.get("images_per_s") is not None else ""
    lines = [
        f"build-masks: {summary['written']} masked, {summary['rejected']} rejected",
        f"{summary['shards_kept']} shard(s) kept from an earlier run, {summary['shards_built']} built{rate}"
        f" with {summary['workers']} worker process(es)",
        f"coverage (fraction >= 0.5): {bars}",
        f"{summary['below_min_coverage']} masks cover less than {summary['min_coverage']:.0%} and will not be "
        "applied in pretraining",
    ]
    if summary["rejected"]:
        lines.append(f"why each sample was rejected: {summary['rejected_file']}")
    return "\n".join(lines)
