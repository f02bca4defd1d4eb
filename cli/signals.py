"""SIGINT and SIGTERM to a job's main process: its workers end, then the job, within seconds.

Schedulers, `timeout` and `kill` signal the main process only, so its worker processes never see
the signal. The handler ends them first (terminate, then kill), so no pool waits on work that will
never finish, and then raises in the main thread so that the job's `finally` blocks (locks,
temporary files) run. A watchdog ends the process if anything still waits after `GRACE_S`.
Python ignores an exception raised where a handler happens to run inside a fork hook or a `__del__`,
so the signal is also recorded: it decides the exit code and the line whatever the job made of it.
The pretraining loop replaces these handlers while it steps: it checkpoints, then stops.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as a shell reports it
GRACE_S = 10.0  # after the signal, the longest the job's own cleanup may take
WORKER_GRACE_S = 2.0  # a terminated worker that is still alive after this is killed

LINES = {
    signal.SIGINT: "interrupted (Ctrl-C): finished work is kept; rerun the same command to continue",
    signal.SIGTERM: "terminated (SIGTERM): finished work is kept; rerun the same command to continue",
}


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt is for SIGINT: no `except Exception` keeps it)."""


class _State:
    main_pid: int | None = None  # the process that installed the handlers (forked workers inherit them)
    received: signal.Signals | None = None
    reported = False


def install() -> None:
    """Handle SIGINT and SIGTERM in this (main) process, even where the parent left them ignored."""
    _State.main_pid = os.getpid()
    for signum in EXIT_CODES:
        signal.signal(signum, _handle)


def received() -> signal.Signals | None:
    return _State.received


def stop(signum: signal.Signals) -> int:
    """End the workers, print the job's one line about `signum` (once), and return its exit code."""
    end_workers()
    if not _State.reported:
        _State.reported = True
        print(f"\n{LINES[signum]}", file=sys.stderr, flush=True)
    return EXIT_CODES[signum]


def _handle(signum: int, frame: object) -> None:
    if os.getpid() != _State.main_pid:  # a forked worker: end as if no handler were installed
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # No further signal interrupts the cleanup below; the watchdog bounds it.
    for other in EXIT_CODES:
        signal.signal(other, signal.SIG_IGN)
    _State.received = signal.Signals(signum)
    watchdog = threading.Timer(GRACE_S, _expire, args=(EXIT_CODES[_State.received],))
    watchdog.daemon = True
    watchdog.start()
    end_workers()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated


def end_workers(grace_s: float = WORKER_GRACE_S) -> None:
    """Terminate this process's worker processes, kill those still alive after `grace_s`."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(grace_s / max(len(children), 1))
        if child.is_alive():
            child.kill()
            child.join(1.0)


def _expire(code: int) -> None:
    print(f"the job did not stop within {GRACE_S:.0f} s of the signal; exiting now", file=sys.stderr, flush=True)
    end_workers(0.5)
    os._exit(code)
