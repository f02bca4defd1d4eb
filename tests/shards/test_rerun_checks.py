"""What a rerun of `relicv2 shards build` checks before it keeps a finished shard: its inputs (by time, or by
content), its tars (hashed with --rehash-shards), and what --overwrite removes; one message for a dead worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2.cli.shards import shards_group
from relicv2.shards import build as build_module
from relicv2.shards import job as job_module
from relicv2.shards.build import build_shards
from relicv2.shards.manifest import read_manifest
from relicv2.shards.merge import work_dir
from relicv2.shards.sources import InputError
from relicv2.shards.verify import verify_shard_set
from tests.shards.test_build import config, encoded, flat_folder, image, set_bytes


def bmp_folder(root: Path, count: int) -> Path:
    root.mkdir()
    for i in range(count):
        (root / f"b{i}.bmp").write_bytes(encoded(image(i, size=(32, 32)), "BMP"))
    return root


def repaint(path: Path, data: bytes, *, keep_time: bool = False) -> None:
    """New bytes of the same size; the time a second later (an edit), or kept (a tool that restores it)."""
    stat = path.stat()
    assert len(data) == stat.st_size
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns if keep_time else stat.st_mtime_ns + 10**9))


def verify(out: Path):
    return CliRunner().invoke(shards_group, ["verify", str(out), "--workers", "1", "--no-progress"])


def test_an_input_edited_in_place_at_the_same_size_is_rebuilt(tmp_path):
    src, out = bmp_folder(tmp_path / "in", 8), tmp_path / "out"
    build_shards(config(src, out, max_count=4))
    before = set_bytes(out)
    red = np.zeros((32, 32, 3), np.uint8)
    red[..., 0] = 255
    repaint(src / "b3.bmp", encoded(Image.fromarray(red), "BMP"))  # uncompressed: the size never changes
    report = build_shards(config(src, out, max_count=4))
    assert (report.shards_built, report.shards_kept) == (1, 1)
    changed = [name for name, data in set_bytes(out).items() if before[name] != data]
    rows = {r["source"]: r for r in read_manifest(out).to_pylist()}
    assert rows["b3.bmp"]["shard"] in changed and verify_shard_set(out).ok
    # A JPEG with bytes changed in place: the same.
    jpg = tmp_path / "jpg"
    flat_folder(jpg, 4, side=64)
    build_shards(config(jpg, tmp_path / "out2"))
    data = bytearray((jpg / "im0002.jpg").read_bytes())
    data[-300:-100] = bytes(200)
    repaint(jpg / "im0002.jpg", bytes(data))
    assert build_shards(config(jpg, tmp_path / "out2")).shards_built == 1


def test_content_check_catches_an_edit_that_kept_the_time_and_keeps_a_touched_copy(tmp_path):
    src, out = bmp_folder(tmp_path / "in", 6), tmp_path / "out"
    build_shards(config(src, out, max_count=3, input_check="content"))
    repaint(src / "b1.bmp", encoded(image(99, size=(32, 32)), "BMP"), keep_time=True)
    # By time, such an edit is invisible (documented); by content it is found.
    assert build_shards(config(src, out, max_count=3, input_check="content")).shards_built == 1
    for path in src.iterdir():  # new times, same bytes (a copy that did not keep them): nothing to redo
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 5 * 10**9))
    report = build_shards(config(src, out, max_count=3, input_check="content"))
    assert (report.shards_built, report.shards_kept) == (0, 2)
    with pytest.raises(InputError, match="--input-check 'mtime' must be one of time, content"):
        build_shards(config(src, out, input_check="mtime"))


def test_records_without_input_times_are_rebuilt_once_with_the_reason(tmp_path, capsys):
    src, out = bmp_folder(tmp_path / "in", 4), tmp_path / "out"
    build_shards(config(src, out, max_count=2))
    for path in work_dir(out).glob("*.done.json"):  # as an older version wrote them
        record = json.loads(path.read_text())
        del record["inputs"]
        path.write_text(json.dumps(record))
    assert build_shards(config(src, out, max_count=2)).shards_built == 2
    assert "does not identify its inputs this way (made by an older version" in capsys.readouterr().err
    assert build_shards(config(src, out, max_count=2)).shards_built == 0


def cli(monkeypatch, *args: str):
    monkeypatch.setattr(sys, "argv", ["relicv2", "shards", *args])
    return CliRunner().invoke(shards_group, list(args))


def test_bit_rot_is_found_by_rehash_shards_and_a_plain_rerun_reads_no_tar(tmp_path, monkeypatch):
    src, out = flat_folder(tmp_path / "in", 8, side=64), tmp_path / "out"
    build = ["build", str(src), str(out), "--max-count", "2", "--workers", "1", "--min-side", "16", "--no-progress"]
    assert cli(monkeypatch, *build).exit_code == 0
    reference = set_bytes(out)
    tar = out / "images-000001.tar"
    stat = tar.stat()
    data = bytearray(tar.read_bytes())
    data[1500] ^= 0x01  # inside the first image
    tar.write_bytes(bytes(data))
    os.utime(tar, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and time as recorded
    hashed = []
    real = job_module.sha256_of
    monkeypatch.setattr(job_module, "sha256_of", lambda path: hashed.append(Path(path).suffix) or real(path))
    result = cli(monkeypatch, *build)
    assert result.exit_code == 0 and "0 shard(s) built" in result.output and ".tar" not in hashed
    result = verify(out)
    assert result.exit_code == 1 and "images-000001.tar: sample" in result.output
    advice = result.output.split("rebuilds damaged ones: ", 1)[1].strip()
    assert advice.endswith(" --rehash-shards")
    result = cli(monkeypatch, *advice.split()[2:])  # the advice as typed
    assert result.exit_code == 0, result.output
    assert "rebuilding images-000001.tar, finished by an earlier run: its tar was changed" in result.output
    rebuilt = set_bytes(out)
    assert rebuilt.pop("info.json") != reference.pop("info.json")  # it records the command, now with the option
    assert rebuilt == reference and verify(out).exit_code == 0


def test_verify_of_a_copied_set_names_the_copy_in_its_advice(tmp_path, monkeypatch):
    src, out = flat_folder(tmp_path / "in", 4, side=64), tmp_path / "out"
    build = ["build", str(src), str(out), "--max-count", "2", "--workers", "1", "--min-side", "16", "--no-progress"]
    assert cli(monkeypatch, *build).exit_code == 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    os.truncate(copy / "images-000000.tar", 2048)
    result = verify(copy)
    advice = result.output.split("rebuilds damaged ones: ", 1)[1].strip()
    assert f"{src} {copy} " in advice and str(out) + " " not in advice
    assert cli(monkeypatch, *advice.split()[2:]).exit_code == 0 and verify(copy).exit_code == 0
    shutil.rmtree(copy / ".build")  # a copy without its work folder: rebuilt, replacing it, there too
    os.truncate(copy / "images-000000.tar", 2048)
    assert f"replacing it: relicv2 shards build {src} {copy} " in verify(copy).output


def test_overwrite_refuses_before_it_removes_anything_and_says_what_it_removed(tmp_path, capsys):
    src, out = bmp_folder(tmp_path / "in", 8), tmp_path / "out"
    build_shards(config(src, out, max_count=1))
    (out / "images-000099.tar").write_bytes(b"a user's tar")
    before = set_bytes(out)
    with pytest.raises(InputError, match="images-000099.tar, which this build would overwrite"):
        build_shards(config(src, out, max_count=4, overwrite=True))
    assert set_bytes(out) == before and (work_dir(out) / "plan.json").is_file()
    (out / "images-000099.tar").unlink()
    capsys.readouterr()
    build_shards(config(src, out, max_count=4, overwrite=True))
    assert ("--overwrite: removed 19 file(s) of the previous build in "
            f"{out} (images-000000.idx, images-000000.tar, images-000001.idx, images-000001.tar and 15 more)"
            ) in capsys.readouterr().err


def test_a_killed_worker_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch):
    src, out = flat_folder(tmp_path / "in", 12, side=64), tmp_path / "out"
    real = build_module.prepare_file

    def dies_on_one(path, **options):  # in a forked worker, as the kernel's out-of-memory killer would
        if path.endswith("im0007.jpg"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, **options)

    monkeypatch.setattr(build_module, "prepare_file", dies_on_one)
    monkeypatch.setattr(build_module, "CHUNK", 1)
    build = ["build", str(src), str(out), "--max-count", "3", "--workers", "2", "--min-side", "16", "--no-progress"]
    result = cli(monkeypatch, *build)
    assert result.exit_code == 1
    assert "Error: a worker process died while shards build made " in result.output
    assert "rerun the same command to resume" in result.output
    assert "concurrent.futures" not in result.output and "Traceback" not in result.output
    monkeypatch.setattr(build_module, "prepare_file", real)
    result = cli(monkeypatch, *build)
    assert result.exit_code == 0 and verify(out).exit_code == 0


@pytest.mark.parametrize(("field", "value", "says"), [
    ("shard", "../../evil.tar", "it names shard '../../evil.tar'"),
    ("key", "../..", "a manifest row's key '../..' has an empty, '.' or '..' component"),
    ("label", 99, "has label 99, not a class index of the set's 2 classes"),
])
def test_tampered_done_records_are_refused_by_merge_and_redone_by_a_rerun(tmp_path, field, value, says):
    src = tmp_path / "in"
    for name in ("cat", "dog"):
        (src / name).mkdir(parents=True)
        for i in range(2):
            (src / name / f"{name}{i}.jpg").write_bytes(encoded(image(i + 10 * len(name), size=(32, 32)), "JPEG"))
    out = tmp_path / "out"
    build_shards(config(src, out, max_count=2))
    before = set_bytes(out)
    path = sorted(work_dir(out).glob("*.done.json"))[0]
    record = json.loads(path.read_text())
    if field == "shard":
        record["shard"] = value
    else:
        record["manifest"][0][field] = value
    path.write_text(json.dumps(record))
    result = CliRunner().invoke(shards_group, ["merge", str(out)])
    assert result.exit_code == 1 and f"its done record {path.name} is not valid (" in result.output
    assert says in result.output
    assert "Traceback" not in result.output and set_bytes(out) == before and not (tmp_path / "evil.tar").exists()
    report = build_shards(config(src, out, max_count=2))
    assert report.repaired == (record["manifest"][0]["shard"] if field != "shard" else "images-000000.tar",)
    assert set_bytes(out) == before
