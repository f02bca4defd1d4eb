"""Sample sets and the ViewSource contract: image member formats, hostile index files, epoch sizes."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from relicv2.pretrain.views.backend import ViewBackend
from relicv2.pretrain.views.config import ViewConfig
from relicv2.pretrain.views.loader import ViewLoader
from relicv2.pretrain.views.source import ViewSource
from relicv2.pretrain.views.synthetic import SyntheticViews
from relicv2.shards import ShardSample, index_path, list_shards, write_shard_set
from relicv2.shards.sample import IMAGE_MEMBERS
from relicv2.shards.sample_set import load_sample_set, require_class_labels

TINY = ViewConfig(large_views=2, small_views=1, large_size=24, small_size=16, num_threads=1)
BACKENDS = ["dali", "reference"]


def encoded(seed: int, fmt: str, size: int = 40) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size + 8, 3), dtype=np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


def image_set(directory, count: int, formats=(("jpg", "JPEG"),)):
    samples = []
    for i in range(count):
        ext, fmt = formats[i % len(formats)]
        samples.append(ShardSample(f"k{i:03d}", {ext: encoded(i, fmt)}, i % 5, {}))
    write_shard_set(samples, directory, prefix="images", max_count=9)
    return directory


@pytest.mark.parametrize("backend", BACKENDS)
def test_png_webp_and_jpeg_members_are_images_too(tmp_path, backend):
    formats = (("jpg", "JPEG"), ("jpeg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))
    assert {ext for ext, _ in formats} == set(IMAGE_MEMBERS)
    image_set(tmp_path, 12, formats)
    loader = ViewLoader(tmp_path, 4, TINY, seed=1, backend=backend)
    assert loader.skipped == {}
    keys = [k for batch in loader for k in batch["keys"]]
    assert sorted(keys) == [f"k{i:03d}" for i in range(12)]  # every format decoded, none dropped


def foreign_set(directory, count: int, class_names: bool = False) -> None:
    """A plain WebDataset set as other tools write it: `train-NNNN.tar`, no manifest, no .idx,
    jpg/png/webp members, `cls` on some samples only (class indices, or names with `class_names`)."""
    import webdataset as wds

    formats = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"))
    directory.mkdir(parents=True)
    with wds.ShardWriter(str(directory / "train-%04d.tar"), maxcount=5, verbose=0) as sink:
        for i in range(count):
            ext, fmt = formats[i % len(formats)]
            sample = {"__key__": f"f{i:03d}", ext: encoded(i, fmt)}
            if i % 2 == 0:
                sample["cls"] = (("tench", "church", "parachute")[i % 3] if class_names else str(i % 3)).encode()
            sink.write(sample)


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_webdataset_shards_load_from_a_folder_or_a_brace_pattern(tmp_path, backend, monkeypatch):
    foreign_set(tmp_path / "plain", 14)  # 3 tars of 5, 5, 4
    cache = tmp_path / "cache"
    for spec in (tmp_path / "plain", str(tmp_path / "plain" / "train-{0000..0002}.tar")):
        sample_set = load_sample_set(spec, index_cache=cache)
        assert len(sample_set) == 14 and sample_set.skipped == {}
        assert all(idx.parent == cache for idx in sample_set.index_files)  # derived once, into the cache
    assert sorted(p.suffix for p in (tmp_path / "plain").iterdir()) == [".tar"] * 3  # nothing written beside
    monkeypatch.setenv("RELICV2_INDEX_CACHE", str(cache))  # what a pretrain run uses
    loader = ViewLoader(str(tmp_path / "plain" / "train-{0000..0002}.tar"), 4, TINY, seed=1, backend=backend)
    keys = [k for batch in loader for k in batch["keys"]]
    assert len(keys) == 12 and len(set(keys)) == 12  # 3 full batches of the 14 samples
    assert len(list(cache.glob("*.idx"))) == 3  # the cached indexes were reused, not written again


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_names_in_cls_members_pretrain_unlabelled_instead_of_being_refused(tmp_path, backend):
    foreign_set(tmp_path / "named", 8, class_names=True)
    loader = ViewLoader(tmp_path / "named", 4, TINY, seed=1, backend=backend)
    batches = list(loader)
    assert loader.skipped == {} and sorted(k for b in batches for k in b["keys"]) == [f"f{i:03d}" for i in range(8)]
    assert all(b["labels"] is None for b in batches)  # names are not class indices: no sample is labelled


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_sets_bomb_images_and_masks_are_left_out_before_any_decoder(tmp_path, backend):
    """A header claiming 30000 x 30000 pixels (an image or a mask) never reaches a decoder."""
    import webdataset as wds

    from tests.shards.test_hostile import bomb_png

    (tmp_path / "wds").mkdir()
    mask = io.BytesIO()
    Image.new("L", (40, 32), 255).save(mask, "PNG")
    with wds.ShardWriter(str(tmp_path / "wds" / "train-%04d.tar"), maxcount=5, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"s{i:02d}", "png": encoded(i, "PNG"), "mask.png": mask.getvalue()})
        sink.write({"__key__": "bomb", "png": bomb_png()})
        sink.write({"__key__": "maskbomb", "png": encoded(11, "PNG"), "mask.png": bomb_png(20000, 20000)})
    with pytest.warns(UserWarning, match="left out 2 bad samples"):
        sample_set = load_sample_set(tmp_path / "wds")
    assert dict(sample_set.skipped) == {"too_large": 1, "bad_mask": 1} and len(sample_set) == 10
    with pytest.warns(UserWarning, match="left out 2"):
        loader = ViewLoader(tmp_path / "wds", 5, TINY, seed=1, backend=backend)
    assert sorted(k for b in loader for k in b["keys"]) == [f"s{i:02d}" for i in range(10)]


def test_checking_a_large_set_shows_progress_over_its_tars(tmp_path, monkeypatch, capsys):
    foreign_set(tmp_path / "plain", 14)  # 3 tars
    load_sample_set(tmp_path / "plain")
    assert "checking the samples" not in capsys.readouterr().err  # small sets stay quiet
    monkeypatch.setattr("relicv2.shards.sample_set.PROGRESS_FROM", 10)
    load_sample_set(tmp_path / "plain")
    assert "checking the samples of " in capsys.readouterr().err  # a line off a terminal, a bar with ETA on one


def test_sample_checks_are_kept_in_the_cache_and_redone_when_a_tar_changes(tmp_path, monkeypatch):
    import shutil

    import relicv2.shards.checks as checks

    foreign_set(tmp_path / "plain", 14)  # 3 tars of 5, 5, 4
    tar = tmp_path / "plain" / "train-0001.tar"
    with tarfile.open(tar) as archive:
        member = archive.getmember("f006.jpg")
    jpeg_end = member.offset_data + member.size - 2  # the image's end marker
    data = bytearray(tar.read_bytes())
    data[jpeg_end : jpeg_end + 2] = b"\0\0"  # same size, truncated image
    tar.write_bytes(bytes(data))
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match="left out 1 bad samples"):
        first = load_sample_set(tmp_path / "plain", index_cache=cache)
    assert len(list((cache / checks.CHECKS_FOLDER).glob("*.json"))) == 3
    reads = []
    real = checks.structural_problem
    monkeypatch.setattr(checks, "structural_problem", lambda *a, **k: reads.append(a[0].key) or real(*a, **k))
    with pytest.warns(UserWarning, match="left out 1 bad samples"):
        again = load_sample_set(tmp_path / "plain", index_cache=cache)
    assert reads == [] and dict(again.skipped) == dict(first.skipped) == {"truncated_image": 1}
    assert again.skipped_keys == first.skipped_keys and [s.key for s in again.samples] == [s.key for s in first.samples]
    # a changed tar (here: repaired, a new modification time) is checked again, the others are not
    data[jpeg_end : jpeg_end + 2] = b"\xff\xd9"
    tar.write_bytes(bytes(data))
    os.utime(tar, ns=(tar.stat().st_atime_ns, tar.stat().st_mtime_ns + 10**9))
    repaired = load_sample_set(tmp_path / "plain", index_cache=cache)
    assert repaired.skipped == {} and len(repaired) == 14 and len(reads) == 5
    # a torn or forged verdict file is not trusted: the tar is checked again
    for path in (cache / checks.CHECKS_FOLDER).glob("*.json"):
        path.write_text('{"samples": 5, "left_out": [[99, "x"]]}')
    reads.clear()
    assert len(load_sample_set(tmp_path / "plain", index_cache=cache)) == 14 and len(reads) == 14
    # an unwritable cache only costs the check at every start
    monkeypatch.setattr(checks, "atomic_write_bytes", lambda *a: (_ for _ in ()).throw(PermissionError("read-only")))
    shutil.rmtree(cache / checks.CHECKS_FOLDER)
    assert len(load_sample_set(tmp_path / "plain", index_cache=cache)) == 14
    assert list((cache / checks.CHECKS_FOLDER).glob("*.json")) == []  # nothing kept, nothing failed


def test_decoding_is_cached_per_tar_and_spared_to_sets_decoded_when_written(tmp_path):
    """What `eval linear` asks (evaluation.dali_views.DECODE): decode every image of a foreign set once."""
    import webdataset as wds

    from relicv2.pretrain.views.dali import find_undecodable

    calls = []

    def spy(samples):
        calls.append(len(samples))
        return find_undecodable(samples, threads=1)

    body = encoded(60, "JPEG")
    scan = body.index(b"\xff\xda")  # start of scan: marker, length, component count, first component id
    undecodable = body[: scan + 5] + bytes([9]) + body[scan + 6 :]  # a scan of a component that does not exist
    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "train-%04d.tar"), maxcount=5, verbose=0) as sink:
        for i in range(9):
            sink.write({"__key__": f"s{i:02d}", "jpg": encoded(i, "JPEG"), "cls": b"1"})
        sink.write({"__key__": "midcorrupt", "jpg": undecodable, "cls": b"1"})  # its header reads fine
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match="left out 1 bad samples"):
        first = load_sample_set(tmp_path / "wds", decode_check=spy, decode_foreign_only=True, index_cache=cache)
    assert dict(first.skipped) == {"undecodable_image": 1} and first.skipped_keys == ["midcorrupt"]
    assert calls == [5, 5]  # one call per tar
    with pytest.warns(UserWarning, match="left out 1 bad samples"):
        again = load_sample_set(tmp_path / "wds", decode_check=spy, decode_foreign_only=True, index_cache=cache)
    assert calls == [5, 5] and again.skipped_keys == ["midcorrupt"]  # the verdicts came from the cache
    structure_only = load_sample_set(tmp_path / "wds", index_cache=cache)  # its own verdicts: corruption unseen
    assert structure_only.skipped == {} and len(structure_only) == 10
    image_set(tmp_path / "own", 12)  # from shards build: every image was decoded when it was written
    assert len(load_sample_set(tmp_path / "own", decode_check=spy, decode_foreign_only=True, index_cache=cache)) == 12
    assert calls == [5, 5]
    load_sample_set(tmp_path / "own", decode_check=spy, index_cache=cache)  # asked for explicitly (verify="decode")
    assert calls == [5, 5, 9, 3]


def test_a_ranks_share_of_the_cores_under_torchrun():
    from relicv2.jobs.workers import rank_cores, usable_cores

    assert rank_cores({}) == usable_cores()
    assert rank_cores({"LOCAL_WORLD_SIZE": "4"}) == max(1, usable_cores() // 4)
    assert rank_cores({"LOCAL_WORLD_SIZE": str(10 * usable_cores())}) == 1


def test_truncated_images_are_left_out_by_the_cheap_check_and_a_garbage_label_unlabels(tmp_path):
    good = [ShardSample(f"g{i}", {"png": encoded(i, "PNG")}, None, {}) for i in range(4)]
    png, webp = encoded(50, "PNG"), encoded(51, "WEBP")
    bad = [ShardSample("cutpng", {"png": png[: len(png) - 20]}, None, {}),
           ShardSample("cutwebp", {"webp": webp[: len(webp) - 20]}, None, {}),
           ShardSample("two", {"jpg": encoded(52, "JPEG"), "png": png}, None, {}),
           ShardSample("garbagelabel", {"png": encoded(53, "PNG")}, 7, {})]
    write_shard_set(good + bad, tmp_path, prefix="images")
    tar = list_shards(tmp_path)[0]
    line = next(line for line in index_path(tar).read_text().splitlines() if "garbagelabel.cls" in line)
    fields = line.split()
    offset = int(fields[fields.index("cls") + 1])
    with open(tar, "r+b") as handle:  # a foreign shard's label that is not a number
        handle.seek(offset)
        handle.write(b"x")
    with pytest.warns(UserWarning, match="left out 3 bad samples"):
        sample_set = load_sample_set(tmp_path)
    assert dict(sample_set.skipped) == {"truncated_image": 2, "several_images": 1}
    assert sorted(s.key for s in sample_set.samples) == [f"g{i}" for i in range(4)] + ["garbagelabel"]
    assert next(s for s in sample_set.samples if s.key == "garbagelabel").label is None  # kept, unlabelled
    with pytest.raises(ValueError, match=r"sample garbagelabel in images-0+\.tar has cls 'x', not a class index"):
        require_class_labels(sample_set.samples[-1:], tmp_path)  # what evaluation asks
    with pytest.raises(ValueError, match=r"sample g0 in images-0+\.tar has no class label \(\.cls\)"):
        require_class_labels(sample_set.samples, tmp_path)


def rewrite_index(tar, edit) -> None:
    idx = index_path(tar)
    lines = idx.read_text().splitlines()
    idx.write_text("\n".join(edit(lines)) + "\n")


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda lines: [lines[0]] + [lines[1].replace(lines[1].split()[1], "-5", 1)] + lines[2:], "negative offset"),
        (lambda lines: [lines[0]] + [lines[1].replace(lines[1].split()[2], "99999999999", 1)] + lines[2:], "beyond the tar|claims bytes"),
        (lambda lines: ["v1.2 lots"] + lines[1:], "is not a DALI v1.2 index"),
        (lambda lines: lines[1:], "is not a DALI v1.2 index"),
        (lambda lines: [lines[0]] + [" ".join(lines[1].split()[:3] + ["../../etc/passwd.jpg"])] + lines[2:],
         "'..' component"),
        (lambda lines: [lines[0]] + [" ".join(lines[1].split()[:3] + ["other.jpg"])] + lines[2:], "does not belong"),
        (lambda lines: [lines[0]] + ["jpg 0 10"] + lines[2:], "malformed"),
    ],
    ids=["negative-offset", "huge-size", "garbage-count", "no-header", "traversal", "foreign-member", "short-line"],
)
def test_a_hostile_index_is_one_clear_error_naming_it(tmp_path, edit, says):
    image_set(tmp_path, 6)
    tar = list_shards(tmp_path)[0]
    rewrite_index(tar, edit)
    with pytest.raises(ValueError, match=says) as caught:
        load_sample_set(tmp_path)
    message = str(caught.value)
    # The way out is a command (rebuild, or derive the index again), never a Python function.
    assert str(index_path(tar)) in message and "`relicv2 shards " in message and "write_index" not in message
    assert "\n" not in message


@pytest.mark.parametrize("backend", BACKENDS)
def test_epoch_size_is_the_smallest_share_and_no_rank_delivers_a_padding_duplicate(tmp_path, backend):
    image_set(tmp_path, 40)  # 3 ranks: shares of 13, 13 and 14 samples; the reader pads all to 14
    keys, lengths = [], []
    for rank in range(3):
        # batch 7: two batches of a padded share of 14 would deliver a duplicate on ranks 0 and 1
        loader = ViewLoader(tmp_path, 7, TINY, rank=rank, world_size=3, seed=2, backend=backend)
        assert isinstance(loader, ViewSource) and isinstance(loader._ensure_backend(), ViewBackend)
        assert loader.epoch_size == 13 and len(loader) == 1
        batches = list(loader)
        lengths.append(len(batches))
        keys += [k for b in batches for k in b["keys"]]
        second = [k for b in loader for k in b["keys"]]  # the next epoch ends at the same place
        assert len(second) == 7 and len(set(second)) == 7
    assert lengths == [1, 1, 1]
    assert len(keys) == 21 and len(set(keys)) == 21


def test_synthetic_views_have_the_same_epoch_meaning():
    source = SyntheticViews(41, 4, rank=1, world_size=2, large_size=8, small_size=4, num_classes=3)
    assert isinstance(source, ViewSource)
    assert source.epoch_size == 20 and len(source) == 5 == source.epoch_size // source.batch_size
    assert len(list(source)) == 5
