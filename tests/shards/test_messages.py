"""The shard commands' messages: each fix said once, as a command a user can type."""

from __future__ import annotations

import pytest

from relicv2.shards.build import build_shards
from relicv2.shards.index import index_path
from relicv2.shards.verify import verify_shard_set
from tests.shards.test_build import config, flat_folder


def test_an_unreadable_input_tar_of_build_masks_names_its_fix_once(tmp_path):
    from relicv2.saliency.network.mask_shard import MasksError, input_index

    tar = tmp_path / "train-0000.tar"
    tar.write_bytes(b"not a tar at all" * 64)
    with pytest.raises(MasksError) as caught:
        input_index(tar, tmp_path / "cache")
    assert str(caught.value).count("rebuild or remove this shard") == 1


def test_verify_names_commands_for_an_index_that_does_not_match(tmp_path):
    src, out = flat_folder(tmp_path / "in", 4, side=48), tmp_path / "out"
    build_shards(config(src, out))
    idx = index_path(out / "images-000000.tar")
    idx.write_text(idx.read_text().replace("jpg", "jpeg", 1))
    problems = [p for p in verify_shard_set(out).problems if p.startswith(idx.name)]
    assert problems and all("`relicv2 shards " in p and "write_index" not in p for p in problems)
    idx.unlink()
    problems = [p for p in verify_shard_set(out).problems if p.startswith(idx.name)]
    assert problems == [f"{idx.name}: index file missing; rerun the job that made the set, which writes it again"]
