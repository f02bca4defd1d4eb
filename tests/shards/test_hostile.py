"""Shards from strangers: traversal and link members, `pipe:` paths, bombs, truncation, foreign sets."""

from __future__ import annotations

import gzip
import io
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relicv2 import shards
from relicv2.shards.images import prepare_file
from relicv2.shards.index import write_index
from tests.exif_images import orientation6_jpeg


def jpeg(seed: int = 0, size: tuple[int, int] = (40, 48), **kw) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "JPEG", **kw)
    return out.getvalue()


def add(archive: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG whose header claims width x height pixels, without allocating them."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_traversal_link_and_device_members_are_rejected_with_reasons(tmp_path):
    tar = tmp_path / "evil-000000.tar"
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as archive:
        add(archive, "good.jpg", jpeg(1))
        add(archive, "../../escape.jpg", jpeg(2))
        add(archive, "/etc/absolute.jpg", jpeg(3))
        add(archive, "sym.jpg", kind=tarfile.SYMTYPE, link="/etc/passwd")
        add(archive, "hard.jpg", kind=tarfile.LNKTYPE, link="good.jpg")
        add(archive, "dev.jpg", kind=tarfile.CHRTYPE)
        add(archive, "./dotted.jpg", jpeg(4))  # what `tar -cf x.tar .` writes: accepted as "dotted"
    report = shards.ReadReport()
    items = list(shards.iter_samples(tar, report=report))
    assert [it["key"] for it in items] == ["good", "dotted"]
    reasons = {name: why for _, name, why in report.rejected}
    assert set(reasons) == {"../../escape.jpg", "/etc/absolute.jpg", "sym.jpg", "hard.jpg", "dev.jpg"}
    assert "'..'" in reasons["../../escape.jpg"] and "absolute" in reasons["/etc/absolute.jpg"]
    assert "link" in reasons["sym.jpg"] and "link" in reasons["hard.jpg"] and "not a regular file" in reasons["dev.jpg"]
    assert not report.ok
    # the derived index leaves the same members out, so DALI never sees them either
    idx = write_index(tar)
    assert [s[0][3] for s in shards.read_index(idx, tar)] == ["good.jpg", "dotted.jpg"]


def test_pipe_paths_are_files_not_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "pipe:touch marker #"
    shards.write_shard_set([shards.ShardSample("a", {"jpg": jpeg(1)})], folder)
    assert [it["key"] for it in shards.iter_samples(folder, report=shards.ReadReport())] == ["a"]
    assert [it["key"] for it in shards.iter_samples(str(folder / "images-000000.tar"), report=shards.ReadReport())] == ["a"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(shards.iter_samples("pipe:touch marker2 #", report=shards.ReadReport()))
    assert not (tmp_path / "marker").exists() and not (tmp_path / "marker2").exists()


def test_bomb_png_is_refused_from_its_header(tmp_path):
    data = bomb_png()
    with pytest.raises(shards.ImageLoadError, match="over the limit") as info:
        shards.load_rgb(data, "bomb.png")
    assert info.value.reason == "too_large" and "bomb.png" in str(info.value)
    (tmp_path / "bomb.png").write_bytes(data)
    rejection = prepare_file(str(tmp_path / "bomb.png"))
    assert rejection.reason == "too_large"
    # the limit is configurable, and applies to small images too
    with pytest.raises(shards.ImageLoadError, match="over the limit"):
        shards.load_rgb(jpeg(size=(100, 100)), "x", shards.ImageLimits(max_pixels=5000))


def test_large_images_are_downscaled_for_saliency_work():
    data = jpeg(size=(1600, 800))
    rgb = shards.load_rgb(data, "big.jpg", shards.ImageLimits(max_side=200))
    assert rgb.shape == (100, 200, 3)
    assert shards.load_rgb(data, "big.jpg").shape == (800, 1600, 3)


def test_compressed_tar_and_oversized_member_are_refused_before_reading(tmp_path):
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as archive:
        add(archive, "a.jpg", jpeg(1))
        add(archive, "huge.jpg", b"\0" * 300_000)
        add(archive, "b.jpg", jpeg(2))
    (tmp_path / "z-000000.tar").write_bytes(gzip.compress(plain.getvalue()))
    (tmp_path / "p-000001.tar").write_bytes(plain.getvalue())
    report = shards.ReadReport()
    items = list(shards.iter_samples(tmp_path, report=report, limits=shards.ImageLimits(max_member_bytes=100_000)))
    assert [it["key"] for it in items] == ["a", "b"]
    assert len(report.lost_shards) == 1 and "gzip-compressed" in report.lost_shards[0][1]
    assert [(n, "300000 bytes" in why) for _, n, why in report.rejected] == [("huge.jpg", True)]


def test_empty_and_non_tar_shards_are_counted_and_named(tmp_path):
    (tmp_path / "s-000000.tar").write_bytes(b"")
    (tmp_path / "s-000001.tar").write_bytes(b"this is not a tar file at all" * 40)
    report = shards.ReadReport()
    assert list(shards.iter_samples(tmp_path, report=report)) == []
    assert report.shards == 2 and not report.ok
    assert [Path(t).name for t, _ in report.lost_shards] == ["s-000000.tar", "s-000001.tar"]
    assert "empty" in report.lost_shards[0][1]


def test_manifest_count_is_checked(tmp_path):
    samples = [shards.ShardSample(f"k{i}", {"jpg": jpeg(i)}) for i in range(6)]
    shards.write_shard_set(samples, tmp_path, max_count=3)
    (tmp_path / "images-000001.tar").unlink()
    report = shards.ReadReport()
    assert len(list(shards.iter_samples(tmp_path, report=report))) == 3
    assert report.expected == 6 and report.missing == 3
    assert "images-000001.tar" in report.summary() and "listed in the manifest but missing" in report.summary()


def test_image_member_names_other_tools_use(tmp_path):
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (0, 255, 0)).save(png, "PNG")
    webp = io.BytesIO()
    Image.new("RGB", (40, 40), (0, 0, 255)).save(webp, "WEBP")
    tar = tmp_path / "t-0000.tar"
    with tarfile.open(tar, "w") as archive:
        add(archive, "a.jpeg", jpeg(1))
        add(archive, "a.cls", b"3")
        add(archive, "b.png", png.getvalue())
        add(archive, "c.webp", webp.getvalue())
        add(archive, "d.txt", b"no image here")
    report = shards.ReadReport()
    items = list(shards.iter_samples(tar, report=report))
    assert [(it["key"], it["image_ext"], it["label"]) for it in items] == [("a", "jpeg", 3), ("b", "png", None), ("c", "webp", None)]
    assert shards.load_rgb(items[1]["image"], "b")[0, 0].tolist() == [0, 255, 0]
    assert items[2]["webp"] == items[2]["image"] and "jpg" not in items[2]  # members keep their own names
    assert [(k, "no image member" in why) for _, k, why in report.rejected] == [("d", True)]


def test_one_loader_handles_16_bit_alpha_gif_and_exif():
    sixteen = io.BytesIO()
    Image.fromarray(np.full((8, 8), 65535, np.uint16)).save(sixteen, "PNG")
    assert shards.load_rgb(sixteen.getvalue(), "x")[0, 0].tolist() == [255, 255, 255]  # not clipped to 255/65535
    alpha = io.BytesIO()
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(alpha, "PNG")
    assert shards.load_rgb(alpha.getvalue(), "x")[0, 0].tolist() == [255, 255, 255]  # over white
    gif = io.BytesIO()
    Image.new("P", (8, 8), 0).save(gif, "GIF")
    assert shards.load_rgb(gif.getvalue(), "x").shape == (8, 8, 3)
    assert shards.load_rgb(orientation6_jpeg(), "x").shape == (200, 100, 3)


def test_scaled_load_decodes_small_and_reports_the_displayed_full_size():
    from relicv2.shards.images import exif_orientation, load_scaled

    scaled = load_scaled(orientation6_jpeg(), "x", 32)
    assert (scaled.width, scaled.height) == (100, 200)  # the full image as displayed
    assert scaled.rgb.shape == (100, 50, 3)  # decoded at 1/2 (1/4 would make a side 25 < 32), displayed
    assert scaled.rgb[:40, :, 0].mean() > 200 and scaled.rgb[60:, :, 2].mean() > 200  # red on top
    big = jpeg(3, size=(640, 480))
    assert load_scaled(big, "x", 32).rgb.shape == (60, 80, 3)  # 1/8
    assert load_scaled(big, "x", 1000).rgb.shape == (480, 640, 3)  # never upscaled
    png = io.BytesIO()
    Image.new("RGB", (64, 48)).save(png, "PNG")
    assert load_scaled(png.getvalue(), "x", 8).rgb.shape == (48, 64, 3)  # no DCT scaling outside JPEG
    with pytest.raises(shards.ImageLoadError) as info:
        load_scaled(bomb_png(), "bomb.png", 32)
    assert info.value.reason == "too_large"
    assert exif_orientation(orientation6_jpeg()) == 6 and exif_orientation(big) == 1
    assert exif_orientation(b"not an image") == 1


def test_exif_orientation_is_applied_once_by_build(tmp_path):
    from relicv2.shards.build import BuildConfig, build_shards

    src = tmp_path / "in"
    src.mkdir()
    (src / "rotated.jpg").write_bytes(orientation6_jpeg())
    (src / "plain.jpg").write_bytes(jpeg(1, size=(64, 48)))
    build_shards(BuildConfig(src, tmp_path / "out", workers=1, progress=False))
    rows = {r["key"]: r for r in shards.read_manifest(tmp_path / "out").to_pylist()}
    assert (rows["rotated"]["width"], rows["rotated"]["height"]) == (100, 200)
    assert rows["rotated"]["status"] == "converted" and rows["plain"]["status"] == "passthrough"
    sample = {s["key"]: s for s in shards.iter_samples(tmp_path / "out", report=shards.ReadReport())}["rotated"]
    raw = Image.open(io.BytesIO(sample["jpg"]))
    assert raw.size == (100, 200) and raw.getexif().get(0x0112, 1) == 1  # every decoder sees it upright
    rgb = np.asarray(raw.convert("RGB")).astype(int)
    assert rgb[:90, :, 0].mean() > 200 and rgb[110:, :, 2].mean() > 200  # stored left (red) is now on top


def _png(shape: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full(shape, 255, np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_verify_checks_sizes_and_masks_in_the_displayed_orientation(tmp_path):
    from relicv2.shards.verify import verify_shard_set

    displayed = {"width": 100, "height": 200}  # orientation6_jpeg is stored 200 x 100
    good = [shards.ShardSample("full", {"jpg": orientation6_jpeg(), "mask.png": _png((200, 100))}, 0, displayed),
            shards.ShardSample("scaled", {"jpg": orientation6_jpeg(), "mask.png": _png((50, 25))}, 0, displayed)]
    shards.write_shard_set(good, tmp_path / "good", prefix="masked")
    assert verify_shard_set(tmp_path / "good").problems == []
    stored = {"width": 200, "height": 100}
    bad = [shards.ShardSample("stored", {"jpg": orientation6_jpeg(), "mask.png": _png((100, 200))}, 0, stored)]
    shards.write_shard_set(bad, tmp_path / "bad", prefix="masked")
    problems = verify_shard_set(tmp_path / "bad").problems
    assert len(problems) == 2
    assert "mask.png is 200x100, not the displayed image's 100x200" in problems[0]
    assert "image is 100x200 as displayed, manifest says 200x100" in problems[1]
    # A plain WebDataset set (no manifest) gets the mask check too.
    import webdataset as wds

    (tmp_path / "plain").mkdir()
    with wds.TarWriter(str(tmp_path / "plain" / "train-000000.tar")) as sink:
        sink.write({"__key__": "stored", "jpg": orientation6_jpeg(), "mask.png": _png((100, 200))})
    problems = verify_shard_set(tmp_path / "plain", index_cache=tmp_path / "cache").problems
    assert len(problems) == 1 and "mask.png is 200x100" in problems[0]


def test_verify_accepts_greyscale_jpegs_and_reports_cmyk(tmp_path):
    # build-masks copies a foreign set's JPEG bytes: greyscale JPEGs decode to RGB everywhere.
    from relicv2.shards.verify import verify_shard_set

    def jpeg(mode: str) -> bytes:
        out = io.BytesIO()
        Image.new(mode, (48, 40)).save(out, "JPEG")
        return out.getvalue()

    size = {"width": 48, "height": 40}
    samples = [shards.ShardSample(mode.lower(), {"jpg": jpeg(mode)}, 0, size) for mode in ("L", "RGB", "CMYK")]
    shards.write_shard_set(samples, tmp_path / "set", prefix="masked")
    problems = verify_shard_set(tmp_path / "set").problems
    assert len(problems) == 1 and "'cmyk'" in problems[0] and "JPEG CMYK, not an RGB or greyscale JPEG" in problems[0]


def test_plain_webdataset_set_resolves_by_folder_and_brace_pattern(tmp_path):
    import webdataset as wds

    folder = tmp_path / "wds"
    folder.mkdir()
    with wds.ShardWriter(str(folder / "train-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sample = {"__key__": f"s{i:03d}", "jpg": jpeg(i)}
            if i % 2:
                sample["cls"] = str(i % 3).encode()
            sink.write(sample)
    cache = tmp_path / "cache"
    resolved = shards.resolve_shard_set(folder, index_cache=cache)
    assert [t.name for t in resolved.tars] == ["train-0000.tar", "train-0001.tar", "train-0002.tar"]
    assert resolved.counts == (4, 4, 2) and resolved.manifest is None and resolved.has_labels
    assert all(p.parent == cache for p in resolved.index_files) and not list(folder.glob("*.idx"))
    stamp = [p.stat().st_mtime_ns for p in resolved.index_files]
    again = shards.resolve_shard_set(str(folder / "train-{0000..0002}.tar"), index_cache=cache)
    assert again.index_files == resolved.index_files and [p.stat().st_mtime_ns for p in again.index_files] == stamp
    items = list(shards.iter_samples(str(folder / "train-{0000..0001}.tar"), report=shards.ReadReport()))
    assert len(items) == 8 and items[0]["label"] is None and items[1]["label"] == 1
    with pytest.raises(shards.ShardSetError, match="not found"):
        shards.resolve_shard_set(str(folder / "train-{0000..0005}.tar"), index_cache=cache)


def test_shards_index_derives_a_plain_sets_indexes_once_in_worker_processes(tmp_path):
    import webdataset as wds
    from click.testing import CliRunner

    from relicv2.cli.shards import shards_group

    folder = tmp_path / "wds"
    folder.mkdir()
    with wds.ShardWriter(str(folder / "train-%04d.tar"), maxcount=3, verbose=0) as sink:
        for i in range(9):
            sink.write({"__key__": f"s{i:03d}", "jpg": jpeg(i) if i != 4 else jpeg(i)[:-30]})
    cache = tmp_path / "cache"
    args = ["index", str(folder / "train-{0000..0002}.tar"), "--index-cache", str(cache), "--workers", "2"]
    first = CliRunner().invoke(shards_group, args)
    assert first.exit_code == 0 and "3 index file(s) derived" in first.output, first.output
    assert "samples of 3 tar(s) checked" in first.output and "leave out 1 sample(s) (1 truncated_image)" in first.output
    resolved = shards.resolve_shard_set(folder, index_cache=cache)
    assert resolved.counts == (3, 3, 3) and all(p.parent == cache for p in resolved.index_files)
    second = CliRunner().invoke(shards_group, args)
    assert second.exit_code == 0 and "0 index file(s) derived" in second.output  # nothing read twice
    assert "samples of 0 tar(s) checked, 3 checked before" in second.output
    assert "leave out 1 sample(s) (1 truncated_image)" in second.output  # the kept verdicts still counted
    for number in (3, 4):  # two bad tars among good ones: both reported, the good one still indexed
        (folder / f"train-000{number}.tar").write_bytes(b"garbage that is not a tar at all" * 40)
    shutil.copy(folder / "train-0000.tar", folder / "train-0005.tar")
    bad = CliRunner().invoke(shards_group, ["index", str(folder), "--index-cache", str(cache), "--workers", "2"])
    assert bad.exit_code == 1 and "Traceback" not in bad.output, bad.output
    assert "train-0003.tar: is not a readable tar" in bad.output and "train-0004.tar: is not a readable tar" in bad.output
    assert "1 index file(s) derived" in bad.output and "2 unreadable (6 tars)" in bad.output


def test_own_sets_resolve_against_their_manifest(tmp_path):
    samples = [shards.ShardSample(f"k{i}", {"jpg": jpeg(i)}, label=i % 2) for i in range(5)]
    shards.write_shard_set(samples, tmp_path, max_count=2)
    resolved = shards.resolve_shard_set(tmp_path, index_cache=tmp_path / "unused")
    assert resolved.counts == (2, 2, 1) and resolved.samples == 5 and resolved.has_labels
    assert resolved.manifest is not None and resolved.index_files[0] == tmp_path / "images-000000.idx"
    assert not (tmp_path / "unused").exists()
    shards.index_path(tmp_path / "images-000001.tar").write_text("v1.2 1\njpg 512 10 k2.jpg\n")
    with pytest.raises(shards.ShardSetError, match="the manifest 2"):
        shards.resolve_shard_set(tmp_path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("v1.2 1\njpg -5 10 a.jpg\n", "negative"),
        ("v1.2 1\njpg 512 99999999999 a.jpg\n", "beyond the tar"),
        ("v1.2\njpg 512 10 a.jpg\n", "first line"),
        ("v1.2 1\njpg x 10 a.jpg\n", "not integers"),
        ("v1.2 1\njpg 512 10 ../a.jpg\n", "unsafe member name"),
        ("v1.2 2\njpg 512 10 a.jpg\n", "announces 2"),
    ],
)
def test_hostile_index_fields_are_one_line_errors(tmp_path, text, match):
    tar = tmp_path / "x-000000.tar"
    with tarfile.open(tar, "w") as archive:
        add(archive, "a.jpg", jpeg(1))
    idx = tmp_path / "x-000000.idx"
    idx.write_text(text)
    with pytest.raises(ValueError, match=match):
        shards.read_index(idx, tar)


def test_manifest_naming_files_outside_the_folder_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards.write_shard_set([shards.ShardSample("a", {"jpg": jpeg(1)})], tmp_path / "set")
    table = shards.read_manifest(tmp_path / "set")
    table = table.set_column(table.column_names.index("shard"), "shard", pa.array(["../x-000000.tar"]))
    pq.write_table(table, tmp_path / "set" / "manifest.parquet")
    with pytest.raises(shards.ShardSetError, match="not a shard file of this folder"):
        shards.resolve_shard_set(tmp_path / "set")
    problems = shards.verify_shard_set(tmp_path / "set").problems
    assert any("'../x-000000.tar' is not a shard file name" in p for p in problems)
