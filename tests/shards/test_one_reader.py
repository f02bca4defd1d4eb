"""One reader's rules for every command: a duplicate key, an unsafe member and an index that points a member at
another's bytes are found, left out or refused, and reported the same by subset, index, the loaders and verify."""

from __future__ import annotations

import tarfile
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from relicv2.cli.shards import shards_group
from relicv2.shards.build import build_shards
from relicv2.shards.index import index_path, read_index
from relicv2.shards.reader import ReadReport, iter_samples
from relicv2.shards.sample_set import load_sample_set
from relicv2.shards.subset import class_balanced_keys
from relicv2.shards.verify import verify_shard_set
from tests.shards.test_build import config, flat_folder
from tests.shards.test_hostile import add, jpeg


def plain_set(folder: Path, members: list[tuple[str, bytes, bytes, str]]) -> Path:
    """One plain tar (no index beside it) from (name, data, kind, link) members."""
    folder.mkdir()
    tar = folder / "train-0000.tar"
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data, kind, link in members:
            add(archive, name, data, kind, link)
    return tar


def sample(key: str, label: int, seed: int) -> list[tuple[str, bytes, bytes, str]]:
    return [(f"{key}.cls", str(label).encode(), tarfile.REGTYPE, ""), (f"{key}.jpg", jpeg(seed), tarfile.REGTYPE, "")]


def subset(folder: Path, cache: Path):
    return CliRunner().invoke(shards_group, ["subset", str(folder), "--fraction", "1", "--out", str(cache / "keys.txt"),
                                             "--index-cache", str(cache)])


def test_a_duplicate_key_is_left_out_by_subset_as_by_the_loaders_and_verify(tmp_path):
    members = [*sample("a", 0, 1), *sample("b", 1, 2), *sample("c", 0, 3), *sample("b", 0, 4), *sample("d", 1, 5)]
    plain_set(tmp_path / "set", members)
    cache = tmp_path / "cache"
    result = subset(tmp_path / "set", cache)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "4 of 4 keys, 2 classes" in result.output
    assert "left out 1 member(s) or sample(s) the shard reader refuses (duplicate_key 1)" in result.output
    assert (cache / "keys.txt").read_text().splitlines()[2:] == ["a", "b", "c", "d"]  # b once, with its first label
    assert class_balanced_keys(tmp_path / "set", 1.0, index_cache=cache).per_class == {0: 2, 1: 2}
    with pytest.warns(UserWarning, match="duplicate_key"):
        loaded = load_sample_set(tmp_path / "set", index_cache=cache)
    assert list(loaded.samples.keys()) == ["a", "b", "c", "d"]
    assert any("'b' left out (duplicate_key)" in p for p in verify_shard_set(tmp_path / "set", index_cache=cache).problems)


UNSAFE = [("../up.jpg", b"x" * 20, tarfile.REGTYPE, ""), ("/abs.jpg", b"x" * 20, tarfile.REGTYPE, ""),
          ("in/../out.jpg", b"x" * 20, tarfile.REGTYPE, ""), ("dot/./d.jpg", b"x" * 20, tarfile.REGTYPE, ""),
          ("sym.jpg", b"", tarfile.SYMTYPE, "/etc/passwd"), ("hard.jpg", b"", tarfile.LNKTYPE, "a.jpg"),
          ("chr.jpg", b"", tarfile.CHRTYPE, ""), ("blk.jpg", b"", tarfile.BLKTYPE, ""),
          ("fifo.jpg", b"", tarfile.FIFOTYPE, "")]


def test_unsafe_members_are_reported_by_index_subset_and_the_loaders(tmp_path):
    plain_set(tmp_path / "set", [*sample("a", 0, 1), *UNSAFE, *sample("b", 1, 2)])
    cache = tmp_path / "cache"
    result = CliRunner().invoke(shards_group, ["index", str(tmp_path / "set"), "--index-cache", str(cache),
                                               "--workers", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "the loaders will leave out 9 sample(s) (4 unsafe_key, 5 unsafe_member)" in result.output
    result = subset(tmp_path / "set", cache)
    assert result.exit_code == 0 and "2 of 2 keys" in result.output
    assert "left out 9 member(s) or sample(s) the shard reader refuses (unsafe_key 4, unsafe_member 5)" in result.output
    with pytest.warns(UserWarning, match=r"left out 9 bad samples \{'unsafe_key': 4, 'unsafe_member': 5\}"):
        assert len(load_sample_set(tmp_path / "set", index_cache=cache)) == 2


def test_an_index_pointing_a_member_at_another_samples_bytes_is_refused_by_the_loaders(tmp_path):
    src, out = flat_folder(tmp_path / "in", 4, side=48), tmp_path / "out"
    build_shards(config(src, out))
    tar = out / "images-000000.tar"
    idx = index_path(tar)
    lines = read_index(idx, tar)
    first, second = lines[0], lines[1]
    jpg0 = next(i for i, e in enumerate(first) if e[0] == "jpg")
    jpg1 = next(e for e in second if e[0] == "jpg")
    first[jpg0] = ("jpg", jpg1[1], jpg1[2], first[jpg0][3])  # sample 0's image: sample 1's bytes
    idx.write_text("\n".join([f"v1.2 {len(lines)}", *(" ".join(" ".join(map(str, e)) for e in s) for s in lines)]) + "\n")
    with warnings.catch_warnings(), pytest.raises(ValueError) as caught:
        warnings.simplefilter("error")
        load_sample_set(out, index_cache=tmp_path / "cache")
    message = str(caught.value)
    assert str(idx) in message and "where no header of images-000000.tar puts it" in message
    assert "`relicv2 shards build`" in message and "\n" not in message
    assert not verify_shard_set(out).ok  # verify reports the same index
    report = ReadReport()  # and the reader of every other job (eval knn, build-masks) reads no wrong image
    key = first[jpg0][3].split(".")[0]
    assert key not in [s["key"] for s in iter_samples(out, report=report)]
    assert report.lost_shards and "does not describe it at member" in report.lost_shards[0][1]
