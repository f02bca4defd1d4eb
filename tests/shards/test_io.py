"""Shard-set writing, reading, DALI index files and verification (generated data, CPU only)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from relicv2 import shards
from relicv2.shards.reader import read_samples
from relicv2.shards.verify import verify_shard_set


def jpeg_bytes(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def mask_png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A distinct 8-bit mask at the image size (height, width) of :func:`jpeg_bytes`."""
    out = io.BytesIO()
    Image.fromarray(np.full(size, seed * 10 % 256, np.uint8)).save(out, "PNG")
    return out.getvalue()


def make_samples(n: int) -> list[shards.ShardSample]:
    return [
        shards.ShardSample(
            key=f"img{i:03d}",
            members={"jpg": jpeg_bytes(i), "mask.png": mask_png(i)},
            label=(i % 3) if i % 4 else None,
            meta={"width": 48, "height": 40, "source": f"src/{i}.jpg", "mask_coverage": i / 100},
        )
        for i in range(n)
    ]


@pytest.fixture()
def shard_set(tmp_path: Path) -> tuple[Path, list[shards.ShardSample], list[Path]]:
    samples = make_samples(23)
    paths = shards.write_shard_set(samples, tmp_path / "set", prefix="masked", max_count=10)
    return tmp_path / "set", samples, paths


def test_write_read_round_trip(shard_set):
    out, samples, paths = shard_set
    assert [p.name for p in paths] == ["masked-000000.tar", "masked-000001.tar", "masked-000002.tar"]
    assert shards.list_shards(out) == paths
    items = list(shards.iter_samples(out, report=shards.ReadReport()))
    assert [it["key"] for it in items] == [s.key for s in samples]
    for it, s in zip(items, samples, strict=True):
        assert it["jpg"] == s.members["jpg"]
        assert it["mask.png"] == s.members["mask.png"]
        assert it["label"] == s.label
        assert it["meta"] == s.meta
    table = shards.read_manifest(out)
    rows = table.to_pylist()
    assert [r["key"] for r in rows] == [s.key for s in samples]
    assert [(r["shard"], r["position"]) for r in rows[9:12]] == [
        ("masked-000000.tar", 9), ("masked-000001.tar", 0), ("masked-000001.tar", 1)]
    assert rows[5]["mask_coverage"] == pytest.approx(0.05) and rows[5]["source"] == "src/5.jpg"
    assert rows[4]["label"] is None and rows[5]["label"] == 2
    assert rows[0]["width"] == 48 and rows[0]["status"] == "ok"


def test_tar_members_are_reproducible_and_adjacent(shard_set, tmp_path):
    out, samples, paths = shard_set
    with tarfile.open(paths[0]) as archive:
        members = archive.getmembers()
    assert [m.name for m in members[:4]] == ["img000.jpg", "img000.json", "img000.mask.png", "img001.cls"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "relicv2", "relicv2")}
    again = shards.write_shard_set(samples, tmp_path / "again", prefix="masked", max_count=10)
    for a, b in zip(paths, again, strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert shards.index_path(a).read_bytes() == shards.index_path(b).read_bytes()
    assert (out / "manifest.parquet").read_bytes() == (tmp_path / "again" / "manifest.parquet").read_bytes()


def test_max_bytes_splits_shards(tmp_path):
    samples = make_samples(12)
    paths = shards.write_shard_set(samples, tmp_path, max_bytes=16 * 1024)
    assert len(paths) > 1
    assert all(p.stat().st_size <= 16 * 1024 + 10240 for p in paths)  # + tar end-of-archive padding
    assert sum(1 for _ in shards.iter_samples(tmp_path, report=shards.ReadReport())) == 12


def test_rewriting_a_smaller_set_removes_stale_shards(tmp_path):
    shards.write_shard_set(make_samples(23), tmp_path, max_count=5)
    paths = shards.write_shard_set(make_samples(7), tmp_path, max_count=5)
    assert shards.list_shards(tmp_path) == paths and len(paths) == 2
    assert not (tmp_path / "images-000002.idx").exists()


def test_index_matches_dali_wds2idx_tool(shard_set, tmp_path):
    _, _, paths = shard_set
    tool = Path(sys.executable).with_name("wds2idx")
    if not tool.exists() or shutil.which("tar") is None:
        pytest.skip("DALI's wds2idx script or GNU tar not available")
    reference = tmp_path / "ref.idx"
    subprocess.run([str(tool), str(paths[1]), str(reference)], check=True, capture_output=True)
    assert shards.index_path(paths[1]).read_text() == reference.read_text()
    assert shards.write_index(paths[1]).read_text() == reference.read_text()


def test_dali_webdataset_reader_reads_shards_with_index(shard_set):
    from nvidia.dali import fn, pipeline_def

    _, samples, paths = shard_set

    @pipeline_def(batch_size=len(samples), num_threads=1, device_id=None)
    def pipe():
        jpg, mask, cls = fn.readers.webdataset(
            paths=[str(p) for p in paths],
            index_paths=[str(shards.index_path(p)) for p in paths],
            ext=["jpg", "mask.png", "cls"],
            missing_component_behavior="empty",
        )
        return fn.decoders.image(jpg, device="cpu"), mask, cls

    pipeline = pipe()
    pipeline.build()
    images, masks, labels = pipeline.run()
    for i, s in enumerate(samples):
        assert np.array(images[i]).shape == (40, 48, 3)
        assert np.array(masks[i]).tobytes() == s.members["mask.png"]
        assert np.array(labels[i]).tobytes() == (b"" if s.label is None else str(s.label).encode())


def test_bad_samples_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not 1-80 characters"):
        shards.write_shard_set([shards.ShardSample("a.b", {"jpg": b"x"})], tmp_path)
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        shards.write_shard_set([shards.ShardSample("a", {"jpg": b"x"})] * 2, tmp_path)
    with pytest.raises(ValueError, match="generated from label/meta"):
        shards.write_shard_set([shards.ShardSample("a", {"jpg": b"x", "cls": b"1"})], tmp_path)
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        shards.write_shard_set([shards.ShardSample("a", {"jpg": b"x"}, meta={"x": object()})], tmp_path)
    assert not list(tmp_path.glob("*.tar")) and not list(tmp_path.glob(".*"))


def test_list_shards_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shards"):
        shards.list_shards(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        shards.list_shards(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="relicv2 shards build"):
        shards.read_manifest(tmp_path)


def test_truncated_tar_is_counted_and_named(shard_set):
    out, samples, paths = shard_set
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])  # truncated mid-shard
    report = shards.ReadReport()
    items = list(shards.iter_samples(out, report=report))
    keys = [it["key"] for it in items]
    assert keys[:10] == [s.key for s in samples[:10]] and keys[-3:] == [s.key for s in samples[-3:]]
    assert len(items) < len(samples)
    assert not report.ok and report.expected == 23 and report.missing == 23 - len(items)
    assert [Path(t).name for t, _ in report.lost_shards] == ["masked-000001.tar"]
    assert "masked-000001.tar" in report.summary()
    with pytest.raises(TypeError):  # without a report: never silent, so never without one
        list(shards.iter_samples(paths))


