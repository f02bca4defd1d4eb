"""`relicv2 saliency handcrafted` under hostile keys, a second job, kills, full disks."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import relicv2.saliency.batch as batch
from relicv2.cli.saliency import saliency_group
from relicv2.jobs.lock import folder_lock
from relicv2.saliency.images import map_path, write_map
from relicv2.shards.keys import UnsafeKeyError
from relicv2.shards.manifest import write_manifest
from tests.paths import REPO
from tests.scenes import synthetic_scene


def _jpeg(seed: int, height: int = 48, width: int = 64) -> bytes:
    rgb, _ = synthetic_scene(height, width, seed=seed)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _tar(path: Path, names: list[str]) -> Path:
    """A shard holding one JPEG per member name, names as given (hostile ones included)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for seed, name in enumerate(names):
            data = _jpeg(seed)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _images(folder: Path, count: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.fromarray(synthetic_scene(48, 64, seed=i)[0]).save(folder / f"img{i}.png")
    return folder


def _run(*args: str):
    return CliRunner().invoke(saliency_group, ["handcrafted", "--no-progress", *args])


def test_keys_that_leave_the_output_folder_are_rejected_samples(tmp_path):
    outside = tmp_path / "outside"
    shard = _tar(
        tmp_path / "shards" / "images-000000.tar",
        ["good.jpg", "../../escape.jpg", f"{outside}/abs.jpg", "sub/dir/nested.jpg"],
    )
    out = tmp_path / "run" / "maps"
    result = _run("--method", "mc", "--input", str(shard.parent), "--output", str(out))
    assert result.exit_code == 1, result.output  # two samples lost: over the default limit
    assert "2 failed" in result.output and "refused by the shard reader" in result.output
    assert "'../../escape.jpg'" in result.output and "absolute" in result.output
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert written == ["mc/good.png", "mc/sub/dir/nested.png"]
    assert not outside.exists() and not list(tmp_path.glob("**/escape.png"))
    with pytest.raises(UnsafeKeyError):
        map_path(out, "mc", "a/../../b")


def test_a_second_job_on_the_same_output_is_refused(tmp_path):
    images, out = _images(tmp_path / "images"), tmp_path / "out"
    with folder_lock(out, "another job"):
        result = _run("--method", "mc", "--input", str(images), "--output", str(out))
    assert result.exit_code == 1 and "in use by 'another job'" in result.output
    assert "Traceback" not in result.output and not (out / "mc").exists()
    assert _run("--method", "mc", "--input", str(images), "--output", str(out)).exit_code == 0
    assert not (out / ".relicv2.lock").exists()  # released at the end


def test_stale_temporaries_of_a_killed_run_are_removed_and_counted(tmp_path):
    images, out = _images(tmp_path / "images"), tmp_path / "out"
    (out / "mc" / "sub").mkdir(parents=True)
    stale = [out / "mc" / ".img0.png.tmp-somehost-123", out / "mc" / "sub" / ".x.k2j3.png.tmp"]
    for path in stale:
        path.write_bytes(b"half a png")
    keep = [out / "mc" / "notes.txt", out / "mc" / ".hidden", out / "other" / ".y.png.tmp-h-1"]
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not ours")
    result = _run("--method", "mc", "--input", str(images), "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "removed 2 temporary file(s)" in result.output
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)


def test_a_map_that_cannot_be_written_fails_that_input_only(tmp_path, monkeypatch):
    images, out = _images(tmp_path / "images"), tmp_path / "out"

    def refuse_img1(path, saliency):
        if Path(path).stem == "img1":
            raise PermissionError(errno.EACCES, "Permission denied")
        write_map(path, saliency)

    monkeypatch.setattr(batch, "write_map", refuse_img1)
    result = _run("--method", "mc", "--input", str(images), "--output", str(out))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"cannot write {out / 'mc' / 'img1.png'}: Permission denied" in result.output
    assert sorted(p.name for p in (out / "mc").iterdir()) == ["img0.png", "img2.png"]


def test_a_full_disk_stops_the_job_cleanly_and_the_rerun_completes(tmp_path, monkeypatch):
    images, out = _images(tmp_path / "images", 4), tmp_path / "out"
    real_write = batch.write_map
    calls = []

    def full_after_two(path, saliency):
        calls.append(path)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, saliency)

    monkeypatch.setattr(batch, "write_map", full_after_two)
    result = _run("--method", "mc", "--input", str(images), "--output", str(out))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "No space left on device" in result.output and "full or read-only" in result.output
    assert len(calls) == 3  # stopped at the first full-disk error, not one error per input
    assert sorted(p.name for p in (out / "mc").iterdir()) == ["img0.png", "img1.png"]
    monkeypatch.setattr(batch, "write_map", real_write)
    rerun = _run("--method", "mc", "--input", str(images), "--output", str(out))
    assert rerun.exit_code == 0 and "2 already complete" in rerun.output
    assert len(list((out / "mc").iterdir())) == 4


