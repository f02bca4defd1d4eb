"""`relicv2 saliency build-masks`: a masked shard set from a shard set and a trained saliency model.

Input: any shard set `shards.shardset.resolve_shard_set` takes; indexes missing beside its tars are
derived once into the index cache (`--index-cache`); nothing is written beside the input.

Output `OUT/masked-NNNNNN.tar` (+ `.idx`), one per input shard, each sample holding the input's image
bytes unchanged (`output_member` names it), its `.cls`, its json plus `mask_coverage` / `mask_status`,
and `{key}.mask.png`: the 8-bit soft mask at the displayed image's size (EXIF orientation applied, as
DALI's decoder applies it). Then `manifest.parquet`, `rejected.parquet`, `info.json` and `config.yaml`.

- Streaming: one batch being decoded (worker processes), one in the network, one being encoded and
  written; memory is a few batches whatever the data set size (the batches in flight live in a
  shared-memory ring, `mask_work.SlotRing`: 3 x batch x size^2 x 7 bytes, 250 MiB at 64 x 432 px).
- Resumable: the job drives the shard-job engine (`shards.job`): one unit per input shard, its done
  record `OUT/.build-masks/NNNNNN.done.json` holding the digests of its input (the model, the input
  tar's size, time and index) and of its output tar and index; a rerun keeps the shards whose record
  matches both and redoes the rest (an input rebuilt under the same names, a damaged output).
  Batches never span input shards and inference is deterministic, so the result is byte-identical
  to an uninterrupted run.
- Refusals: an --out holding files this job did not write (a user's, another tool's) is refused,
  naming them, before anything is written; so are a --device this machine lacks and a model without a
  usable input size. A refused job leaves no --out; an unwritable one is one line naming the path.
- Multi-node: under torchrun each rank takes a contiguous range of input shards; rank 0 writes the
  manifest once every shard's record is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from relicv2.jobs.atomic import atomic_write_bytes, remove_stale_temps
from relicv2.jobs.config import SETTINGS_FILE, ConfigError, Presets, resolve, settings_text
from relicv2.jobs.device import resolve_device
from relicv2.jobs.lock import folder_lock
from relicv2.jobs.progress import Phase
from relicv2.jobs.ranks import Ranks, ranks_from_env
from relicv2.jobs.version import package_version
from relicv2.jobs.workers import local_ranks, rank_cores, usable_cores, worker_pool
from relicv2.saliency.network.config import CrfConfig
from relicv2.saliency.network.crf import model_crf
from relicv2.saliency.network.mask_work import (
    MIN_COVERAGE,
    RawSample,
    RingSpaceError,
    SlotRing,
    check_shm_space,
    finish_chunk,
    init_worker,
    prepare_chunk,
    record_semaphores,
    remove_dead_rings,
    ring_bytes,
)
from relicv2.saliency.network.model_file import PASS_MODEL, resolve_model_path
from relicv2.saliency.network.predictor import MaskPredictor, launch_forward
from relicv2.shards.images import Rejection
from relicv2.shards.index import read_index
from relicv2.shards.job import (
    NOT_DONE,
    PlanError,
    ShardJob,
    UnfinishedError,
    Unit,
    check_plan,
    digest_of,
    input_tar_identity,
    merge_records,
    output_error,
    pending_reason,
    rank_units,
    wait_for_records,
    write_plan,
    write_record,
)
from relicv2.shards.manifest import MANIFEST_NAME, REJECTED_NAME
from relicv2.shards.outdir import SET_FILES, other_entries, output_folder, shard_files
from relicv2.shards.reader import ReadReport, read_samples
from relicv2.shards.sample import (
    EXT_PATTERN,
    LABEL_MEMBER,
    MASK_MEMBER,
    USED_MEMBERS,
    label_text,
    unwritable_key,
)
from relicv2.shards.shardset import (
    INDEX_CACHE_ENV,
    check_count,
    default_index_cache,
    listed_shards,
    shard_tars,
    tar_index,
)
from relicv2.shards.writer import TarShard, shard_name

PREFIX = "masked"
STATE_DIR = ".build-masks"


class MasksError(ValueError):
    """A build-masks input, output folder or machine the job cannot use, or a job that could not go on."""


@dataclass(frozen=True)
class BuildMasksConfig:
    """One `relicv2 saliency build-masks` job (`load_masks_config`: from a preset, the options and `--set`)."""

    model: Path
    shards: Path
    out: Path
    workers: int | None = None  # processes; None: default_workers(); 0: all in the job's own process
    batch_size: int = 32
    device: str = "auto"  # CUDA when a GPU is visible (this rank's under torchrun), else the CPU
    progress: bool = True
    merge_timeout_s: float = 3600.0  # rank 0 waits this long for the other ranks' shards
    # Average each mask with the prediction of the mirrored image, mirrored back: twice the forward, a small
    # max-F gain on held-back PASCAL-S (benchmarks/RESULTS.md, "Levers at small scale").
    flip: bool = False
    # Refine each mask with the dense CRF the model was trained with, at its input size, in the workers: CPU
    # time an image, and on held-back PASCAL-S a lower MAE and a higher max-F for every one-round model
    # measured (benchmarks/RESULTS.md, "Dense CRF cost" and "CRF at inference").
    crf: bool = False
    # Where indexes of input tars without one are derived; None: shards.shardset.default_index_cache.
    index_cache: Path | None = None


PRESETS = Presets(job="relicv2 saliency build-masks", package="relicv2.saliency", folder="presets/build-masks")


def load_masks_config(config: str | Path | None = None, overrides: Sequence[str] = (), **given: Any) -> BuildMasksConfig:
    """Defaults <- preset NAME or YAML file <- the command's options in `given` (None: not given) <- `key=value`."""
    return resolve(BuildMasksConfig, config, overrides, PRESETS,
                   given={key: value for key, value in given.items() if value is not None})