def test_a_tar_cut_short_after_its_headers_were_read_is_a_lost_shard_not_wrong_bytes(shard_set):
    # Without an index the reader takes the members' places from the tar's headers, then reads the data
    # alone: a tar that shrinks in between must not yield short members.
    _, samples, paths = shard_set
    report = shards.ReadReport()
    reading = read_samples(paths[0], report)
    first = next(reading)
    assert first.members["jpg"] == samples[0].members["jpg"]
    with open(paths[0], "r+b") as tar:
        tar.truncate(paths[0].stat().st_size // 2)
    rest = list(reading)
    assert 0 < len(rest) < 9 and all(s.members["jpg"] == samples[s.position].members["jpg"] for s in rest)
    assert [(Path(t).name, "changed while it was read" in why) for t, why in report.lost_shards] == [
        ("masked-000000.tar", True)]


def test_verify_accepts_a_good_set_and_reports_problems(shard_set):
    out, _, paths = shard_set
    assert verify_shard_set(out).ok
    # flip one byte inside the first sample's JPEG data
    data = bytearray(paths[0].read_bytes())
    data[512 + 300] ^= 0xFF
    paths[0].write_bytes(bytes(data))
    shards.index_path(paths[2]).unlink()
    report = verify_shard_set(out)
    assert not report.ok
    assert any("masked-000000.tar: sample 'img000': content hash differs" in p for p in report.problems)
    assert any(p.startswith("masked-000002.idx: index file missing") for p in report.problems)
    assert len(report.problems) <= 3  # the hash (and possibly decode) of img000, the missing index


def test_verify_reports_truncated_shard_and_stale_index(shard_set):
    out, _, paths = shard_set
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[:4096])
    shards.index_path(paths[0]).write_text("v1.2 1\njpg 512 10 x.jpg\n")
    problems = verify_shard_set(out, decode_images=False).problems
    assert any(p.startswith("masked-000001.tar: holds") and "the manifest lists 10" in p for p in problems)
    assert any(p.startswith("masked-000000.idx: index does not match") for p in problems)


def test_tar_bytes_equal_what_tarfile_writes(shard_set, tmp_path):
    """The hand-assembled tar is exactly a standard ustar archive of the same members."""
    _, samples, paths = shard_set
    reference = tmp_path / "ref.tar"
    with tarfile.open(paths[0]) as archive, tarfile.open(reference, "w", format=tarfile.USTAR_FORMAT) as out:
        for member in archive.getmembers():
            out.addfile(member, archive.extractfile(member))
    assert reference.read_bytes() == paths[0].read_bytes()


def test_a_meta_key_with_mixed_types_becomes_json_text_in_the_manifest():
    # Foreign json members (build-masks copies them) may disagree on a key's type; the manifest
    # must still be written at the end of a long job.
    from relicv2.shards.manifest import manifest_table

    rows = [{"shard": "a-000000.tar", "position": i, "key": f"k{i}", "source": "x", "label": None, "width": 1,
             "height": 1, "byte_size": 1, "content_hash": "h", "tag": value} for i, value in enumerate([3, "three", None])]
    table = manifest_table(rows)
    assert table.column("tag").to_pylist() == ["3", '"three"', None]
