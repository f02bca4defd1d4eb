"""Fuzzing `import-official`'s reader: random opcode streams and calls over its globals (and forbidden
ones), and mutated valid releases, read in a process of its own (`official_fuzz`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.paths import REPO

CASES = 3000


@pytest.mark.slow
def test_random_release_pickles_never_crash_run_code_or_outgrow_the_file(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tests.evaluation.official_fuzz", "--cases", str(CASES),
                           "--seed", "0", "--dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (f"exit status {done.returncode} (-11: a segmentation fault; the case is left "
                                  f"in {tmp_path / 'case.pkl'})\n{lines[-1:]}\n{done.stderr[-3000:]}")
    summary = json.loads(lines[-1])
    assert summary["cases"] == CASES and summary["refused"] + summary["imported"] == CASES
    assert not (tmp_path / "ran").exists()
