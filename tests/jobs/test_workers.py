"""The shared process pool: its workers never see a Ctrl-C meant for the job, not even while they start."""

from __future__ import annotations

import signal

import pytest

from relicv2.jobs.workers import worker_pool


def _blocked_signals() -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_start_with_ctrl_c_blocked_and_the_job_keeps_it(start_method) -> None:
    """SIGINT is blocked in a worker from its first instruction (before its imports, where a Ctrl-C would
    print a KeyboardInterrupt traceback from it), and the job's own mask is as it was."""
    before = _blocked_signals()
    with worker_pool(2, start_method=start_method) as pool:
        blocked = [pool.submit(_blocked_signals).result() for _ in range(2)]
    assert all(signal.SIGINT in mask for mask in blocked)
    assert _blocked_signals() == before and signal.SIGINT not in before