def default_workers() -> int:
    """Worker processes when --workers is not given: this rank's share of the cores, less one for the
    job's own process (reading, the network, tar writing)."""
    return max(1, rank_cores() - 1)


def job_workers(config: BuildMasksConfig) -> tuple[int, str | None]:
    """(worker processes, a note when --workers was lowered); MasksError for a batch under 1. More
    workers than the usable cores, or than the tasks in flight at once (a batch being prepared and
    one being finished, each cut in at most a batch's worth of chunks), would only wait."""
    if config.batch_size < 1:
        raise MasksError(f"--batch {config.batch_size}: a batch holds at least 1 image")
    if config.workers is None:
        return default_workers(), None
    limit = max(1, min(usable_cores(), 2 * config.batch_size))
    if config.workers <= limit:
        return config.workers, None
    return limit, (f"--workers {config.workers} lowered to {limit}: more than {usable_cores()} usable cores or "
                   f"2 x --batch {config.batch_size} tasks at once would only wait")


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


def read_input_shard(tar: Path, kept: Counter) -> Iterator[RawSample | dict]:
    """Samples of one input tar through the shard reader (its policy for bad members), each refused one
    as a rejected-list row. Members no job reads are carried into the output unchanged, and an input
    `mask.png` is replaced by the new mask: both counted in `kept` by member name."""
    report, done = ReadReport(), 0
    for sample in read_samples(tar, report):  # from the tar's headers: they name every member refused
        yield from report.rows(done)
        done = len(report.rejected)
        if (problem := unwritable_key(sample.key)) is not None:
            yield {"source": f"{tar.name}:{sample.key}", "reason": "bad_key", "detail": problem}
            continue
        carried = {ext: data for ext, data in sample.members.items() if ext not in USED_MEMBERS}
        unwritable = next((ext for ext in carried if not EXT_PATTERN.fullmatch(ext)), None)
        if unwritable is not None:
            yield {"source": f"{tar.name}:{sample.key}", "reason": "bad_member",
                   "detail": f"member {sample.key}.{unwritable} cannot be carried: not a lower-case [a-z0-9_.] name"}
            continue
        kept.update(carried.keys() | ({MASK_MEMBER} & sample.members.keys()))
        meta = sample.meta if isinstance(sample.meta, dict) else {}
        if sample.label is None and LABEL_MEMBER in sample.members:  # a class name (other tools write them):
            meta = {**meta, "source_cls": label_text(sample.members[LABEL_MEMBER])}  # masks need none, kept in the json
        yield RawSample(sample.key, sample.members[sample.image_ext], sample.label, meta,
                        output_member(sample.image_ext), carried)
    yield from report.rows(done)
    for _, reason in report.lost_shards:
        yield {"source": f"{tar.name}:(rest of the tar)", "reason": "truncated", "detail": reason}


