"""The per-image work of `saliency build-masks`, done in worker processes.

`prepare` decodes an image and squares it for the network; `finish` makes the mask at the image's
displayed size, its PNG and the output sample's tar record. Worker processes, not threads: with
threads the Python parts of this work (tar headers, json, the pool's hand-overs) run one at a time
under the GIL, which capped the job at ~1 core on a 16-core GPU host.

A batch's network input and probabilities cross between the processes through a ring of
shared-memory slots (`SlotRing`): a worker writes its squares straight into the slot the network
reads, and reads the probabilities the job wrote there. Only the encoded image bytes and the
finished tar records go through the pool's pipes. This module does not import torch, so that a
spawned worker starts in well under a second and costs no torch memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import TYPE_CHECKING

import cv2
import numpy as np

from relicv2.jobs.lock import pid_alive
from relicv2.saliency.network.crf import dense_crf
from relicv2.saliency.network.images import resize_map, resize_square
from relicv2.shards.images import ImageLoadError, Rejection, load_scaled
from relicv2.shards.sample import MASK_MEMBER, MIN_MASK_COVERAGE, ShardSample
from relicv2.shards.writer import SampleRecord, sample_record

if TYPE_CHECKING:  # the workers import this module; the config module pulls in every handcrafted method
    from relicv2.saliency.network.config import CrfConfig

# zlib level 3 with run-length matching (Z_RLE): masks are smooth, so after PNG's row filters they are
# runs of equal bytes. Against the default strategy at level 3 on 256 px masks: ~40% less encoding time
# (the largest per-image cost of the job), -19% to +3% bytes. Level 3 was ~2x faster than 9 for ~10%
# more bytes. The decoded pixels do not depend on either setting.
PNG_COMPRESSION = 3
PNG_PARAMS = [cv2.IMWRITE_PNG_COMPRESSION, PNG_COMPRESSION, cv2.IMWRITE_PNG_STRATEGY, cv2.IMWRITE_PNG_STRATEGY_RLE]
# Batches in the ring at once: one being prepared, one in the network, one being finished (see
# build_masks.mask_shard for why three never collide).
RING_SLOTS = 3
SHM_FOLDER = "/dev/shm"  # where Linux keeps POSIX shared memory (a tmpfs; Docker's is 64 MiB by default)


@dataclass
class RawSample:
    key: str
    image: bytes
    label: int | None
    meta: dict
    ext: str = "jpg"  # the output member name of the image: jpg (for jpg and jpeg), png or webp
    carried: dict[str, bytes] = field(default_factory=dict)  # members no job reads: written unchanged


def prepare(sample: RawSample, size: int) -> tuple[np.ndarray, int, int] | Rejection:
    """(network input uint8 [S, S, 3], displayed width, height), or why the image is unusable (the
    loader's reason: not_an_image, truncated, corrupt, too_large ..., as `shards build` records them).

    The network sees a size x size image, so JPEGs are decoded at a reduced DCT scale (no side under
    `size`): decoding every pixel of a large photo would be wasted work. The mask is made at the
    full image's displayed size (EXIF orientation applied, as DALI's decoder applies it).
    """
    try:
        scaled = load_scaled(sample.image, sample.key, size)
    except ImageLoadError as error:
        return Rejection(error.reason, error.detail)
    return resize_square(scaled.rgb, size), scaled.width, scaled.height


def finish(sample: RawSample, probability: np.ndarray, width: int, height: int, *,
           crf: CrfConfig | None = None, square: np.ndarray | None = None) -> SampleRecord:
    """The output sample: original image bytes, the mask PNG at image size, coverage in the json. With
    `crf`, the probability is first refined by the dense CRF on the network's input `square`."""
    if crf is not None:
        probability = dense_crf(square, probability, crf)
    soft = resize_map(probability, width, height)
    coverage = np.count_nonzero(soft >= 0.5) / soft.size
    # In place (soft is this call's own array): the same float32 values as clip(rint(soft * 255)), without
    # three temporary maps per image.
    np.multiply(soft, 255.0, out=soft)
    np.rint(soft, out=soft)
    mask = np.clip(soft, 0, 255, out=soft).astype(np.uint8)
    png = cv2.imencode(".png", mask, PNG_PARAMS)[1]  # encoding a uint8 array does not fail
    meta = {**sample.meta, "width": width, "height": height, "mask_coverage": round(coverage, 6),
            "mask_status": "ok" if coverage >= MIN_MASK_COVERAGE else "below_min_coverage"}
    members = {**sample.carried, sample.ext: sample.image, MASK_MEMBER: png.tobytes()}
    return sample_record(ShardSample(sample.key, members, sample.label, meta))


@dataclass(frozen=True)
class RingSpec:
    """What a worker needs to attach to a job's ring: its shared-memory name and its shape."""

    name: str
    batch: int
    size: int