def test_an_output_folder_that_cannot_be_created_is_one_clear_error(tmp_path):
    images = _images(tmp_path / "images")
    blocker = tmp_path / "file"
    blocker.write_text("a file where the output folder should go")
    result = _run("--method", "mc", "--input", str(images), "--output", str(blocker / "out"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"cannot use the output folder {blocker / 'out'}" in result.output


def test_maps_take_the_umask_mode_and_writes_are_atomic(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        write_map(tmp_path / "m.png", np.full((4, 5), 0.5, np.float32))
    finally:
        os.umask(old)
    assert (tmp_path / "m.png").stat().st_mode & 0o777 == 0o644
    before = (tmp_path / "m.png").read_bytes()

    def broken_save(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken_save)
    with pytest.raises(OSError):
        write_map(tmp_path / "m.png", np.zeros((4, 5), np.float32))
    assert (tmp_path / "m.png").read_bytes() == before  # the final name keeps a whole map
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"]  # no temporary left


def test_progress_total_and_lost_samples_come_from_the_manifest(tmp_path):
    shards_dir = tmp_path / "shards"
    _tar(shards_dir / "images-000000.tar", ["s0.jpg", "s1.jpg"])
    rows = [{"key": f"s{i}", "shard": "images-000000.tar", "position": i} for i in range(3)]
    write_manifest(rows, shards_dir)  # lists a third sample the tar no longer holds
    assert batch.count_inputs(shards_dir) == 3
    assert batch.count_inputs(shards_dir / "images-000000.tar") == 3
    assert batch.count_inputs(shards_dir / "images-{000000..000000}.tar") == 3  # a pattern of the set's tars
    result = CliRunner().invoke(
        saliency_group, ["handcrafted", "--method", "mc", "--input", str(shards_dir), "--output", str(tmp_path / "o")]
    )
    assert "/3" in result.output  # the bar has its total
    assert "1 listed in the manifest but not read" in result.output and result.exit_code == 1
    lenient = CliRunner().invoke(
        saliency_group,
        ["handcrafted", "--method", "mc", "--input", str(shards_dir), "--output", str(tmp_path / "o"),
         "--no-progress", "--max-failures", "1"],
    )
    assert lenient.exit_code == 0, lenient.output


_ORPHAN_SCRIPT = """
import os, sys, time
from relicv2.jobs.workers import one_thread, worker_pool

if __name__ == "__main__":
    pool = worker_pool(1, start_method="spawn", initializer=one_thread)
    print(pool.submit(os.getpid).result(), flush=True)
    pool.submit(time.sleep, 120)
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to watch the worker")
def test_workers_exit_when_the_parent_is_killed(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        worker = int(parent.stdout.readline())
        assert _running(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()


def test_a_truncated_shard_is_lost_data_not_success(tmp_path):
    shards_dir = tmp_path / "shards"
    tar = _tar(shards_dir / "images-000000.tar", ["s0.jpg", "s1.jpg", "s2.jpg"])
    write_manifest([{"key": f"s{i}", "shard": tar.name, "position": i} for i in range(3)], shards_dir)
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2])  # a copy cut short: the first sample survives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reader may also warn about the unreadable rest
        result = _run("--method", "mc", "--input", str(shards_dir), "--output", str(tmp_path / "o"))
    assert result.exit_code == 1, result.output
    # the cut-off sample is named as lost (a refused member, or a manifest entry not read)
    assert "1 failed" in result.output or "listed in the manifest but not read" in result.output
    assert "images-000000.tar" in result.output
    assert "every input failed" not in result.output


def test_a_truncated_plain_tar_without_a_manifest_is_lost_data_not_success(tmp_path):
    """No manifest says how many samples the cut-off part held: the shard read in part is a loss of its own,
    counted against --max-failures (default 0) and named in the summary."""
    tar = _tar(tmp_path / "plain" / "images-000000.tar", ["s0.jpg", "s1.jpg", "s2.jpg"])
    tar.write_bytes(tar.read_bytes()[: len(tar.read_bytes()) // 2])  # the first sample survives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _run("--method", "mc", "--input", str(tar), "--output", str(tmp_path / "o"))
    assert result.exit_code == 1, result.output
    assert "lost data in" in result.output and "1 shard(s) read in part or not at all" in result.output
    assert "exceed --max-failures 0" in result.output
    allowed = _run("--method", "mc", "--input", str(tar), "--output", str(tmp_path / "o"), "--max-failures", "1")
    assert allowed.exit_code == 0, allowed.output
