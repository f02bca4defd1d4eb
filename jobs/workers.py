"""Process pools whose workers exit when their parent dies (a `kill -9` of the job leaves no orphans):
each worker asks Linux for SIGKILL when its parent exits (prctl PR_SET_PDEATHSIG) and, everywhere, polls
its parent's pid once a second. Every job's pool is a :func:`worker_pool`.

Ctrl-C reaches every process of the terminal's group: the workers ignore it and the job handles it (one
line, exit 130); an idle worker would otherwise print a KeyboardInterrupt traceback of its own.

BLAS, OpenMP and OpenCV threads cost more than they give on the handcrafted methods' small arrays and
oversubscribe the cores (the saliency tests ran 6x slower under load): a job's computations run one
thread each (:func:`single_threaded`, :func:`one_thread`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)  # the parent is gone: nobody will read our results
        time.sleep(POLL_S)


def worker_died(doing: str | None = None, kept: str = "what it finished is kept") -> str:
    """The one line for a job whose worker process died (the kernel's out-of-memory killer, say)."""
    during = f" while {doing}" if doing else ""
    return (f"a worker process died{during} (killed by the system for memory? see dmesg); {kept}: rerun the same "
            "command to resume")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask under SLURM or taskset; all elsewhere)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_ranks(env: Mapping[str, str] | None = None) -> int:
    """How many ranks torchrun started on this node (LOCAL_WORLD_SIZE); 1 outside torchrun."""
    env = os.environ if env is None else env
    return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))


def rank_cores(env: Mapping[str, str] | None = None) -> int:
    """This process's share of the usable cores when torchrun starts LOCAL_WORLD_SIZE ranks per node
    (they usually share one affinity mask); all of them outside torchrun."""
    return max(1, usable_cores() // local_ranks(env))


def _initialize(parent: int, initializer: Callable[..., object] | None, initargs: tuple) -> None:
    """In each worker: exit when process `parent` (the job) dies, leave Ctrl-C to the job, then `initializer`."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no usable libc: the polling thread covers it
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle (see the module docstring)
    if initializer is not None:
        initializer(*initargs)


class _Pool(cf.ProcessPoolExecutor):
    """A pool that, left by an exception (Ctrl-C, a failed task), cancels the work not yet started
    instead of running all of it first; the workers finish the tasks in hand and exit."""

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.shutdown(wait=True, cancel_futures=exc_type is not None)

    def _spawn_process(self) -> None:
        # A terminal's Ctrl-C goes to the whole process group: a worker still importing its modules, before
        # `_initialize` ignores SIGINT, would die with a KeyboardInterrupt traceback. Blocked in this thread
        # while the worker starts, SIGINT is blocked in the worker from its first instruction (the signal
        # mask survives fork and exec); here, one that arrived meanwhile is delivered once it is unblocked.
        # (`_spawn_process` is the one place the executor starts a worker, since Python 3.9.)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super()._spawn_process()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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


def one_thread() -> None:
    """Worker initializer: BLAS, OpenMP and OpenCV on one thread for the worker's life (one worker, one core)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import cv2
    from threadpoolctl import threadpool_limits

    cv2.setNumThreads(1)
    threadpool_limits(1)


def worker_pool(workers: int, *, start_method: str | None = None,
                initializer: Callable[..., object] | None = None,
                initargs: tuple = ()) -> cf.ProcessPoolExecutor:
    """A process pool of `workers` processes that exit with the calling process. Default start method: fork
    where available (workers start in milliseconds and do not re-import the CLI and torch); pass "spawn" when
    the parent runs thread pools (BLAS, OpenCV) that a fork could deadlock. `initializer(*initargs)` runs in
    each worker after the parent watch is set up."""
    start_method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    return _Pool(workers, mp_context=multiprocessing.get_context(start_method), initializer=_initialize,
                 initargs=(os.getpid(), initializer, initargs))
