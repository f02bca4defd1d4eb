"""Deriving a plain tar's index: a tar cut inside a member, or with a sample's members apart, is refused whole."""

from __future__ import annotations

import io
import tarfile

import pytest
from click.testing import CliRunner

from relicv2.cli.shards import shards_group
from relicv2.shards.index import index_text
from tests.shards.test_hostile import jpeg


def _tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _samples(count: int) -> list[list[tuple[str, bytes]]]:
    return [[(f"s{i:03d}.jpg", jpeg(i)), (f"s{i:03d}.cls", str(i % 2).encode())] for i in range(count)]


def test_a_tar_cut_inside_a_member_gets_no_index_and_shards_index_fails_naming_it(tmp_path):
    folder = tmp_path / "wds"
    folder.mkdir()
    _tar(folder / "train-0000.tar", [m for sample in _samples(6) for m in sample])
    _tar(folder / "train-0001.tar", [m for sample in _samples(6) for m in sample])
    cut = folder / "train-0001.tar"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # inside the data of a middle sample
    with pytest.raises(ValueError, match=r"train-0001\.tar: member 's\d{3}\.\w+' is cut off"):
        index_text(cut)
    result = CliRunner().invoke(shards_group, ["index", str(folder), "--index-cache", str(tmp_path / "cache")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "train-0001.tar: member" in result.output and "1 unreadable (2 tars)" in result.output


def test_a_tar_with_a_samples_members_apart_is_refused_with_the_fix(tmp_path):
    samples = _samples(4)
    tar = tmp_path / "train-0000.tar"
    _tar(tar, [s[0] for s in samples] + [s[1] for s in samples])  # `tar cf x.tar *.jpg *.cls`
    with pytest.raises(ValueError, match=r"members of sample 's000' are not next to each other.*key order"):
        index_text(tar)
    _tar(tar, [m for s in samples for m in s] + [samples[0][0]])  # a key repeated with the same member: 2 samples
    assert index_text(tar).splitlines()[0] == "v1.2 5"
