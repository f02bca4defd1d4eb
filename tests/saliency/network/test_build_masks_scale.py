"""build-masks at many ranks and tars: each rank's start-up grows with its own share of the input, not
with the whole set (at ImageNet's size, 1,000 tars over 64 ranks, reading every tar's index on every
rank cost more CPU than a rank's masking)."""

from __future__ import annotations

from pathlib import Path, PurePath

import pytest

from relicv2.saliency.network.build_masks import (
    BuildMasksConfig,
    MasksError,
    build_masks,
    check_input,
)
from relicv2.shards import write_shard_set
from relicv2.shards.build import Ranks
from relicv2.shards.index import index_path
from relicv2.shards.shardset import ShardSetError
from tests.saliency.network.conftest import SquarePredictor, scene_samples


def _config(model: Path, shards: Path, out: Path) -> BuildMasksConfig:
    return BuildMasksConfig(model=model, shards=shards, out=out, workers=0, batch_size=3, progress=False)


def test_a_rank_reads_the_index_files_of_its_own_shards_alone(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(12)
    shards, out = tmp_path / "in", tmp_path / "out"
    write_shard_set(samples, shards, max_count=3)  # 4 tars: one a rank at world size 4
    last = index_path(shards / "images-000003.tar")
    last.write_text("not an index\n")  # damage only the rank that masks this tar can see
    assert build_masks(_config(tiny_model, shards, out), Ranks(1, 4, 0), predictor=SquarePredictor()) is None
    assert (out / "masked-000001.tar").is_file()
    with pytest.raises(ValueError, match="images-000003.idx"):  # its own rank still refuses it
        build_masks(_config(tiny_model, shards, out), Ranks(3, 4, 0), predictor=SquarePredictor())


def test_a_rank_checks_its_shards_against_the_manifest(tmp_path, tiny_model) -> None:
    samples, _ = scene_samples(12)
    shards = tmp_path / "in"
    write_shard_set(samples, shards, max_count=3)
    tar = shards / "images-000002.tar"
    lines = index_path(tar).read_text().splitlines()
    index_path(tar).write_text("\n".join([f"{lines[0].split()[0]} {len(lines) - 2}", *lines[1:-1]]) + "\n")
    with pytest.raises(ShardSetError, match="images-000002.tar: the index lists 2 samples, the manifest 3"):
        build_masks(_config(tiny_model, shards, tmp_path / "out"), Ranks(2, 4, 0), predictor=SquarePredictor())
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_checking_the_input_tars_compares_each_path_a_bounded_number_of_times(tmp_path, monkeypatch) -> None:
    tars = [tmp_path / f"images-{n:06d}.tar" for n in range(3_000)]
    comparisons = []
    real_eq = PurePath.__eq__
    monkeypatch.setattr(PurePath, "__eq__", lambda a, b: comparisons.append(1) or real_eq(a, b))
    # Comparing each tar with every one before it (a list, not a set) was ~4.5 M comparisons here: the
    # check grew with the square of the tars and cost more than resolving their paths at ImageNet's size.
    check_input(tars, tmp_path / "out")
    assert len(comparisons) <= 2 * len(tars), f"{len(comparisons):,} path comparisons for {len(tars):,} tars"
    monkeypatch.undo()
    with pytest.raises(MasksError, match="more than once"):
        check_input([*tars, tars[1]], tmp_path / "out")
