"""Untrusted keys never name a file outside their folder; one job per output folder."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from relicv2.jobs.lock import LOCK_NAME, FolderLockedError, acquire, folder_lock, release
from relicv2.shards.keys import UnsafeKeyError, check_key, member_refusal, safe_relative_path


@pytest.mark.parametrize("key", ["/etc/x", "../x", "a/../../x", "a//b", "./a", "", "a\0b", "a\\b", "a\nb"])
def test_unsafe_keys_are_refused(key: str, tmp_path: Path) -> None:
    with pytest.raises(UnsafeKeyError):
        check_key(key)
    with pytest.raises(UnsafeKeyError):
        safe_relative_path(tmp_path, key, ".png")


@pytest.mark.parametrize("key", ["n01440764_10026", "class_a/img_1", "x-y_z"])
def test_safe_keys_stay_inside_the_root(key: str, tmp_path: Path) -> None:
    path = safe_relative_path(tmp_path, key, ".png")
    assert path.resolve().is_relative_to(tmp_path.resolve())
    assert path.name.endswith(".png")


def test_links_devices_and_bad_names_are_refused_as_members() -> None:
    sym = tarfile.TarInfo("a.jpg")
    sym.type = tarfile.SYMTYPE
    hard = tarfile.TarInfo("b.jpg")
    hard.type = tarfile.LNKTYPE
    dev = tarfile.TarInfo("c.jpg")
    dev.type = tarfile.CHRTYPE
    absolute = tarfile.TarInfo("/etc/d.jpg")
    fine = tarfile.TarInfo("e.jpg")
    assert "link" in member_refusal(sym)
    assert "link" in member_refusal(hard)
    assert "not a regular file" in member_refusal(dev)
    assert "absolute" in member_refusal(absolute)
    assert member_refusal(fine) is None


def test_second_job_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with folder_lock(tmp_path, "shards build"):
        with pytest.raises(FolderLockedError, match=r"shards build.*pid"):
            acquire(tmp_path, "pretrain")
    assert not (tmp_path / LOCK_NAME).exists()  # released
    with folder_lock(tmp_path, "pretrain"):  # free again
        pass


def test_lock_of_a_dead_process_is_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    import socket
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": int(dead.stdout), "started": 0.0, "job": "old"}))
    path = acquire(tmp_path, "new")
    assert "no longer running" in capsys.readouterr().err
    assert json.loads(path.read_text())["job"] == "new"
    release(path)


def test_lock_of_a_live_process_on_another_host_is_kept(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps(
        {"host": "some-other-node", "pid": 1, "started": 0.0, "job": "pretrain"}))
    with pytest.raises(FolderLockedError, match="some-other-node"):
        acquire(tmp_path, "new")
