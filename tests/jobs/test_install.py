"""The project installed from its wheel into a fresh environment outside the clone runs presets by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.paths import REPO

PACKAGES = ("jobs", "shards", "saliency", "pretrain", "cli")


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
def test_the_installed_project_runs_presets_by_name_from_any_directory(tmp_path):
    # The sources that make the distribution, copied so that the build leaves nothing in the clone.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    # Without pip of its own: pip and setuptools (the build backend) come with the dependencies below.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp_path, dict(os.environ)).stdout.strip())
    # The runtime dependencies come from the environment running the tests (installing them would
    # need the network); the project itself only from the new environment's own site-packages
    # (the paths of a .pth file come after it, and .pth files inside them are not run).
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "outer-dependencies.pth").write_text("\n".join(sorted(outer)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(source)],
         tmp_path, env)
    shutil.rmtree(source)  # nothing may be read from a checkout any more
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(python), "-c", "import cli, jobs, pretrain; print(cli.__file__, pretrain.__file__)"],
                 work, env).stdout
    assert all(path.startswith(str(purelib)) for path in where.split()), where

    relicv2 = str(venv / "bin" / "relicv2")
    printed = _run([relicv2, "pretrain", "--config", "imagenette-r18-cpu", "--print-config"], work, env).stdout
    tree = yaml.safe_load(printed)
    assert tree["model"]["depth"] == 18 and tree["data"]["train_shards"] == "runs/imagenette/train"
    unknown = subprocess.run([relicv2, "pretrain", "--config", "nope"], cwd=work, env=env, capture_output=True,
                             text=True, timeout=300)
    assert unknown.returncode == 1 and "presets: demo-cpu (" in unknown.stderr, unknown.stderr
    missing = subprocess.run([relicv2, "saliency", "train", "--shards", "s", "--out", "o", "--backbone", "random"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "tiny (Seconds" in missing.stderr, missing.stderr
    shipped = _run([str(python), "-c", "from pretrain.eval.job import load_finetune_config, load_linear_config; "
                    "print(load_linear_config('fast').protocol, load_finetune_config('10pct').batch_size)"],
                   work, env).stdout
    assert shipped.split() == ["fast", "512"]
    assert sorted(p.name for p in work.iterdir()) == []
