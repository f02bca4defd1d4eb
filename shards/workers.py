"""Process pools whose workers exit when their parent dies (a `kill -9` of the job leaves no orphans).

Linux: each worker asks the kernel for SIGKILL when its parent exits (prctl PR_SET_PDEATHSIG).
Everywhere: a daemon thread in each worker also polls its parent pid once a second and exits when
the parent is gone, so the pool never outlives the job. Saliency and any other job's pool can use
:func:`worker_pool` too.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)  # the parent is gone: nobody will read our results
        time.sleep(POLL_S)


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


def die_with_parent(parent: int) -> None:
    """Worker initializer: exit when process `parent` (the job) dies."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no usable libc: the polling thread still covers it
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="parent-watch").start()


def _initialize(parent: int, initializer: Callable[..., object] | None, initargs: tuple) -> None:
    die_with_parent(parent)
    if initializer is not None:
        initializer(*initargs)


def worker_pool(
    workers: int,
    *,
    start_method: str | None = None,
    initializer: Callable[..., object] | None = None,
    initargs: tuple = (),
) -> cf.ProcessPoolExecutor:
    """A process pool of `workers` processes that exit with the calling process.

    Default start method: fork where available (workers start in milliseconds and do not re-import
    the CLI and torch); pass "spawn" when the parent runs thread pools (BLAS, OpenCV) that a fork
    could deadlock. `initializer(*initargs)` runs in each worker after the parent watch is set up.
    """
    if start_method is None:
        start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return cf.ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(start_method),
        initializer=_initialize,
        initargs=(os.getpid(), initializer, initargs),
    )