@dataclass
class MainThreadClock:
    """Where the job's main thread spent its time (seconds): in the forward pass, waiting for the pool
    (decode, mask encoding: a GPU run with much of it is host-bound), in all; and when the first batch was
    decoded (the workers' one-time start, which a short benchmark should not count as throughput)."""

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
    return iter(lambda: list(itertools.islice(items, size)), [])


def mask_shard(tar: Path, out_tar: Path, predictor: MaskPredictor, pool: Executor, ring: SlotRing, bar,
               workers: int, clock: MainThreadClock,
               crf: CrfConfig | None) -> tuple[TarShard | None, list[dict], dict[str, int]]:
    """Write the masked copy of one input shard; returns the closed tar (None when no sample could be
    written), the rejected samples and the input members carried or replaced, by name.

    Batch n lives in ring slot n % 3 from its decode to its finish. In the loop's turn for batch n the
    job reads batch n+1 and hands it to the workers, launches batch n, collects the records of batch
    n-1 and writes them while the network runs, then hands batch n's maps to the workers. Batch n-1's
    records are all in before batch n+2 is read into its slot, so three slots never collide. Each batch
    goes to the pool as `workers` chunks, not a task per image (a task costs a pickled call and a pipe
    round trip). With `crf`, the workers refine each map on its square, still in the slot at the finish.
    """
    spec, parts = ring.spec, max(1, workers)
    rejected: list[dict] = []
    members: Counter = Counter()  # input members carried or replaced, by name
    shard = TarShard(out_tar)
    writing: list[Future] = []  # the finish chunks of the batch before, in sample order
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
        for number, raw_batch in enumerate(_batches(read_input_shard(tar, members), spec.batch)):
            samples = [item for item in raw_batch if isinstance(item, RawSample)]
            if len(samples) < len(raw_batch):  # rows of samples the reader refused
                rejected.extend(item for item in raw_batch if isinstance(item, dict))
                bar.update(len(raw_batch) - len(samples))
            slot = number % spec.slots
            yield slot, samples, [pool.submit(prepare_chunk, spec, slot, part.start, samples[part])
                                  for part in _chunks(len(samples), parts)]

    try:
        # pairwise: the next batch is read and handed to the workers before this one goes to the network
        for (slot, samples, futures), _ in itertools.pairwise(itertools.chain(prepared_batches(), [None])):
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
                writing.extend(pool.submit(finish_chunk, spec, slot, part.start, ready[part], crf, kept[part])
                               for part in _chunks(len(ready), parts))
        write_finished()
        clock.total += time.perf_counter() - began
        if not shard.rows:
            shard.abort()
            return None, rejected, dict(members)
        shard.close()
    except BaseException:
        shard.abort()
        raise
    return shard, rejected, dict(members)


