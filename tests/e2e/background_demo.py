"""The reduced demo, started in the background when the session begins and awaited by the tests that
look at its output.

It is the longest single test (about a minute of mostly one-core subprocesses: every stage of the
chain), so it runs beside the rest of the suite instead of after it; the demo tests are moved to the
end of the run, by which time it has finished.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.paths import REPO

DEMO_TESTS = "tests/e2e/test_demo.py"
TIMEOUT_S = 900


def demo_command(out: Path) -> tuple[list[str], dict[str, str]]:
    """The reduced demo's command line and environment, writing into `out`."""
    env = dict(os.environ, PYTHONPATH=str(REPO), DEMO_REDUCED="1", DEMO_OUT=str(out),
               RELICV2_INDEX_CACHE=str(out.parent / "index-cache"))
    return ["bash", str(REPO / "scripts" / "demo.sh"), sys.executable], env


def run_demo(out: Path) -> subprocess.CompletedProcess:
    """The reduced demo run to its end in the foreground; on a timeout its whole process group is
    killed (not only bash) before `subprocess.TimeoutExpired` propagates."""
    command, env = demo_command(out)
    with subprocess.Popen(command, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


class BackgroundDemo:
    """One run of the reduced demo in a temporary folder: `start()`, then `result()` waits for it."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.process: subprocess.Popen | None = None

    @property
    def out(self) -> Path:
        assert self.folder is not None, "the background demo was not started"
        return self.folder / "demo-out"

    def start(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="relicv2-test-demo-"))
        command, env = demo_command(self.out)
        with open(self.folder / "stdout", "wb") as stdout, open(self.folder / "stderr", "wb") as stderr:
            # Its own process group, so that stop() ends the stage running under bash too, not only bash.
            self.process = subprocess.Popen(command, cwd=self.folder, env=env, stdout=stdout, stderr=stderr,
                                            start_new_session=True)

    def result(self) -> subprocess.CompletedProcess:
        """The finished run (started here if the session did not start it)."""
        if self.process is None:
            self.start()
        assert self.process is not None and self.folder is not None
        code = self.process.wait(timeout=TIMEOUT_S)
        read = lambda name: (self.folder / name).read_text(errors="replace")  # noqa: E731
        return subprocess.CompletedProcess(self.process.args, code, read("stdout"), read("stderr"))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


DEMO = BackgroundDemo()
