"""One input shard masked: its samples read through the shard reader, and the per-shard pipeline of
`saliency build-masks` (decode in the workers, the network, mask encoding in the workers, tar writing),
over a pool of worker processes and a shared-memory ring of batches (`mask_work`).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path

import cv2

from relicv2.jobs.workers import worker_pool
from relicv2.saliency.network.config import CrfConfig, MasksError
from relicv2.saliency.network.mask_work import (
    RING_SLOTS,
    RawSample,
    SlotRing,
    finish_chunk,
    init_worker,
    prepare_chunk,
    record_semaphores,
    remove_dead_rings,
)
from relicv2.saliency.network.predictor import MaskPredictor, launch_forward
from relicv2.shards.driver import UnitOutput
from relicv2.shards.images import Rejection
from relicv2.shards.reader import ReadReport, read_samples
from relicv2.shards.sample import (
    EXT_PATTERN,
    LABEL_MEMBER,
    MASK_MEMBER,
    USED_MEMBERS,
    label_text,
    unwritable_key,
)
from relicv2.shards.shardset import INDEX_CACHE_ENV, tar_index
from relicv2.shards.sources import reject
from relicv2.shards.writer import TarShard


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
            yield reject(f"{tar.name}:{sample.key}", "bad_key", problem)
            continue
        carried = {ext: data for ext, data in sample.members.items() if ext not in USED_MEMBERS}
        unwritable = next((ext for ext in carried if not EXT_PATTERN.fullmatch(ext)), None)
        if unwritable is not None:
            yield reject(f"{tar.name}:{sample.key}", "bad_member",
                         f"member {sample.key}.{unwritable} cannot be carried: not a lower-case [a-z0-9_.] name")
            continue
        kept.update(carried.keys() | ({MASK_MEMBER} & sample.members.keys()))
        meta = sample.meta if isinstance(sample.meta, dict) else {}
        if sample.label is None and LABEL_MEMBER in sample.members:  # a class name (other tools write them):
            meta = {**meta, "source_cls": label_text(sample.members[LABEL_MEMBER])}  # masks need none, kept in the json
        yield RawSample(sample.key, sample.members[sample.image_ext], sample.label, meta,
                        output_member(sample.image_ext), carried)
    yield from report.rows(done)
    for _, reason in report.lost_shards:
        yield reject(f"{tar.name}:(rest of the tar)", "truncated", reason)


def input_index(tar: Path, cache: Path) -> Path:
    """The index of an input tar: beside it, else derived into the cache (read once, on first use)."""
    try:
        return tar_index(tar, cache)
    except ValueError as error:  # a tar that cannot be read to the end: the reader's message names the fix
        raise MasksError(str(error)) from None
    except OSError as error:
        raise MasksError(f"cannot write the index of {tar} into {cache} ({error.strerror or error}); "
                         f"choose a writable index cache (--index-cache or ${INDEX_CACHE_ENV})") from None


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


def chunks(count: int, parts: int) -> list[slice]:
    """`count` items as at most `parts` contiguous slices of near-equal length."""
    step = max(1, -(-count // max(1, parts)))  # none for no items (a batch the reader rejected whole)
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]


def _batches(items: Iterator, size: int) -> Iterator[list]:
    return iter(lambda: list(itertools.islice(items, size)), [])


def mask_shard(tar: Path, out_tar: Path, predictor: MaskPredictor, pool: Executor, ring: SlotRing, bar,
               workers: int, clock: MainThreadClock,
               crf: CrfConfig | None) -> UnitOutput:
    """Write the masked copy of one input shard; returns the closed tar (None when no sample could be
    written), the rejected samples and (as `members`) the input members carried or replaced, by name.

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
            slot = number % RING_SLOTS
            yield slot, samples, [pool.submit(prepare_chunk, spec, slot, part.start, samples[part])
                                  for part in chunks(len(samples), parts)]

    try:
        # pairwise: the next batch is read and handed to the workers before this one goes to the network
        for (slot, samples, futures), _ in itertools.pairwise(itertools.chain(prepared_batches(), [None])):
            results = [result for future in futures for result in pool_result(future)]
            if clock.first_batch is None:
                clock.first_batch = time.perf_counter() - clock.started
            ready, kept = [], []
            for position, (sample, result) in enumerate(zip(samples, results, strict=True)):
                if isinstance(result, Rejection):
                    rejected.append(reject(f"{tar.name}:{sample.key}", result.reason, result.detail))
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
                               for part in chunks(len(ready), parts))
        write_finished()
        clock.total += time.perf_counter() - began
        if not shard.rows:
            shard.abort()
            return UnitOutput(None, rejected, {"members": dict(members)})
        shard.close()
    except BaseException:
        shard.abort()
        raise
    return UnitOutput(shard, rejected, {"members": dict(members)})


@contextlib.contextmanager
def mask_workers(count: int, batch: int, predictor, out: Path) -> Iterator[tuple[Executor, SlotRing]]:
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


class InlineExecutor(Executor):
    """The pool's interface with every task run at once in the calling process (--workers 0: for a
    debugger, or a machine where starting processes costs more than it gives)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future