@contextlib.contextmanager
def _workers(count: int, batch: int, predictor, out: Path) -> Iterator[tuple[Executor, SlotRing]]:
    """The job's pool and its ring of batches: `count` worker processes, or the job's own process for
    0; OpenCV on one thread in either. Spawned, not forked: a fork of a process running CUDA or torch's
    thread pools can hang. On a GPU the ring is page-locked for the predictor's DMA (see
    `MaskPredictor.register_host_memory`; `ring.page_locked` says whether it is). The ring goes when
    the workers have gone; the rings of earlier jobs on `out` killed with their process group go first."""
    remove_dead_rings(out)
    ring = SlotRing.create(batch, predictor.size, out)
    opencv_threads = cv2.getNumThreads()
    try:
        register = getattr(predictor, "register_host_memory", None)
        ring.page_locked = register is not None and register(*ring.address())
        init_worker()  # OpenCV as in a worker: with --workers 0 this process runs the tasks
        record = None
        try:
            with (InlineExecutor() if count == 0
                  else worker_pool(count, start_method="spawn", initializer=init_worker)) as pool:
                record = record_semaphores(pool, out)  # None for the job's own process: it has none
                yield pool, ring
        finally:  # the pool has shut down and its semaphores are gone: so goes their record
            if record is not None:
                record.unlink()
    finally:
        cv2.setNumThreads(opencv_threads)
        if ring.page_locked:
            predictor.unregister_host_memory()
        ring.release()


def _input_tars(config: BuildMasksConfig, ranks: Ranks) -> list[Path]:
    """The input set's tars in order. A set with a manifest: the tars it lists, this rank's checked
    against it (their index files lie beside them); each rank checks its own, so that no rank reads
    every index (a second an index on every rank at ImageNet's size). Plain sets are not indexed here
    (see `_run`)."""
    tars, directory = shard_tars(config.shards)
    if directory is None or not (directory / MANIFEST_NAME).is_file():
        return tars
    listed, _ = listed_shards(directory)
    tars = list(listed)
    cache = default_index_cache(config.index_cache)
    for number in rank_units(len(tars), ranks.rank, ranks.world_size):
        tar = tars[number]
        check_count(tar, len(read_index(_index_file(tar, cache), tar)), listed[tar])
    return tars


def check_input(tars: list[Path], out: Path) -> None:
    """Refuse an input that names a tar twice (its samples would be written twice) or lies in `out`
    (the masked tars, `masked-NNNNNN.tar`, would join the input set)."""
    resolved = [t.resolve() for t in tars]
    twice = [tar for tar, n in Counter(resolved).items() if n > 1]
    if twice:
        raise MasksError(f"the input names {twice[0]} more than once; give each shard once")
    out_dir = out.resolve()
    if any(t.parent == out_dir for t in resolved):
        raise MasksError(f"--out {out} holds input shards; choose an output folder apart from --shards")


