"""`relicv2 shards build / verify / merge` on generated inputs with every kind of bad file (CPU only)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from PIL import Image

from relicv2 import shards
from relicv2.cli.shards import shards_group
from relicv2.jobs.ranks import Ranks, ranks_from_env
from relicv2.shards.build import BuildConfig, build_shards
from relicv2.shards.job import rank_units as rank_shards
from relicv2.shards.merge import merge_shard_set, work_dir
from relicv2.shards.verify import verify_shard_set
from tests.paths import REPO

REPO = REPO


def image(seed: int, size=(48, 64), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
    return rgb if mode == "RGB" else rgb.convert(mode)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


def make_tree(root: Path) -> dict[str, bytes]:
    """A class-folder tree holding every input kind of the issue; returns the pass-through JPEGs."""
    cat, dog = root / "cat", root / "dog"
    cat.mkdir(parents=True)
    dog.mkdir()
    passthrough = {"cat/a.jpg": encoded(image(1), "JPEG"), "cat/b.JPEG": encoded(image(2), "JPEG"),
                   "cat/x.jpg": encoded(image(3), "JPEG"), "dog/x.jpg": encoded(image(4), "JPEG"),
                   "dog/photo.v2.final.jpg": encoded(image(5), "JPEG"),
                   "dog/café ☕.jpg": encoded(image(6), "JPEG")}
    for name, data in passthrough.items():
        (root / name).write_bytes(data)
    (cat / "grey.jpg").write_bytes(encoded(image(7, mode="L"), "JPEG"))
    (cat / "cmyk.jpg").write_bytes(encoded(image(8, mode="CMYK"), "JPEG"))
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[:, :20] = (255, 0, 0, 255)  # left half opaque red, right half fully transparent
    (cat / "alpha.png").write_bytes(encoded(Image.fromarray(rgba, "RGBA"), "PNG"))
    (cat / "deep.png").write_bytes(encoded(Image.fromarray(np.full((40, 40), 60000, np.uint16)), "PNG"))
    (cat / "pic.webp").write_bytes(encoded(image(9), "WEBP"))
    (dog / "pic.bmp").write_bytes(encoded(image(10), "BMP"))
    (dog / "scan.tif").write_bytes(encoded(image(11), "TIFF"))
    jpeg = encoded(image(12), "JPEG")
    (dog / "empty.jpg").write_bytes(b"")
    (dog / "trunc.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    sos = jpeg.find(b"\xff\xda")
    (dog / "corrupt.jpg").write_bytes(jpeg[:sos] + b"\xff\xd9")  # headers, no image data
    (dog / "fake.jpg").write_bytes(b"this is a text file, not a JPEG\n")
    (dog / "readme.txt").write_text("notes\n")
    (dog / "tiny.jpg").write_bytes(encoded(image(13, size=(10, 12)), "JPEG"))
    (dog / "link.jpg").symlink_to(root / "nowhere.jpg")
    (root / "stray.jpg").write_bytes(jpeg)
    return passthrough


EXPECTED_REJECTED = {
    "dog/empty.jpg": "empty_file", "dog/trunc.jpg": "truncated", "dog/corrupt.jpg": "corrupt",
    "dog/fake.jpg": "not_an_image", "dog/readme.txt": "unsupported_extension", "dog/tiny.jpg": "too_small",
    "dog/link.jpg": "missing", "stray.jpg": "outside_class_folder",
}


def config(src: Path, out: Path, **kw) -> BuildConfig:
    return BuildConfig(input=src, out_dir=out, progress=False, min_side=16, **kw)


def set_bytes(out: Path) -> dict[str, bytes]:
    """Every file of a finished shard set (the hidden build folder excluded)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_build_tree_with_every_input_kind(tmp_path):
    src, out = tmp_path / "in", tmp_path / "out"
    passthrough = make_tree(src)
    report = build_shards(config(src, out, max_count=4))
    rejected = {r["source"]: r["reason"] for r in pq.read_table(out / "rejected.parquet").to_pylist()}
    assert rejected == EXPECTED_REJECTED
    rows = {r["source"]: r for r in shards.read_manifest(out).to_pylist()}
    assert len(rows) == 13 and report.merge.written == 13
    assert {r["status"] for s, r in rows.items() if s in passthrough} == {"passthrough"}
    assert rows["cat/a.jpg"]["label"] == 0 and rows["dog/scan.tif"]["label"] == 1
    # duplicate stems get a hash suffix, dots and unicode are normalised
    assert rows["cat/x.jpg"]["key"].startswith("x_") and rows["dog/x.jpg"]["key"].startswith("x_")
    assert rows["cat/x.jpg"]["key"] != rows["dog/x.jpg"]["key"]
    assert rows["dog/photo.v2.final.jpg"]["key"] == "photo_v2_final"
    assert rows["dog/café ☕.jpg"]["key"] == "cafe__"
    samples = {s["meta"]["source"]: s for s in shards.iter_samples(out, report=shards.ReadReport())}
    for source, data in passthrough.items():
        assert samples[source]["jpg"] == data, f"{source} must be stored byte for byte"
    for source in ("cat/grey.jpg", "cat/cmyk.jpg", "cat/alpha.png", "cat/deep.png", "cat/pic.webp",
                   "dog/pic.bmp", "dog/scan.tif"):
        decoded = Image.open(io.BytesIO(samples[source]["jpg"]))
        assert (decoded.format, decoded.mode) == ("JPEG", "RGB"), source
        assert rows[source]["status"] == "converted"
    alpha = np.asarray(Image.open(io.BytesIO(samples["cat/alpha.png"]["jpg"])), dtype=int)
    assert np.abs(alpha[:, 30] - 255).max() < 8  # transparent -> white
    assert np.abs(alpha[:, 5] - (255, 0, 0)).max() < 40  # opaque red kept
    deep = np.asarray(Image.open(io.BytesIO(samples["cat/deep.png"]["jpg"])), dtype=int)
    assert np.abs(deep - 60000 // 257).max() <= 2  # 16-bit scaled, not clipped to 255
    assert samples["cat/a.jpg"]["meta"]["class_name"] == "cat"
    info = json.loads((out / "info.json").read_text())
    assert info["classes"] == ["cat", "dog"] and info["samples"] == 13 and info["rejected"] == 8
    assert info["rejected_by_reason"]["too_small"] == 1
    assert verify_shard_set(out).ok


def test_file_lists_csv_and_parquet(tmp_path):
    src = tmp_path / "imgs"
    src.mkdir()
    for i in range(4):
        (src / f"p{i}.jpg").write_bytes(encoded(image(i), "JPEG"))
    (src / "folder.jpg").mkdir()
    lines = ["path,class", "imgs/p0.jpg,zebra", "imgs/p1.jpg,ant", "imgs/p1.jpg,ant", f"{src}/p2.jpg,",
             "imgs/gone.jpg,ant", "imgs/folder.jpg,ant"]
    (tmp_path / "list.csv").write_text("\n".join(lines) + "\n")
    build_shards(config(tmp_path / "list.csv", tmp_path / "out"))
    rows = {r["source"]: r for r in shards.read_manifest(tmp_path / "out").to_pylist()}
    assert rows["imgs/p0.jpg"]["label"] == 1 and rows["imgs/p1.jpg"]["label"] == 0
    assert rows[f"{src}/p2.jpg"]["label"] is None
    rejected = {(r["source"], r["reason"]) for r in pq.read_table(tmp_path / "out/rejected.parquet").to_pylist()}
    assert rejected == {("imgs/p1.jpg", "duplicate_entry"), ("imgs/gone.jpg", "missing"),
                        ("imgs/folder.jpg", "unreadable")}
    pq.write_table(__import__("pyarrow").table({"path": ["imgs/p3.jpg", "imgs/p0.jpg"], "label": [7, 3]}),
                   tmp_path / "list.parquet")
    build_shards(config(tmp_path / "list.parquet", tmp_path / "out2"))
    assert {r["label"] for r in shards.read_manifest(tmp_path / "out2").to_pylist()} == {7, 3}


def test_all_rejected_shard_gets_no_file(tmp_path):
    src = tmp_path / "flat"
    src.mkdir()
    for i in range(6):
        (src / f"ok{i}.jpg").write_bytes(encoded(image(i), "JPEG"))
    (src / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    report = build_shards(config(src, tmp_path / "out", max_count=1))
    assert report.merge.shards == 6 and len(report.merge.empty_shards) == 1
    assert not (tmp_path / "out" / report.merge.empty_shards[0]).exists()
    assert len(shards.list_shards(tmp_path / "out")) == 6
    assert verify_shard_set(tmp_path / "out").ok


def test_cli_exit_status_and_messages(tmp_path):
    runner = CliRunner()
    result = runner.invoke(shards_group, ["build", str(tmp_path / "missing"), str(tmp_path / "o")])
    assert result.exit_code != 0 and "does not exist" in result.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jpg").write_bytes(b"")
    result = runner.invoke(shards_group, ["build", str(bad), "--out", str(tmp_path / "o"), "--no-progress"])
    assert result.exit_code != 0 and "none of the 1 input file(s) could be written" in result.output
    src = tmp_path / "in"
    make_tree(src)
    args = ["build", str(src), "--out", str(tmp_path / "ok"), "--workers", "2", "--max-bytes", "20K",
            "--min-side", "16", "--no-progress"]
    result = runner.invoke(shards_group, args)
    assert result.exit_code == 0, result.output
    assert "13 samples, 8 rejected" in result.output and "too_small 1" in result.output
    result = runner.invoke(shards_group, ["verify", str(tmp_path / "ok"), "--workers", "1"])
    assert result.exit_code == 0 and "OK" in result.output
    other = ["build", str(src), "--out", str(tmp_path / "ok"), "--seed", "5", "--no-progress"]
    result = runner.invoke(shards_group, other)
    assert result.exit_code != 0 and "--overwrite" in result.output
    tar = shards.list_shards(tmp_path / "ok")[0]
    tar.write_bytes(tar.read_bytes()[:-11000])
    result = runner.invoke(shards_group, ["verify", str(tmp_path / "ok"), "--workers", "1"])
    assert result.exit_code != 0 and tar.name in result.output


def flat_folder(root: Path, count: int, side: int = 160) -> Path:
    root.mkdir()
    for i in range(count):
        (root / f"im{i:04d}.jpg").write_bytes(encoded(image(i, size=(side, side)), "JPEG", quality=85))
    (root / "broken.jpg").write_bytes(b"\xff\xd8garbage")
    return root


def test_kill_and_resume_gives_identical_bytes(tmp_path):
    src = flat_folder(tmp_path / "in", 319)  # + broken.jpg = 20 shards of 16
    out = tmp_path / "out"
    build_shards(config(src, out, max_count=16, workers=1))
    reference = set_bytes(out)
    assert len([n for n in reference if n.endswith(".tar")]) == 20
    for p in list(out.rglob("*"))[::-1]:
        p.unlink() if p.is_file() else p.rmdir()
    code = (f"from pathlib import Path; from relicv2.shards.build import BuildConfig, build_shards; "
            f"build_shards(BuildConfig(Path({str(src)!r}), Path({str(out)!r}), max_count=16, workers=2, "
            f"min_side=16, progress=False))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(work_dir(out).glob("*.done.json"))) < 3:
            assert proc.poll() is None, "the build finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the job and its workers, as a lost node would
        proc.wait()
    finished = len(list(work_dir(out).glob("*.done.json")))
    assert 3 <= finished < 20 and not (out / "manifest.parquet").exists()
    report = build_shards(config(src, out, max_count=16, workers=2))
    assert report.shards_kept >= 3 and report.shards_built == 20 - report.shards_kept
    assert set_bytes(out) == reference
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_two_ranks_split_without_overlap_or_gap(tmp_path):
    for shards_total in range(0, 12):
        for world in (1, 2, 3, 5):
            covered = [n for r in range(world) for n in rank_shards(shards_total, r, world)]
            assert covered == list(range(shards_total))
    assert ranks_from_env({"RANK": "1", "WORLD_SIZE": "2"}) == Ranks(1, 2)
    assert ranks_from_env({}) == Ranks(0, 1)
    src = flat_folder(tmp_path / "in", 40, side=40)
    build_shards(config(src, tmp_path / "single", max_count=5))
    out = tmp_path / "multi"
    with pytest.raises(RuntimeError, match="relicv2 shards merge"):  # rank 1 has not run yet
        build_shards(config(src, out, max_count=5, merge_timeout_s=0), Ranks(0, 2))
    rank0 = {p.name for p in out.glob("*.tar")}
    report = build_shards(config(src, out, max_count=5), Ranks(1, 2))
    assert report.merge is None
    rank1 = {p.name for p in out.glob("*.tar")} - rank0
    assert rank0 and rank1 and rank0 | rank1 == {p.name for p in (tmp_path / "single").glob("*.tar")}
    merge_shard_set(out)
    keys = [r["key"] for r in shards.read_manifest(out).to_pylist()]
    assert len(keys) == len(set(keys)) == 40
    assert set_bytes(out) == set_bytes(tmp_path / "single")


def test_real_images_round_trip(shared_data, tmp_path):
    images = sorted((shared_data / "msra-unlabeled").glob("*.jpg"))[:60]
    (tmp_path / "list.csv").write_text("path\n" + "\n".join(str(p) for p in images) + "\n")
    report = build_shards(config(tmp_path / "list.csv", tmp_path / "out", workers=2, max_count=25))
    assert report.merge.written == 60 and report.merge.shards == 3
    by_source = {s["meta"]["source"]: s for s in shards.iter_samples(tmp_path / "out", report=shards.ReadReport())}
    assert all(by_source[str(p)]["jpg"] == p.read_bytes() for p in images)
    assert all(s["meta"]["status"] == "passthrough" and s["label"] is None for s in by_source.values())
    assert verify_shard_set(tmp_path / "out", workers=2).ok