def ring_bytes(batch: int, size: int) -> int:
    """A ring's size: float32 probabilities [RING_SLOTS, B, S, S], then uint8 squares [RING_SLOTS, B, S, S, 3]."""
    return RING_SLOTS * batch * size * size * (4 + 3)


class RingSpaceError(ValueError):
    """The shared-memory folder has too little room for the ring."""


SHM_REMEDY = "lower --batch, or give the machine more shared memory (Docker: --ipc=host or --shm-size=16g)"


RING_PREFIX = "relicv2-masks"
# relicv2-masks-<pid>-<output folder tag>-<random>: who made a ring, and for which output folder.
RING_NAME = re.compile(re.escape(RING_PREFIX) + r"-(\d+)-([0-9a-f]{12}|none)-[0-9a-f]+")
# relicv2-masks-<pid>-<output folder tag>-semaphores: the named semaphores of that job's worker pool.
SEMAPHORES_NAME = re.compile(re.escape(RING_PREFIX) + r"-(\d+)-([0-9a-f]{12}|none)-semaphores")


def folder_tag(out: Path | None) -> str:
    """A short digest of the output folder a ring serves ("none" for a ring that serves none)."""
    return "none" if out is None else hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]


def remove_dead_rings(out: Path) -> None:
    """Remove the rings earlier jobs on `out` left on this host when they were killed with their whole
    process group (their resource tracker, which removes a killed job's ring and semaphores, went with
    them), and the semaphores their worker pools recorded. What belongs to a process that still runs
    (another rank of this job) is kept."""
    for path in Path(SHM_FOLDER).glob(f"{RING_PREFIX}-*-{folder_tag(out)}-*"):
        match = RING_NAME.fullmatch(path.name) or SEMAPHORES_NAME.fullmatch(path.name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        if SEMAPHORES_NAME.fullmatch(path.name):
            _unlink_semaphores(path)
        path.unlink(missing_ok=True)  # another rank of the job may have removed it first


def record_semaphores(pool: object, out: Path) -> SharedMemory | None:
    """Write the names of a spawned pool's named semaphores beside the job's ring, so that a later job
    can remove them if this one is killed with its resource tracker (`remove_dead_rings`). A shared
    block like the ring, so the tracker removes it with the semaphores when only the job dies. None
    when the pool has none or there is no shared-memory folder. `unlink()` it once the pool is shut down."""
    names = sorted(_semaphore_names(pool))
    if not names or not Path(SHM_FOLDER).is_dir():
        return None
    data = ("\n".join(names) + "\n").encode()
    record = SharedMemory(f"{RING_PREFIX}-{os.getpid()}-{folder_tag(out)}-semaphores", create=True, size=len(data))
    record.buf[: len(data)] = data
    record.close()  # the mapping; the block stays until unlinked
    return record


def _semaphore_names(pool: object) -> list[str]:
    # No public API lists them: multiprocessing names the POSIX semaphores of a spawned pool's two
    # queues (their locks and the call queue's bound) and leaves their unlinking to its resource
    # tracker; they are read off the queues here, and nothing is found where the layout differs.
    queues = (getattr(pool, "_call_queue", None), getattr(pool, "_result_queue", None))
    locks = (getattr(value, "_semlock", None) for q in queues if q is not None for value in vars(q).values())
    return [name for lock in locks if isinstance(name := getattr(lock, "name", None), str)]


def _unlink_semaphores(record: Path) -> None:
    import _multiprocessing  # sem_unlink: what the resource tracker itself calls for a semaphore

    for name in record.read_text().split():
        if re.fullmatch(r"/mp-[\w-]+", name):  # only names multiprocessing gives: the record is a file on a shared folder
            with contextlib.suppress(OSError):  # gone already
                _multiprocessing.sem_unlink(name)


def _reserve(name: str, nbytes: int) -> None:
    """Allocate a new block's pages now. The block is created sparse, and a page tmpfs cannot find
    later is a SIGBUS in whichever process touches it first (a worker, mid-job): refuse at start."""
    path = Path(SHM_FOLDER) / name
    if not hasattr(os, "posix_fallocate") or not path.exists():  # no /dev/shm tmpfs (not Linux): nothing to reserve
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        raise RingSpaceError(f"{SHM_FOLDER} cannot hold the {readable_size(nbytes)} build-masks needs for the batches in "
                             f"flight ({error.strerror}); {SHM_REMEDY}") from None
    finally:
        os.close(fd)


class SlotRing:
    """`RING_SLOTS` batches of network input (uint8 [B, S, S, 3]) and probabilities (float32
    [B, S, S]) in one shared-memory block. The job creates it; workers attach by name."""

    def __init__(self, memory: SharedMemory, spec: RingSpec):
        self.memory, self.spec = memory, spec
        self.page_locked = False  # set by the job when a GPU predictor page-locked the block for its DMA
        maps = (RING_SLOTS, spec.batch, spec.size, spec.size)
        # Probabilities first: their float32 rows stay 4-byte aligned whatever the batch and size.
        self._probabilities = np.ndarray(maps, np.float32, buffer=memory.buf)
        self._squares = np.ndarray((*maps, 3), np.uint8, buffer=memory.buf, offset=self._probabilities.nbytes)

    @classmethod
    def create(cls, batch: int, size: int, out: Path | None = None) -> SlotRing:
        """A new ring named after this process and the output folder `out` it serves (visible as such in
        /dev/shm while the job runs; `remove_dead_rings` finds it after a kill), and this process's ring
        of that name until released (the tasks the job runs itself, with no workers, find it). Its pages
        are reserved here: RingSpaceError when /dev/shm is too full (the job's check of the room for
        every rank of the node, `check_shm_space`, comes before it, but /dev/shm may have filled since)."""
        spec = RingSpec(f"{RING_PREFIX}-{os.getpid()}-{folder_tag(out)}-{secrets.token_hex(4)}", batch, size)
        memory = SharedMemory(spec.name, create=True, size=ring_bytes(batch, size))
        try:
            _reserve(memory.name, ring_bytes(batch, size))
        except BaseException:
            memory.close()
            memory.unlink()
            raise
        _rings[spec.name] = cls(memory, spec)
        return _rings[spec.name]

    @classmethod
    def attach(cls, spec: RingSpec) -> SlotRing:
        return cls(SharedMemory(spec.name), spec)

    def address(self) -> tuple[int, int]:
        """The block's start address and size, for page-locking it."""
        return self._probabilities.ctypes.data, self._probabilities.nbytes + self._squares.nbytes

    def squares(self, slot: int) -> np.ndarray:
        return self._squares[slot]

    def probabilities(self, slot: int) -> np.ndarray:
        return self._probabilities[slot]

    def release(self) -> None:
        """Remove the block (the job's ring, once its workers are gone). Its name goes at once; the
        memory goes with the last mapping."""
        _rings.pop(self.spec.name, None)
        self.memory.unlink()
        del self._probabilities, self._squares
        with contextlib.suppress(BufferError):  # a view still held by the caller (a predictor's result): the GC unmaps it later
            self.memory.close()


def readable_size(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps it at least 1, e.g. "512 KiB", "1 MiB", "1.5 GiB"
    (never a rounded "0 MiB")."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.4g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.4g} TiB"


def check_shm_space(nbytes: int, folder: str = SHM_FOLDER) -> None:
    """Refuse rings the shared-memory folder cannot hold, before the job writes anything (`nbytes`: the
    rings of every rank of the node). Each ring also reserves its pages when made (`SlotRing.create`),
    for a /dev/shm that filled in between."""
    try:
        stats = os.statvfs(folder)
    except (FileNotFoundError, AttributeError):  # no such tmpfs (not Linux): nothing to check against
        return
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise RingSpaceError(
            f"{folder} has {readable_size(free)} free but build-masks needs {readable_size(nbytes)} for "
            f"the batches in flight; {SHM_REMEDY}"
        )


_rings: dict[str, SlotRing] = {}  # the rings this process uses, by name: a worker attaches once per job


def _ring(spec: RingSpec) -> SlotRing:
    if spec.name not in _rings:
        _rings[spec.name] = SlotRing.attach(spec)
    return _rings[spec.name]


def prepare_chunk(spec: RingSpec, slot: int, start: int, samples: list[RawSample]) -> list[tuple[int, int] | Rejection]:
    """`prepare` for a run of samples: each square goes into the slot at `start` + its position; the
    result is (width, height) per sample, or its Rejection (its place in the slot is left unused)."""
    squares = _ring(spec).squares(slot)
    results: list[tuple[int, int] | Rejection] = []
    for position, sample in enumerate(samples, start):
        prepared = prepare(sample, spec.size)
        if not isinstance(prepared, Rejection):
            squares[position], prepared = prepared[0], prepared[1:]
        results.append(prepared)
    return results


def finish_chunk(spec: RingSpec, slot: int, start: int, ready: list[tuple[RawSample, int, int]],
                 crf: CrfConfig | None = None, squares_at: Sequence[int] = ()) -> list[SampleRecord]:
    """`finish` for a run of (sample, width, height) whose probability maps are in the slot from `start`;
    with `crf`, their network inputs are in the slot at `squares_at` (rejected samples leave gaps there)."""
    ring = _ring(spec)
    probabilities, squares = ring.probabilities(slot), ring.squares(slot)
    return [finish(sample, probabilities[start + i], width, height, crf=crf,
                   square=squares[squares_at[i]] if crf is not None else None)
            for i, (sample, width, height) in enumerate(ready)]


def init_worker() -> None:
    """One thread per worker: the workers are the parallelism (OpenCV's own pool in every worker only
    adds contention; a 432 px resize costs twice the CPU on two OpenCV threads)."""
    cv2.setNumThreads(1)
