"""Two rank processes kept for a whole test session (the `rank_pair` fixture of tests/conftest.py).

A 2-rank test used to spawn a pair of processes of its own (`torch.multiprocessing.spawn`), and each of them
imported torch, torchvision and the test's module again: seconds of start-up per process for jobs of about
as long. `RankPair.run(function, *args)` calls `function(rank, *args)` in both processes, as `spawn` does,
and raises with the rank's traceback when one of them fails; the pair is then replaced for the next test.
Each job sets up and tears down its own process group, and the processes' environment is restored after it.
A test that measures a process-wide figure (the peak RSS, a high-water mark) still needs fresh processes.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

WORLD_SIZE = 2


def _serve(rank: int, jobs: multiprocessing.Queue, done: multiprocessing.Queue) -> None:
    """One rank: run the jobs as they come (None ends it); put None or the traceback for each."""
    while (job := jobs.get()) is not None:
        function, args = job
        environment = dict(os.environ)
        try:
            function(rank, *args)
            done.put(None)
        except BaseException:  # whatever the job raised (an assertion, SystemExit) goes to the test, as spawn's does
            done.put(traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(environment)


class RankPair:
    """`WORLD_SIZE` spawned processes, started on the first `run`."""

    def __init__(self) -> None:
        self._processes: list[multiprocessing.Process] = []
        self._jobs: list[multiprocessing.Queue] = []
        self._done: list[multiprocessing.Queue] = []

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._jobs = [context.Queue() for _ in range(WORLD_SIZE)]
        self._done = [context.Queue() for _ in range(WORLD_SIZE)]
        # Not daemonic, as spawn's processes: a job may start processes of its own (loader workers).
        self._processes = [context.Process(target=_serve, args=(rank, self._jobs[rank], self._done[rank]))
                           for rank in range(WORLD_SIZE)]
        for process in self._processes:
            process.start()
        atexit.register(self.close)  # before multiprocessing's own exit handler joins them

    def run(self, function: Callable[..., Any], *args: Any, timeout: float = 900) -> None:
        """`function(rank, *args)` in every rank, to its end; AssertionError naming the rank that failed."""
        if not self._processes:
            self._start()
        for jobs in self._jobs:
            jobs.put((function, args))
        deadline = time.monotonic() + timeout
        for rank in range(WORLD_SIZE):
            error = self._answer(rank, deadline)
            if error is not None:
                self.close(kill=True)  # the other rank may wait in a collective for this one
                raise AssertionError(f"{function.__name__} failed on rank {rank} of {WORLD_SIZE}:\n{error}")

    def _answer(self, rank: int, deadline: float) -> str | None:
        """None when rank `rank` finished its job, else why not (its traceback, its death, the deadline)."""
        while True:
            try:
                return self._done[rank].get(timeout=1)
            except queue.Empty:
                if not self._processes[rank].is_alive():
                    return f"the process died (exit code {self._processes[rank].exitcode})"
                if time.monotonic() > deadline:
                    return "no answer before the deadline"

    def close(self, *, kill: bool = False) -> None:
        """End the processes; `kill` them at once after a failure (a rank may be stuck in a collective)."""
        for process, jobs in zip(self._processes, self._jobs, strict=True):
            if process.is_alive() and not kill:
                jobs.put(None)
        for process in self._processes:
            process.join(timeout=0 if kill else 30)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._jobs, self._done = [], [], []
        atexit.unregister(self.close)
