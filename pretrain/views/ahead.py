"""Batches made ahead in a background thread, so the view pipeline overlaps the training step.

`ViewLoader` describes its batches as an endless stream of `Made` items, each with the loader position
*after* it, which the loader applies when it delivers the batch: a checkpoint describes the last batch
delivered, not the last one made.

On a GPU the thread queues its work (DALI's copies out, the torch colour stage) on a CUDA stream of
its own; the consumer's stream waits for each batch's event, and the views are marked as used there
so the caching allocator does not hand their memory back to the thread's stream too early.

Hand-written: torch's DataLoader prefetches from worker processes, but the DALI backend must run in
this process (its pipeline owns the GPU work and the reader state), and no library thread pool keeps
an ordered, bounded queue that forwards the producer's errors and stops with its owner.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

POLL_S = 0.5  # how often a blocked producer or consumer checks that the other side is still there


@dataclass(frozen=True)
class Position:
    """Where the loader stands after an item: what `ViewLoader.state_dict` saves."""

    epoch: int
    batch_in_epoch: int
    backend_state: dict[str, Any]
    excluded: dict[str, str] = field(default_factory=dict)


@dataclass
class Made:
    """One item of the stream: a finished batch (None at an epoch's end) and the position after it."""

    batch: dict[str, Any] | None
    position: Position
    unreadable: int = 0
    ready: torch.cuda.Event | None = None  # recorded on the producer's stream after the batch's work


def ahead(items: Iterator[Made], depth: int, device: str) -> Iterator[Made]:
    """`items` made `depth` ahead in a background thread; with depth 0, made on demand in the caller's.

    Either way a failure is raised in the caller's thread, and again on every later call (the
    stream cannot go on after it: its position would no longer match the backend's).
    """
    return _Ahead(items, depth, device) if depth > 0 else _OnDemand(items)


def stop(items: Iterator[Made] | None) -> None:
    """Stop the thread making `items` (when `ahead` gave them one) and drop what it made."""
    if isinstance(items, _Ahead):
        items._finalizer()  # also run when the stream is collected


class _OnDemand(Iterator[Made]):
    """`items` made in the consumer's thread when asked for."""

    def __init__(self, items: Iterator[Made]) -> None:
        self._items = items
        self._failure: BaseException | None = None

    def __next__(self) -> Made:
        if self._failure is not None:
            raise self._failure
        try:
            return next(self._items)
        except BaseException as error:  # not handled here: remembered, and raised again on later calls
            self._failure = error
            raise


class _Ahead(Iterator[Made]):
    """The consumer's end of the thread; the thread stops when this object is collected."""

    def __init__(self, items: Iterator[Made], depth: int, device: str) -> None:
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        # The thread gets no reference to this object, so dropping the loader stops it.
        self._thread = threading.Thread(target=_fill, args=(items, self._queue, self._stop, self._device),
                                        name="relicv2-views-ahead", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop, self._queue, self._thread)

    def __next__(self) -> Made:
        if self._failure is not None:
            raise self._failure
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the view loader's background thread stopped without a batch") from None
        if isinstance(item, BaseException):  # the producer's failure
            self._failure = item
            raise item
        if item.ready is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(item.ready)
            for view in item.batch["views"] if item.batch is not None else []:
                view.record_stream(stream)
        return item


def _fill(items: Iterator[Made], out: queue.Queue, stop: threading.Event, device: torch.device) -> None:
    stream = None
    if device.type == "cpu":
        # The trainer's intra-op threads already use every core; a second team of them here only
        # oversubscribes (torch's thread count is per thread, so the trainer keeps its own).
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a new thread starts on GPU 0, not on its rank's GPU
        stream = torch.cuda.Stream(device)
    try:
        while not stop.is_set():
            with torch.cuda.stream(stream):  # a no-op for None (a CPU)
                item = next(items)
                if stream is not None:
                    item.ready = stream.record_event()
            _put(out, item, stop)
    except BaseException as error:  # not handled here: forwarded, and raised in the consumer's thread
        _put(out, error, stop)


def _put(out: queue.Queue, item: Made | BaseException, stop: threading.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            out.put(item, timeout=POLL_S)
            return


def _stop_thread(stop: threading.Event, out: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    if threading.current_thread() is thread:  # collected by a garbage collection the thread itself ran
        return  # it ends after the item in hand
    while thread.is_alive():  # it may be blocked on a full queue or inside a pipeline run
        with contextlib.suppress(queue.Empty):
            while True:
                out.get_nowait()
        thread.join(timeout=POLL_S)
