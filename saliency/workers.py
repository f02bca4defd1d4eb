"""Worker processes that end with their parent, and one core per computation.

A killed job (``kill -9``, an OOM kill, a pre-empted node) must not leave its worker processes
computing forever: each worker watches its parent and exits as soon as it is gone. Kept free of
heavy imports so that it costs nothing in a worker that is only starting.

The handcrafted methods work on matrices of a few hundred rows: BLAS and OpenMP threads cost
more than they give there, and on a busy machine they oversubscribe the cores (the saliency
tests ran 6x slower with default threading under load). Every computation runs single-threaded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this process once ``parent_pid`` is no longer its parent.

    Polling ``getppid`` works on every POSIX system (the orphan is re-parented to init or a
    subreaper); ``os._exit`` because the main thread may be deep inside a computation.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """BLAS, OpenMP and OpenCV limited to one thread inside the block (restored after it)."""
    import cv2
    from threadpoolctl import threadpool_limits

    previous = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        with threadpool_limits(1):
            yield
    finally:
        cv2.setNumThreads(previous)


def init_worker(parent_pid: int) -> None:
    """``ProcessPoolExecutor`` initializer: one thread per worker, exit when the parent dies."""
    exit_with_parent(parent_pid)
    # One worker = one core: keep BLAS/OpenCV from spawning threads that fight each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    import cv2
    from threadpoolctl import threadpool_limits

    cv2.setNumThreads(1)
    threadpool_limits(1)
