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

from tests.paths import REPO, package_dirs, setuptools_table


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
    for folder in package_dirs().values():
        shutil.copytree(folder, source / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
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
    # One interpreter for both questions (each costs torch's import): where the modules come from, and that the
    # shipped evaluation presets load by name.
    where, shipped = _run([str(python), "-c", "import relicv2.cli, relicv2.pretrain.run as r; print(relicv2.cli.__file__, "
                           "r.__file__); from relicv2.evaluation.job import load_finetune_config, load_linear_config; "
                           "print(load_linear_config('fast').protocol, load_finetune_config('10pct').batch_size)"],
                          work, env).stdout.splitlines()
    assert all(path.startswith(str(purelib)) for path in where.split()), where
    # One installed top-level name: the wheel's record lists files under relicv2/ (and its metadata) only.
    record = next(purelib.glob("relicv2-*.dist-info")) / "RECORD"
    tops = {line.split("/")[0].split(",")[0] for line in record.read_text().splitlines()}
    assert {top for top in tops if not top.endswith(".dist-info") and top != ".."} == {"relicv2"}, tops
    assert (purelib / "relicv2" / "evaluation" / "presets" / "linear" / "fast.yaml").is_file()
    for data in ("presets/robustness/quick.yaml", "classlists/imagenet.txt", "classlists/imagenet-r.txt",
                 "classlists/imagenet-a.txt"):  # the robustness presets and the out-of-distribution class lists
        assert (purelib / "relicv2" / "evaluation" / data).is_file(), data
    help_text = _run([str(python), "-m", "relicv2", "--help"], work, env).stdout
    assert "saliency" in help_text and "eval" in help_text

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
    assert shipped.split() == ["fast", "512"]
    assert sorted(p.name for p in work.iterdir()) == []


def test_every_package_folder_is_listed_for_the_wheel():
    """The wheel's package list is explicit (package-dir maps folders under the namespace): a new
    sub-package left out of it would be missing from every installed copy, and a folder of presets left out
    is warned about at every install (Python sees it as a package)."""
    listed = set(setuptools_table()["packages"])
    found = set()
    for name, folder in package_dirs().items():
        for sub in [folder, *folder.rglob("*")]:
            if sub.is_dir() and sub.name.isidentifier() and sub.name != "__pycache__" and any(
                    path.is_file() for path in sub.iterdir()):
                found.add(".".join([name, *sub.relative_to(folder).parts]))
    assert found == listed, (sorted(found - listed), sorted(listed - found))


def test_a_benchmark_runs_from_a_source_tree_that_is_not_installed(tmp_path):
    """`PYTHONPATH=.` in a clone: `relicv2` is the clone's folder and its stages its siblings. The tree is
    copied, and this environment's editable-install finder dropped, so nothing installed can answer."""
    for folder in package_dirs().values():
        shutil.copytree(folder, tmp_path / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "benchmarks", tmp_path / "benchmarks", ignore=shutil.ignore_patterns("*.png", "*.md"))
    drop_installed = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                      "sys.argv = ['bench_loss.py', '--batch', '8', '--dim', '16', '--negatives', '2', '--repeats', '1', "
                      "'--naive-repeats', '1']; import relicv2.pretrain.loss as loss; print('FROM', loss.__file__); "
                      "runpy.run_path('benchmarks/bench_loss.py', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": "."}
    done = _run([sys.executable, "-c", drop_installed], tmp_path, env).stdout
    assert f"FROM {tmp_path / 'pretrain' / 'loss.py'}" in done, done
    assert "results agree: True" in done, done