def masks_job(out: Path, model_sha256: str, tars: list[Path], flip: bool, crf: bool) -> tuple[ShardJob, dict]:
    """The engine's job and plan: one unit per input tar, `masked-NNNNNN.tar` in the input's order. A
    unit's digest covers the model (and `flip` and `crf`, which make other masks), its output name and its input
    tar's name, size and modification time (a stat: any rank can check any unit's record); the SHA-256
    of the input's index is checked by the rank that owns the unit (`input_tar_identity`)."""
    # Each option only when on: a job without them keeps the plan it had before they existed.
    masks = {"model_sha256": model_sha256, **({"flip": True} if flip else {}), **({"crf": True} if crf else {})}
    plan = {**masks, "input_shards": [t.name for t in tars], "prefix": PREFIX}
    units = []
    for number, tar in enumerate(tars):
        stat = tar.stat()
        shard = shard_name(PREFIX, number)
        digest = digest_of({**masks, "shard": shard, "input": tar.name,
                            "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        units.append(Unit(f"{number:06d}", shard, digest))
    return ShardJob(out, out / STATE_DIR, tuple(units)), plan


def check_out_folder(job: ShardJob) -> None:
    """Refuse an --out folder holding files this job did not write: anything, when no build-masks run
    began there (its plan); otherwise anything but its shards and set files. Like `shards build`, a
    job never overwrites, nor writes among, a user's own files."""
    out = job.out
    if out.exists() and not out.is_dir():
        raise MasksError(f"--out {out} is a file; choose an empty or new folder")
    ours = shard_files([unit.shard for unit in job.units]) | {*SET_FILES, SETTINGS_FILE}
    # Listed before the plan is looked at: under torchrun, rank 0 writes the plan before any output,
    # so an output seen here always comes with the plan that makes it ours.
    visible = other_entries(out, set())
    others = [name for name in visible if name not in ours] if job.plan_path.is_file() else visible
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise MasksError(f"--out {out} holds files this job did not write ({shown}); choose an empty or new folder")


def build_masks(config: BuildMasksConfig, ranks: Ranks | None = None, predictor=None) -> dict | None:
    """Run (or resume) the job; rank 0 returns the summary, the other ranks None. `predictor` (tests,
    benchmarks) stands in for the model file's network (see `launch_forward`); the file is still read."""
    ranks = ranks or ranks_from_env()
    tars = _input_tars(config, ranks)
    out = Path(config.out)
    check_input(tars, out)
    model = resolve_model_path(config.model)
    job, plan = masks_job(out, hashlib.sha256(model.read_bytes()).hexdigest(), tars, config.flip, config.crf)
    try:  # the refusals, each before --out exists: a refused job leaves no folder behind
        check_plan(job, plan, other="a masked set built from another model, input, flip or crf setting")
        check_out_folder(job)
        device = resolve_device(config.device, "--device")
        if predictor is None:
            predictor = MaskPredictor(model, device, flip=config.flip)
            print(f"saliency build-masks: rank {ranks.rank} predicts on {device}", file=sys.stderr,
                  flush=True)
        if predictor.size < 1:
            raise MasksError(f"{model} has input size {predictor.size}; {PASS_MODEL}")
        try:
            crf = model_crf(predictor.info, str(model)) if config.crf else None
        except ConfigError as error:
            raise MasksError(f"{error}; {PASS_MODEL}") from None
        workers, workers_note = job_workers(config)
        # The ring itself is made with the workers; every rank of the node has one.
        check_shm_space(ring_bytes(config.batch_size, predictor.size) * local_ranks())
    except (PlanError, ConfigError, RingSpaceError) as error:
        raise MasksError(str(error)) from None
    if ranks.rank == 0:  # after the refusals: a refused job says one line
        print(settings_text(config, version=package_version()).rstrip(), file=sys.stderr, flush=True)
    try:
        with output_folder(out), folder_lock(out, "relicv2 saliency build-masks", enabled=ranks.rank == 0):
            write_plan(job, plan)  # the first write: an unwritable --out is found before any work
            return _run(job, plan, tars, config, ranks, predictor, workers, workers_note, crf)
    except OSError as error:
        raise MasksError(str(output_error(error, out))) from None


def _run(job: ShardJob, plan: dict, tars: list[Path], config: BuildMasksConfig, ranks: Ranks, predictor,
         workers: int, workers_note: str | None, crf: CrfConfig | None) -> dict | None:
    """This rank's units (those whose record does not match their inputs and files), then rank 0's merge."""
    out = job.out
    cache = default_index_cache(config.index_cache)
    mine = rank_units(len(tars), ranks.rank, ranks.world_size)
    # Only the tars this rank reads are indexed here: a plain set's missing index is derived by
    # the one rank that masks the tar, not by every rank of the job.
    index_files = {n: _index_file(tars[n], cache) for n in mine}
    inputs = {n: input_tar_identity(tars[n], index_files[n]) for n in mine}
    reasons = {n: pending_reason(job, job.units[n], inputs[n]) for n in mine}
    todo = [n for n in mine if reasons[n] is not None]
    for n in todo:
        if reasons[n] != NOT_DONE:
            print(f"masking {job.units[n].shard} again, finished by an earlier run: {reasons[n]}", file=sys.stderr)
    # Shards of the other ranks with a record now were finished by an earlier run (a record one of
    # them writes in the moments since it started would be counted as kept: a report, not a decision).
    kept = sum(n not in mine and job.record_path(u).is_file() for n, u in enumerate(job.units)) + len(mine) - len(todo)
    # Partial tars a killed run left under temporary names (only this rank's shards).
    remove_stale_temps(out, shard_files([job.units[n].shard for n in todo]))
    total = sum(len(read_index(index_files[n], tars[n])) for n in todo)
    started, clock = time.monotonic(), MainThreadClock()
    with Phase("build-masks", total, unit="img", enabled=config.progress and bool(todo)) as bar, \
            _workers(workers, config.batch_size, predictor, out) as (pool, ring):
        for number in todo:
            unit = job.units[number]
            try:
                shard, rejected, members = mask_shard(tars[number], out / unit.shard, predictor, pool, ring, bar,
                                                      workers, clock, crf)
            except BrokenProcessPool as error:
                raise MasksError(
                    f"a worker process died while masking {tars[number]} (killed by the system for memory? "
                    "see dmesg); finished shards are kept: rerun the same command to resume"
                ) from error
            except OSError as error:
                if error.filename is None:  # a write to the tar (a full disk) names no file: name it
                    error.filename = str(out / unit.shard)
                raise
            write_record(job, unit, shard, rejected, inputs=inputs[number], extra={"members": members})
    seconds = time.monotonic() - started
    if ranks.rank != 0:
        return None
    try:
        records = wait_for_records(job, config.merge_timeout_s if ranks.world_size > 1 else 0,
                                   progress=config.progress, rerun="rerun the same command on every rank")
    except UnfinishedError as error:
        raise MasksError(str(error)) from None
    until_merge = time.monotonic() - started
    coverage = np.concatenate([np.zeros(0), *(rec["manifest"].column("mask_coverage").to_numpy(zero_copy_only=False)
                                              for rec in records if rec["manifest"].num_rows)]).astype(np.float64)
    members = sum((Counter(rec.get("members", {})) for rec in records), Counter())
    replaced = members.pop(MASK_MEMBER, 0)
    mask = {"below_min_coverage": int((coverage < MIN_COVERAGE).sum()), "min_coverage": MIN_COVERAGE,
            "coverage_histogram": np.histogram(coverage, bins=10, range=(0.0, 1.0))[0].tolist()}
    atomic_write_bytes(out / SETTINGS_FILE, settings_text(config, version=package_version()).encode())
    info = {"prefix": PREFIX, "source": str(config.shards), "model": plan["model_sha256"], "flip": config.flip,
            "crf": config.crf, "mask": mask, "version": package_version()}
    merge_records(out, records, info=info)
    return {
        "written": len(coverage),
        "rejected": sum(len(rec["rejected"]) for rec in records),
        "carried_members": dict(members),  # input members no job reads, written unchanged
        "replaced_masks": replaced,
        **mask,
        "mean_coverage": float(coverage.mean()) if len(coverage) else None,
        "seconds": round(until_merge, 2),
        "shards_kept": kept, "shards_built": len(tars) - kept,
        "rejected_file": str(out / REJECTED_NAME), "workers": workers, "workers_note": workers_note,
        "ring_page_locked": ring.page_locked,
        "images_per_s": round(bar.count / seconds, 2) if bar.count and seconds > 0 else None,
        **clock.report(),  # the clock: this rank's
    }


def _index_file(tar: Path, cache: Path) -> Path:
    """The index of an input tar: beside it, else derived into the cache (read once, on first use)."""
    try:
        return tar_index(tar, cache)
    except ValueError as error:  # a tar that cannot be read to the end
        raise MasksError(f"{error}; rebuild or remove this shard") from None
    except OSError as error:
        raise MasksError(f"cannot write the index of {tar} into {cache} ({error.strerror or error}); "
                         f"choose a writable index cache (--index-cache or ${INDEX_CACHE_ENV})") from None


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
    if summary.get("workers_note"):
        lines.append(summary["workers_note"])
    if summary["carried_members"]:
        lines.append(f"input members no job reads, carried into the output unchanged: {summary['carried_members']}")
    if summary["replaced_masks"]:
        lines.append(f"{summary['replaced_masks']} input mask.png replaced by the new mask")
    if summary["rejected"]:
        lines.append(f"why each sample was rejected: {summary['rejected_file']}")
    return "\n".join(lines)
